"""`fedagent search` across three agents of a *mapped* SEEC federation (Algorithm 2).

Starts a private Mosquitto (mutual TLS) and three agent processes with
``[search] space = "mapped"``: each holds a third of the 105 Wikipedia articles and
trains its own PV-DBOW model of its own dimension (50, 40, 60) with its own vocabulary;
the public corpus is the 200 newsgroups posts. Then runs the CLI for two queries on
agent-1 and writes what it printed to ``OUT`` (default results/seec/search-mapped.txt).

    .venv/bin/python experiments/scripts/seec_mapped_search.py [OUT]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fedagent.local.federation import Federation
from fedagent.node.control import request

DIMS = (50, 40, 60)
OPTIONS = {"corpus": "wiki", "limit": 105, "holdout": 0.0, "min_count": 2, "infer_epochs": 10, "seed": 0}
SEARCH = {"space": "mapped", "local_epochs": 10, "public_docs": 200, "mapper_epochs": 150, "mapper_lr": 1e-3}
QUERIES = ("anarchism and the political philosophy of the state", "the atomic number and chemical elements")


def main() -> int:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "results/seec/search-mapped.txt")
    with tempfile.TemporaryDirectory(prefix="seec-mapped-") as work:
        fed = Federation(
            Path(work), agents=3, rounds=1, alpha=0.0, task="doc2vec", task_options=OPTIONS, agent_broker_by_mdns=False
        )
        try:
            fed.prepare()
            assert fed.broker is not None
            for i, aid in enumerate(fed.agent_ids):
                fed._write(
                    aid, aid, fed.broker.uri, {**fed.shard_options(i), "dim": DIMS[i]}, None, "doc2vec", search=SEARCH
                )
                fed.spawn(aid)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                fed.check_alive()
                tables = [
                    request(fed.socket(a), "peers", timeout=5.0) if fed.status(a) else None for a in fed.agent_ids
                ]
                if all(
                    t and sum(r.get("role") == "agent" and bool(r.get("online")) for r in t["peers"].values()) == 2
                    for t in tables
                ):
                    break
                time.sleep(0.5)
            else:
                raise SystemExit("the agents did not see each other within 120 s")
            lines = [
                f'# three agents, [search] space = "mapped": own models d = {DIMS}, '
                f"task options {OPTIONS}, search settings {SEARCH}",
                "",
            ]
            for q in QUERIES:
                cmd = [
                    sys.executable,
                    "-m",
                    "fedagent",
                    "search",
                    q,
                    "--k",
                    "10",
                    "--timeout",
                    "300",
                    "--socket",
                    str(fed.socket("agent-1")),
                ]
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
                if r.returncode != 0:
                    raise SystemExit(f"search failed: {r.stderr}")
                lines += [f"$ fedagent search {q!r} --k 10 --timeout 300   (on agent-1)", r.stdout.rstrip(), ""]
                print(lines[-2], flush=True)
            for a in fed.agent_ids:
                s = fed.status(a) or {}
                lines.append(
                    f"{a}: space {s.get('search_space')}, public vector sets sent "
                    f"{s.get('public_vectors_sent')}, mappers trained {s.get('mappers_trained')}, "
                    f"queries answered {s.get('search_queries_answered')}"
                )
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text("\n".join(lines) + "\n")
            print(f"wrote {out}")
        finally:
            fed.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
