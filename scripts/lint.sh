#!/usr/bin/env bash
# Static checks run before the tests (and by CI through scripts/test.sh): ruff lint and
# format, mypy on src/, and no import cycle in src/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin
$PY/ruff check src tests bench scripts examples
$PY/ruff format --check src tests bench scripts examples
$PY/mypy
$PY/python scripts/import_cycles.py
