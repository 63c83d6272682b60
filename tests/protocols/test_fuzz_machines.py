"""A short Hypothesis run of tests/fuzz_machines.py: random event
sequences, with malformed bodies, into the round machine, the participant, the gossip
machine, the chunk reassembler and the signature verifier. Only the project's own
error type may escape, and the machines' invariants hold after every event. The long
run (10**6 events) is ``python tests/fuzz_machines.py``."""

from __future__ import annotations

import random

import fuzz_machines as FM
from hypothesis import given, settings
from hypothesis import strategies as st

from fedagent.errors import FedagentError

_IDENTITY = FM._identity()


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(20, 150))
def test_event_sequences_raise_only_project_errors_and_keep_invariants(seed, length) -> None:
    rnd = random.Random(seed)
    h = FM.Harness(rnd)
    identity, verifier = _IDENTITY
    for n in range(length):
        try:
            if n % 25 == 24:
                FM.signed_frames(rnd, verifier, identity)
            else:
                h.step()
        except FedagentError:
            pass


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["presence", "update", "round_start", "round_result", "model", "gossip_model", "gossip_ack"]),
    st.dictionaries(
        st.sampled_from(["round", "weights", "mass", "online", "selected", "x", "train"]),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.binary(max_size=16),
            lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
            max_leaves=10,
        ),
    ),
)
def test_arbitrary_bodies_are_refused_with_codec_errors_only(kind, body) -> None:
    from fedagent.protocols.messages import body_of

    try:
        body_of(kind, body, FM.LIMITS[0])
    except FedagentError:
        pass
