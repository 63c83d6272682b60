#!/usr/bin/env bash
# Installs everything fedagent needs on a fresh Debian machine, idempotently:
# Mosquitto (the broker the demo and the tests run), a virtualenv in .venv with the
# pinned CPU build of torch, and fedagent itself in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || need_apt+=(mosquitto)
# mosquitto_pub/mosquitto_sub: the C clients the benchmark sections (and their tests)
# measure fedagent against.
command -v mosquitto_pub >/dev/null 2>&1 && command -v mosquitto_sub >/dev/null 2>&1 || need_apt+=(mosquitto-clients)
command -v systemd-analyze >/dev/null 2>&1 || need_apt+=(systemd)
# Fault-injection tests (tests/faults, tests/net): packet loss and NFQUEUE delay,
# partitions, wall-clock jumps; headers to build the netfilterqueue wheel.
command -v iptables >/dev/null 2>&1 || [ -x /usr/sbin/iptables ] || need_apt+=(iptables)
command -v nft >/dev/null 2>&1 || [ -x /usr/sbin/nft ] || need_apt+=(nftables)
command -v faketime >/dev/null 2>&1 || need_apt+=(faketime)
[ -e /usr/include/libnetfilter_queue/libnetfilter_queue.h ] || need_apt+=(libnetfilter-queue-dev)
# The Linux manual pages: the offline corpus of 1,083 documents for SEEC and Word2Vec
# (doc2vec corpus = "manpages"; fedagent.tasks.text_data.manpages); the FreeBSD manual
# pages: the public corpus SEEC's mappers learn from next to them ([search] public_corpus).
for pkg in manpages manpages-dev freebsd-manpages; do
  dpkg -s "$pkg" >/dev/null 2>&1 || need_apt+=("$pkg")
done
# Prometheus and promtool: lint.sh checks and unit-tests the alerting rules in prometheus/,
# and an integration test runs a real Prometheus against a federation.
new_prometheus=""
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  need_apt+=(prometheus)
  new_prometheus=1
fi
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "bootstrap: installing ${need_apt[*]} with apt-get" >&2
  $SUDO apt-get update -qq
  # No recommends: Debian's prometheus recommends the node exporter, a second server.
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
# The package enables a Prometheus service listening on every interface (:9090); only its
# binaries are wanted here (the test starts its own on loopback), so a service this run
# brought along is stopped and disabled again.
if [ -n "$new_prometheus" ] && [ -d /run/systemd/system ] && systemctl is-enabled --quiet prometheus 2>/dev/null; then
  echo "bootstrap: stopping and disabling the prometheus service the package started" >&2
  $SUDO systemctl disable --now prometheus >/dev/null 2>&1 || true
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv" >&2
  "$PY" -m venv .venv
fi
stamp=.venv/.fedagent-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ experiments/pyproject.toml -nt "$stamp" ]; then
  echo "bootstrap: installing Python dependencies into .venv (first run takes a minute)" >&2
  .venv/bin/pip install -q --upgrade pip >/dev/null 2>&1 || true
  # torch first and pinned: a bare 'torch' requirement would pull a multi-GB CUDA build.
  .venv/bin/pip install -q "torch==2.13.0"
  # fedagent with the test tools, and the papers' experiments (a distribution of their
  # own, adding `fedagent experiment`), both editable.
  .venv/bin/pip install -q -e ".[test]" -e ./experiments
  touch "$stamp"
fi
# Only the slow degraded-network test needs it (added delay); a failed build must not stop the set-up.
.venv/bin/python -c "import netfilterqueue" 2>/dev/null || .venv/bin/pip install -q "netfilterqueue==1.1.0" \
  || echo "bootstrap: netfilterqueue did not build; the slow degraded-network test will fail" >&2
