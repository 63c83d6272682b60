"""Agents pay torch's lazy imports at start-up, not inside their first round."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys, time
import torch
from fedagent.tasks.base import warm_up_torch
before = "torch._dynamo" in sys.modules
took = warm_up_torch()
after = "torch._dynamo" in sys.modules
started = time.process_time()
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
print(json.dumps({"before": before, "after": after, "took": took, "next": time.process_time() - started}))
"""


@pytest.mark.procs
def test_the_first_optimiser_costs_nothing_after_the_warm_up():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=True)
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    # torch imports its compiler stack when the first optimiser is built: the warm-up
    # does that, so the first optimiser of the first round is as cheap as any later one.
    assert probe["before"] is False and probe["after"] is True
    assert probe["took"] > 0
    assert probe["next"] < 0.2


def test_the_agent_warms_up_only_for_tasks_that_build_an_optimiser():
    from fedagent.agent.core import Agent
    from fedagent.tasks.digits import DigitsTask
    from fedagent.tasks.word2vec import Word2VecTask

    # Agent.__init__ warms up when its task says it trains with a torch optimiser;
    # word2vec trains without one and would only pay for the imports.
    code = Agent.__init__.__code__
    assert {"warm_up_torch", "uses_torch_optimiser"} <= set(code.co_names) | set(code.co_consts)
    assert DigitsTask.uses_torch_optimiser is True
    assert Word2VecTask.uses_torch_optimiser is False
