#!/usr/bin/env bash
# Runs fedagent's benchmark suite from a fresh clone: bootstraps .venv, installs the
# Mosquitto C clients (the broker baseline) if missing, then runs bench/run.py with
# the arguments given (e.g. --quick, --only round). Flower is installed by the suite
# itself into bench/.venv-flower on first use.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
if ! command -v mosquitto_pub >/dev/null 2>&1 || ! command -v mosquitto_sub >/dev/null 2>&1; then
  echo "bench: installing mosquitto-clients with apt-get" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq mosquitto-clients >/dev/null
fi
exec .venv/bin/python bench/run.py "$@"
