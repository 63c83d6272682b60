#!/usr/bin/env bash
# Sets up (see bootstrap.sh), runs the static checks (lint.sh: ruff, mypy) and then the
# whole test suite against a real Mosquitto.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
./scripts/lint.sh
exec .venv/bin/python -m pytest -q "$@"
