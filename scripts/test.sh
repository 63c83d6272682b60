#!/usr/bin/env bash
# Sets up (see bootstrap.sh) and runs the whole test suite against a real Mosquitto.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
exec .venv/bin/python -m pytest -q "$@"
