"""The server step of FedAvg rounds, as the round machine's collaborator: from a round's
aggregate to the next global model with ``server_lr`` and server momentum
(:mod:`fedagent.protocols.serveropt`), the velocity kept in memory or streamed through a
store, and with the int8 downlink the model as the agents rebuild it from its step
(:mod:`fedagent.protocols.downlink`). What the model's fingerprint says of each tensor
(:class:`~fedagent.protocols.fingerprint.Roles`) decides what the step moves: trainable
parameters only; buffers are the aggregate's and travel whole in the downlink, and with
``local_norm`` the normalisation layers keep the global model's values."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fedagent.protocols.downlink import ModelDelta, quantize_step
from fedagent.protocols.fingerprint import Roles
from fedagent.protocols.serveropt import (
    VelocityStore,
    VelocityWriter,
    check_velocity,
    momentum_step,
    momentum_step_into,
    velocity_layout,
)

Weights = dict[str, np.ndarray]


class ServerStep:
    """A step is proposed (:meth:`propose`), then adopted (:meth:`adopt`) or dropped
    (:meth:`drop`, its aggregate was refused): a velocity a store is writing becomes the
    store's only when its model does. ``velocity``: the one a checkpoint kept (ValueError
    if it does not fit ``weights``; ignored without momentum); ``store``: where the
    velocity is kept instead (it holds the resumed one, and ``velocity`` must be empty);
    ``roles``: what each tensor is to the model (default: every floating tensor a
    trainable parameter)."""

    def __init__(
        self,
        weights: Mapping[str, np.ndarray],
        *,
        server_lr: float,
        momentum: float,
        downlink: str,
        velocity: Mapping[str, np.ndarray] | None = None,
        store: VelocityStore | None = None,
        roles: Roles | None = None,
    ) -> None:
        if velocity and store is not None:
            raise ValueError("a velocity is given both in memory and in a store")
        self.roles = roles or Roles()
        self.server_lr = server_lr
        self.momentum = momentum
        self.downlink = downlink
        self.store = store
        self._writer: VelocityWriter | None = None  # the next velocity, until adopted
        self.velocity: Weights = {}
        if velocity and momentum > 0:
            check_velocity(weights, velocity)
            self.velocity = {k: v for k, v in velocity.items() if k not in self.roles.fixed}
        # the current model as the step from the version before (downlink = "int8"); None
        # after a restart or before the first aggregation: round starts send it whole
        self.delta: ModelDelta | None = None

    def propose(self, weights: Weights, aggregate: Weights, version: int) -> tuple[Weights, Weights]:
        """The next global model and velocity from the round's aggregate, stepping from
        ``weights`` (model ``version``); neither adopted yet."""
        roles = self.roles
        if roles.kept:
            aggregate = {k: weights[k] if k in roles.kept else v for k, v in aggregate.items()}
        store = self.store
        if store is None or self.momentum == 0:
            return momentum_step(
                weights, aggregate, self.velocity, lr=self.server_lr, beta=self.momentum, fixed=roles.fixed
            )
        self.drop()
        writer = store.begin(velocity_layout(weights), version + 1)
        try:
            new = momentum_step_into(
                weights, aggregate, store, writer, lr=self.server_lr, beta=self.momentum, fixed=roles.fixed
            )
        except BaseException:
            store.discard(writer)
            raise
        self._writer = writer
        return new, {}

    def adopt(self, weights: Weights, new: Weights, velocity: Weights, version: int) -> Weights:
        """The proposed step is taken: the global model it makes from ``weights`` (model
        ``version``), which the caller keeps as the next version."""
        writer, self._writer = self._writer, None
        if writer is not None:
            assert self.store is not None
            self.store.adopt(writer)
        if self.downlink == "int8":
            # The model becomes what the agents rebuild from the step sent to them (the
            # previous step goes first: it is the next one's memory).
            self.delta = None
            new, self.delta = quantize_step(weights, new, version, whole=self.roles.fixed)
        self.velocity = velocity
        return new

    def drop(self) -> None:
        """A proposed step's velocity that will not be adopted (its aggregate was refused)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            assert self.store is not None
            self.store.discard(writer)
