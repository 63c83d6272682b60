#!/usr/bin/env bash
# Sets up (see bootstrap.sh) and runs `fedagent demo`: a whole federation on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
exec .venv/bin/fedagent demo "$@"
