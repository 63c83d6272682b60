#!/usr/bin/env bash
# Static checks run before the tests (and by CI through scripts/test.sh): ruff lint and
# format, mypy on src/, the layering contract (pyproject's [tool.importlinter]), no
# import cycle in src/, and the Prometheus rules in prometheus/: valid, with the example
# configuration that loads them, and their unit tests passing (promtool; bootstrap.sh
# installs it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin
$PY/ruff check src tests bench scripts examples experiments
$PY/ruff format --check src tests bench scripts examples experiments
$PY/mypy
$PY/lint-imports --no-cache
$PY/python scripts/import_cycles.py
promtool check config --lint=all prometheus/prometheus.yml >/dev/null
promtool test rules prometheus/*.test.yml
