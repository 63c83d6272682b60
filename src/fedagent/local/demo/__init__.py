"""``fedagent demo``: a whole federation on this machine, end to end.

A private Mosquitto (its own CA, certificates, ACL, a free loopback port), a
coordinator and N agents as separate processes that find the coordinator by mDNS on
loopback (:class:`fedagent.local.federation.Federation`), then one of three modes: FedAvg
rounds on the built-in digits task split non-IID (:mod:`.fedavg`), gossip without a
coordinator (:mod:`.gossip`), Sync-Opt (gFedNTM) on synthetic documents
(:mod:`.syncopt`), or asynchronous buffered FedAvg with a slow agent and one that keeps
losing its link, against the same federation in rounds (:mod:`.fedbuff`), or FedAvg in two tiers, site aggregators between the agents and the
hub, after the same agents flat (:mod:`.tiers`). At the end the federated result is compared with local-only and
centralized training (:mod:`.references`).

Every mode goes through one runner, :func:`run` (:mod:`.runner`): whatever ends a demo,
every process it started is stopped and its work directory removed (unless ``--keep``).
"""

from fedagent.local.demo.fedavg import run_demo, run_dp_demo
from fedagent.local.demo.fedbuff import run_async_demo
from fedagent.local.demo.gossip import run_gossip_demo
from fedagent.local.demo.references import train_reference, train_reference_steps
from fedagent.local.demo.runner import Plan, Watch, run
from fedagent.local.demo.syncopt import run_syncopt_demo
from fedagent.local.demo.tiers import run_sites_demo

__all__ = [
    "Plan",
    "Watch",
    "run",
    "run_async_demo",
    "run_demo",
    "run_dp_demo",
    "run_gossip_demo",
    "run_sites_demo",
    "run_syncopt_demo",
    "train_reference",
    "train_reference_steps",
]
