"""The test suites (tests/, bench/tests/, experiments/tests/) share one set of fixtures and
markers: tests/fixtures.py."""

pytest_plugins = ["fixtures"]
