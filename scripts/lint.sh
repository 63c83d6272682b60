#!/usr/bin/env bash
# Static checks run before the tests (and by CI through scripts/test.sh): ruff lint and
# format, mypy on src/, the layering contract (pyproject's [tool.importlinter]) and no
# import cycle in src/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin
$PY/ruff check src tests bench scripts examples experiments
$PY/ruff format --check src tests bench scripts examples experiments
$PY/mypy
$PY/lint-imports --no-cache
$PY/python scripts/import_cycles.py
