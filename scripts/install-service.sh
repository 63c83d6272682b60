#!/usr/bin/env bash
# Installs fedagent as systemd services on a Debian machine:
#   /opt/fedagent          a virtualenv with fedagent and the pinned CPU torch
#   /usr/bin/fedagent      the CLI
#   /etc/systemd/system/   fedagent-agent.service, fedagent-coordinator.service,
#                          fedagent-aggregator.service (a site aggregator)
#   /etc/fedagent/         agent.toml, coordinator.toml, aggregator.toml (kept if present),
#                          tls/ (0700)
# State lives in /var/lib/fedagent-{agent,coordinator,aggregator} (DynamicUser, created by
# systemd).
#
# usage: scripts/install-service.sh [--root DIR] [--no-venv --fedagent-bin PATH]
#   --root DIR       install below DIR instead of / (for packaging and tests)
#   --no-venv        don't build /opt/fedagent; link /usr/bin/fedagent to --fedagent-bin
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
root=""
venv=1
bin=""
while [ $# -gt 0 ]; do
  case "$1" in
    --root) root=$(realpath -m "$2"); shift 2 ;;
    --no-venv) venv=0; shift ;;
    --fedagent-bin) bin=$2; shift 2 ;;
    *) echo "install-service: unknown argument $1" >&2; exit 64 ;;
  esac
done

install -d -m 0755 "$root/usr/bin" "$root/etc/systemd/system"
install -d -m 0755 "$root/etc/fedagent"
install -d -m 0700 "$root/etc/fedagent/tls"

if [ "$venv" = 1 ]; then
  python3 -m venv "$root/opt/fedagent"
  "$root/opt/fedagent/bin/pip" install -q "torch==2.13.0"
  "$root/opt/fedagent/bin/pip" install -q "$src"
  ln -sfn /opt/fedagent/bin/fedagent "$root/usr/bin/fedagent"
else
  [ -n "$bin" ] && [ -x "$bin" ] || { echo "install-service: --no-venv needs --fedagent-bin PATH" >&2; exit 64; }
  printf '#!/bin/sh\nexec %s "$@"\n' "$(realpath "$bin")" > "$root/usr/bin/fedagent"
  chmod 0755 "$root/usr/bin/fedagent"
fi

for unit in fedagent-agent.service fedagent-coordinator.service fedagent-aggregator.service; do
  install -m 0644 "$src/systemd/$unit" "$root/etc/systemd/system/$unit"
done
for conf in agent.toml coordinator.toml aggregator.toml; do
  # Never overwrite an operator's config; world-readable so the dynamic user can read it
  # (it holds no secret: keys go through LoadCredential=).
  [ -e "$root/etc/fedagent/$conf" ] || install -m 0644 "$src/systemd/$conf" "$root/etc/fedagent/$conf"
done

if [ -z "$root" ] && [ -d /run/systemd/system ]; then
  systemctl daemon-reload
fi
cat <<MSG
fedagent installed${root:+ below $root}. Next:
  1. put ca.crt, agent.crt, agent.key (and/or coordinator.crt/.key; for a site aggregator
     aggregator.crt/.key and aggregator-up.crt/.key) in /etc/fedagent/tls/
  2. set id (and interfaces) in /etc/fedagent/agent.toml
  3. systemctl enable --now fedagent-agent
  4. fedagent join FEDERATION --config /etc/fedagent/agent.toml; fedagent status
MSG
