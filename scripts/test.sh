#!/usr/bin/env bash
# Sets up (see bootstrap.sh), runs the static checks (lint.sh: ruff, mypy) and then the
# whole test suite against a real Mosquitto.
#
# Without arguments the suite runs as two pytest processes side by side: the tests that
# start processes (brokers, daemons: they leave a core idle while they wait on rounds,
# deadlines and keep-alives) and the in-process ones (a core's worth of CPU for about a
# minute and a half), whose output follows. With arguments, one pytest gets them all
# (e.g. ./scripts/test.sh tests/protocols -k secagg).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
./scripts/lint.sh
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
unit_log="$(mktemp -t fedagent-unit-tests.XXXXXX)"
unit_tmp="$(mktemp -d -t fedagent-unit-tests.XXXXXX)"  # its own: two sessions, two basetemps
trap 'rm -rf "$unit_log" "$unit_tmp"' EXIT
.venv/bin/python -m pytest -q -p no:cacheprovider -m "not slow and not procs" --basetemp "$unit_tmp" >"$unit_log" 2>&1 &
unit=$!
procs_rc=0
.venv/bin/python -m pytest -q -m "not slow and procs" || procs_rc=$?
unit_rc=0
wait "$unit" || unit_rc=$?
echo
echo "--- the in-process tests (run beside the ones above) ---"
cat "$unit_log"
echo "process tests: exit $procs_rc; in-process tests: exit $unit_rc"
# pytest exits 5 when it collects nothing: each half must have run something.
[ "$procs_rc" -eq 0 ] && [ "$unit_rc" -eq 0 ]
