"""The test suites (tests/, bench/tests/, experiments/tests/) share one set of fixtures and
markers: tests/fedfixtures.py."""

pytest_plugins = ["fedfixtures"]
