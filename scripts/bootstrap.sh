#!/usr/bin/env bash
# Installs everything fedagent needs on a fresh Debian machine, idempotently:
# Mosquitto (the broker the demo and the tests run), a virtualenv in .venv with the
# pinned CPU build of torch, and fedagent itself in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || need_apt+=(mosquitto)
command -v systemd-analyze >/dev/null 2>&1 || need_apt+=(systemd)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "bootstrap: installing ${need_apt[*]} with apt-get" >&2
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv" >&2
  "$PY" -m venv .venv
fi
stamp=.venv/.fedagent-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "bootstrap: installing Python dependencies into .venv (first run takes a minute)" >&2
  .venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
  # torch first and pinned: a bare 'torch' requirement would pull a multi-GB CUDA build.
  .venv/bin/pip install -q "torch==2.13.0"
  .venv/bin/pip install -q -e ".[test]"
  touch "$stamp"
fi
