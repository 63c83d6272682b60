"""The catch-up protocol of a returning agent, as pure code: one model request per
connection, answered only when the agent is behind and not more often than the
coordinator allows (protocols/catchup.py)."""

from __future__ import annotations

import pytest

from fedagent.errors import CodecError
from fedagent.protocols.catchup import CatchUp, ModelServer
from fedagent.protocols.codec import Limits
from fedagent.protocols.messages import KINDS, ModelRequest, body_of


def test_one_request_per_connection_whether_the_coordinator_is_known_first_or_later():
    c = CatchUp()
    assert c.coordinator_known(3) is None  # no connection yet: nothing missed
    # Connected while a coordinator is known to be online: ask at once, and only once.
    assert c.connected(True, 3) == ModelRequest(3)
    assert c.coordinator_known(3) is None
    # Connected before the coordinator's retained presence arrived: ask when it does.
    assert c.connected(False, 4) is None
    assert c.coordinator_known(5) == ModelRequest(5)
    assert c.coordinator_known(5) is None
    assert c.requests == 2


def test_the_coordinator_answers_only_an_agent_that_is_behind():
    s = ModelServer(min_interval=10.0)
    assert not s.answer("a", 7, 7, 0.0)
    assert not s.answer("a", 9, 7, 0.0)  # claims a newer model: nothing to send
    assert s.answer("a", 2, 7, 0.0)
    assert s.refused == {"current": 2, "rate": 0} and s.answered == 1


def test_repeated_requests_cost_one_model_per_interval_or_per_new_version():
    s = ModelServer(min_interval=10.0)
    assert s.answer("a", 0, 5, 100.0)
    assert not s.answer("a", 0, 5, 105.0)  # again within the interval, same version
    assert not s.answer("a", 0, 5, 109.9)
    assert s.answer("b", 0, 5, 105.0)  # another agent has its own allowance
    assert s.answer("a", 0, 6, 106.0)  # a newer model since the last answer
    assert not s.answer("a", 0, 6, 107.0)
    assert s.answer("a", 0, 6, 116.0)  # the interval has passed
    # a model that changes faster than a tenth of the interval is not sent that often
    assert not s.answer("a", 0, 7, 116.5) and s.answer("a", 0, 8, 117.0)
    assert s.answered == 5 and s.refused["rate"] == 4


def test_the_answer_table_is_bounded():
    s = ModelServer(min_interval=10.0, max_agents=2)
    for agent in ("a", "b", "c"):
        assert s.answer(agent, 0, 1, 0.0)
    assert not s.answer("c", 0, 1, 1.0) and not s.answer("b", 0, 1, 1.0)
    # "a" was forgotten first (least recently answered): its next request is answered.
    assert s.answer("a", 0, 1, 1.0)
    with pytest.raises(ValueError):
        ModelServer(min_interval=-1)


def test_model_request_body_is_validated():
    limits = Limits()
    assert KINDS["model_request"] is ModelRequest
    assert body_of("model_request", ModelRequest(12).to_body(), limits) == ModelRequest(12)
    for bad in ({}, {"have_version": -1}, {"have_version": True}, {"have_version": "1"}, {"have_version": 1, "x": 0}):
        with pytest.raises(CodecError):
            body_of("model_request", bad, limits)
