#!/bin/sh
# Coordinator state on disk vs on tmpfs (no fdatasync cost), alternated so both see the
# same load: 100 agents, swarm in a process of its own, 5 rounds each, two pairs.
set -e
cd "$(dirname "$0")/../.."
for i in 1 2; do
  nice -n 10 .venv/bin/python bench/scale.py --agents 100 --procs 1 --rounds 5 --case-limit 600 \
    --json results/scale/ab-disk-$i.json
  nice -n 10 .venv/bin/python bench/scale.py --agents 100 --procs 1 --rounds 5 --case-limit 600 \
    --tmp /dev/shm --json results/scale/ab-tmpfs-$i.json
done
