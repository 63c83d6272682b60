"""What a gFedNTM run is and what it measured: the scales it runs at, one setting's
scores, one run through the real daemons (:mod:`fedagent_experiments.gfedntm` makes them,
:mod:`fedagent_experiments.gfedntm_report` writes them up)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Scale:
    nodes: int = 5
    vocab_size: int = 500
    true_topics: int = 50
    n_topics: int = 50
    docs: int = 3000  # training documents per node (before the early-stopping split)
    val_docs: int = 200  # validation documents per node (scored, never trained on)
    epochs: int = 100  # at most this many passes of a node over its documents
    batch_size: int = 64
    seed: int = 0  # the first seed; the settings run with seeds seed .. seed + seeds - 1
    patience: int = 5  # early stopping (0: train exactly ``epochs`` passes, no split)
    holdout: float = 0.25  # share of the training documents held out for early stopping
    seeds: int = 3

    def options(self, **extra: Any) -> dict[str, Any]:
        return {
            "corpus": "synthetic",
            "shards": self.nodes,
            "vocab_size": self.vocab_size,
            "true_topics": self.true_topics,
            "n_topics": self.n_topics,
            "docs": self.docs,
            "val_docs": self.val_docs,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "data_seed": self.seed,
            **({"holdout": self.holdout} if self.patience else {}),
            **extra,
        }


# Sec. 4.1: the authors' defaults (CTM package: at most 100 epochs, patience 5) with a
# 75:25 train/validation split for early stopping.
SCALES = {
    "default": Scale(),
    "paper": Scale(vocab_size=5000, docs=10000, val_docs=1000, seeds=1),
    "tiny": Scale(
        vocab_size=120, true_topics=10, n_topics=10, docs=64, val_docs=16, epochs=3, batch_size=16, patience=1, seeds=2
    ),
}


@dataclass
class SettingResult:
    group: str  # "A" (K' varies) or "B" (eta varies)
    shared: int
    eta: float
    tss: dict[str, float] = field(default_factory=dict)
    doc_sim: dict[str, float] = field(default_factory=dict)
    tss_nodes: list[float] = field(default_factory=list)
    seconds: float = 0.0
    # TSS of the topics the BatchNorm decoder predicts (ProdLDA.decoder_topic_word)
    tss_decoder: dict[str, float] = field(default_factory=dict)
    tss_decoder_nodes: list[float] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    steps: dict[str, float] = field(default_factory=dict)  # optimizer steps of the kept model
    seed: int = 0
    # early stopping: the kept (best) epoch and the epochs trained, per model kind (the
    # non-collaborative figures are means over the nodes)
    best_epoch: dict[str, float] = field(default_factory=dict)
    epochs_run: dict[str, float] = field(default_factory=dict)


@dataclass
class DaemonResult:
    """One Fig. 2 setting trained by a coordinator and N agent processes over Mosquitto
    (mutual TLS), next to the same Sync-Opt run in this process and to centralized
    training on the concatenated mini-batches of each step."""

    shared: int
    eta: float
    steps: int
    vocabulary: int
    seconds: float
    tss: dict[str, float] = field(default_factory=dict)
    tss_decoder: dict[str, float] = field(default_factory=dict)
    doc_sim: dict[str, float] = field(default_factory=dict)
    max_abs_diff: dict[str, float] = field(default_factory=dict)  # weights vs the daemons' final ones
    exact: bool = False
    # early stopping run by the coordinator itself (patience > 0): how it ended, and the
    # in-process early-stopped federated model's kept steps to compare with
    finished_reason: str = ""
    best_epoch: int = 0
    epochs: int = 0
    steps_trained: int = 0
    in_process_steps: int | None = None
    val_losses: list[float] = field(default_factory=list)
    seed: int = 0
    dtype: str = "float32"  # the model's dtype; "float64" runs the coordinator in float64 mode
    # the same early-stopping loop in this process: its epochs, kept epoch and pooled losses
    in_process_epochs: int | None = None
    in_process_best_epoch: int | None = None
    in_process_val_losses: list[float] = field(default_factory=list)
    total_seconds: float = 0.0  # the daemons plus the in-process references and the scoring


def load_daemons(data: dict) -> list[DaemonResult]:
    """The daemon runs of a ``results.json`` (one ``daemon`` in reports before several
    seeds were run)."""
    raw = data.get("daemons")
    if raw is None:
        raw = [data["daemon"]] if data.get("daemon") else []
    return [DaemonResult(**d) for d in raw]
