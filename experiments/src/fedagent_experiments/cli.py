"""`fedagent experiment`: the papers' experiments, each writing a report."""

from __future__ import annotations

import math
from pathlib import Path

import click

from fedagent.cli.app import fail
from fedagent.errors import ConfigError, FedagentError


@click.group()
def experiment() -> None:
    """Paper experiments, each writing a report (markdown + PNG plots).

    flsimco trains every strategy through a real coordinator and agent processes over
    Mosquitto; gfedntm trains Fig. 2's many models in process or in --jobs workers (Sync-Opt computed in
    process, which the exactness test shows equals the network path) and runs one
    setting again through a real coordinator and agents over Mosquitto."""
    # SIGTERM and SIGHUP would otherwise end the process without running a single
    # ``finally``: the daemons an experiment started would be left running and its work
    # directory left behind. As an exception they unwind the experiment, and the exit
    # status is 128 + the signal's number (Ctrl-C too, which click would report as 1).
    from fedagent.stopsignals import stop_signals

    click.get_current_context().with_resource(stop_signals())


@experiment.command("flsimco")
@click.option("--rounds", default=10, show_default=True, help="RSU rounds per strategy")
@click.option("--coverage", default=4, show_default=True, help="vehicles in range of the RSU per round")
@click.option("--stay", default=2, show_default=True, help="rounds each vehicle stays in range")
@click.option("--alpha", default=1.0, show_default=True, help="Dirichlet label skew over the shards (0 = IID)")
@click.option("--threshold", default=100.0, show_default=True, help="km/h above which baseline 2 drops a model")
@click.option("--local-epochs", default=2, show_default=True)
@click.option(
    "--speed",
    "speed",
    nargs=4,
    type=float,
    default=(90.0, 20.0, 50.0, 130.0),
    show_default=True,
    metavar="MU SIGMA V_MIN V_MAX",
    help="eq. 1: truncated Gaussian of vehicle speeds (km/h)",
)
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--strategy",
    "strategies",
    multiple=True,
    type=click.Choice(["blur", "fedavg", "drop_above"]),
    help="run only these (default: all three)",
)
@click.option("--out", type=click.Path(path_type=Path), default=Path("flsimco-report"), show_default=True)
@click.option("--keep", is_flag=True, help="keep the work directory (logs, checkpoints, histories)")
def experiment_flsimco(
    rounds: int,
    coverage: int,
    stay: int,
    alpha: float,
    threshold: float,
    local_epochs: int,
    speed: tuple[float, float, float, float],
    seed: int,
    strategies: tuple[str, ...],
    out: Path,
    keep: bool,
) -> None:
    """FLSimCo: vehicles join and leave an RSU; blur-weighted (eq. 11) vs FedAvg vs dropping fast vehicles."""
    try:
        from fedagent_experiments.flsimco import STRATEGIES, Setup, run_experiment

        if rounds < 1 or coverage < 1 or stay < 1:
            raise ConfigError("--rounds, --coverage and --stay must be at least 1")
        mu, sigma, v_min, v_max = speed
        if not (sigma > 0 and 0 <= v_min < v_max):
            raise ConfigError("--speed: need SIGMA > 0 and 0 <= V_MIN < V_MAX")
        setup = Setup(
            rounds=rounds,
            coverage=coverage,
            stay=stay,
            alpha=alpha,
            threshold=threshold,
            local_epochs=local_epochs,
            seed=seed,
            mobility={"mu": mu, "sigma": sigma, "v_min": v_min, "v_max": v_max},
        )
        run_experiment(out, setup, strategies or STRATEGIES, keep=keep)
    except FedagentError as exc:
        fail(exc)


@experiment.command("gossip-w2v")
@click.option(
    "--scale",
    "scale_name",
    type=click.Choice(["default", "tiny"]),
    default="default",
    show_default=True,
    help="default: 10 agents, 3 seeds, paced, ~6 min a configuration, ~2 h in all; tiny: 3 agents, a smoke test",
)
@click.option("--local-steps", type=int, default=None, help="batches per agent (centralized gets agents x this)")
@click.option("--dim", type=int, default=None, help="embedding size")
@click.option("--seeds", type=str, default=None, help="comma-separated seeds of every gossip configuration (1,2,3)")
@click.option(
    "--central-seeds", type=str, default=None, help="comma-separated seeds of the centralized runs (at least two)"
)
@click.option(
    "--config",
    "configs",
    multiple=True,
    help="run only these configurations (topic-frequent, random-frequent, imbalanced-frequent, "
    "half-frequent, topic-infrequent, random-infrequent, imbalanced-infrequent, local)",
)
@click.option(
    "--merge",
    type=click.Choice(["pushsum", "average"]),
    default=None,
    help="the agents' merge in every configuration but thesis-literal (default: the scale's)",
)
@click.option(
    "--outer-step",
    type=float,
    default=None,
    help="the agents' [gossip] outer_step B: step lr x N / B between exchanges, adopt start + B x the progress "
    "(default 1: lr x N)",
)
@click.option(
    "--period-seconds",
    type=float,
    default=None,
    help="the agents' [gossip] period_seconds in the frequent configurations (infrequent ones: x5, the same "
    "time per batch): every period lasts at least this long, which keeps agents of unequal speed in step "
    "(default scale: 1.2; 0: unpaced)",
)
@click.option("--out", type=click.Path(path_type=Path), default=Path("gossip-w2v-report"), show_default=True)
@click.option("--keep", is_flag=True, help="keep the work directories (logs, checkpoints, histories)")
@click.option("--report-only", is_flag=True, help="run nothing new: rebuild the report from OUT/runs/")
def experiment_gossip_w2v(
    scale_name: str,
    local_steps: int | None,
    dim: int | None,
    seeds: str | None,
    central_seeds: str | None,
    configs: tuple[str, ...],
    merge: str | None,
    outer_step: float | None,
    period_seconds: float | None,
    out: Path,
    keep: bool,
    report_only: bool,
) -> None:
    """Gossip Word2Vec (the thesis): 10 gossip agents, topic/random/imbalanced splits, frequent/infrequent/half
    exchange and local-only, against centralized training with the same number of batches."""
    from dataclasses import replace

    try:
        from fedagent_experiments import gossip_w2v

        scale = gossip_w2v.SCALES[scale_name]
        for name, value in (("local_steps", local_steps), ("dim", dim)):
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
        scale = replace(
            scale,
            local_steps=scale.local_steps if local_steps is None else local_steps,
            dim=scale.dim if dim is None else dim,
            merge=scale.merge if merge is None else merge,
            outer_step=scale.outer_step if outer_step is None else outer_step,
            period_seconds=scale.period_seconds if period_seconds is None else period_seconds,
        )
        if not (math.isfinite(scale.outer_step) and scale.outer_step > 0):
            raise ConfigError(f"--outer-step must be a positive number, not {scale.outer_step}")
        if not (math.isfinite(scale.period_seconds) and 0 <= scale.period_seconds <= 3600):
            raise ConfigError(f"--period-seconds must be 0..3600 seconds, not {scale.period_seconds}")
        for name, text in (("seeds", seeds), ("central_seeds", central_seeds)):
            if text is None:
                continue
            try:
                values = tuple(int(x) for x in text.split(","))
            except ValueError:
                raise ConfigError(
                    f"--{name.replace('_', '-')}: expected comma-separated integers, not {text!r}"
                ) from None
            if len(set(values)) != len(values) or (name == "central_seeds" and len(values) < 2):
                raise ConfigError(f"--{name.replace('_', '-')}: distinct seeds, at least two centralized ones")
            scale = replace(scale, seeds=values) if name == "seeds" else replace(scale, central_seeds=values)
        known = {c.name for c in gossip_w2v.configurations(scale)}
        if set(configs) - known:
            raise ConfigError(f"unknown configurations {sorted(set(configs) - known)}; known: {sorted(known)}")
        gossip_w2v.run_experiment(out, scale, configs, keep=keep, report_only=report_only)
    except FedagentError as exc:
        fail(exc)


@experiment.command("gfedntm")
@click.option(
    "--corpus",
    type=click.Choice(["all", "synthetic", "newsgroups"]),
    default="all",
    show_default=True,
    help="synthetic: Fig. 2 (Sec. 4.1); newsgroups: gensim's sample, one newsgroup per agent; all: both, in one report",
)
@click.option(
    "--scale",
    "scale_name",
    type=click.Choice(["default", "paper", "tiny"]),
    default="default",
    show_default=True,
    help="synthetic sizes (default: under an hour on 2 busy cores; paper: Sec. 4.1's)",
)
@click.option(
    "--jobs",
    type=int,
    default=1,
    show_default=True,
    help="synthetic: settings trained in this many worker processes at once",
)
@click.option(
    "--daemons/--no-daemons",
    default=True,
    show_default=True,
    help="synthetic: also train K'=10, eta=0.01 through a coordinator and agent processes over Mosquitto",
)
@click.option(
    "--daemons-only",
    is_flag=True,
    help="synthetic: only the run through the daemons (seeds --seed .. --seed + --seeds - 1, default one), "
    "merged into the report already in --out (its in-process tables are kept)",
)
@click.option(
    "--float64",
    is_flag=True,
    help="with --daemons-only: every model in float64 and the coordinator in float64 mode",
)
@click.option(
    "--epochs",
    type=int,
    default=None,
    help="passes of every node over its documents (synthetic: at most this many, with early stopping)",
)
@click.option("--seeds", type=int, default=None, help="synthetic: seeds per setting (mean and spread reported)")
@click.option(
    "--patience",
    type=int,
    default=None,
    help="synthetic: early-stopping patience in epochs (0: exactly --epochs passes, no split)",
)
@click.option("--docs", type=int, default=None, help="synthetic: training documents per node")
@click.option("--vocab-size", type=int, default=None, help="synthetic: V")
@click.option("--k-prime", "k_primes", multiple=True, type=int, help="synthetic: shared topics (default 5 10 15 40)")
@click.option(
    "--eta",
    "etas",
    multiple=True,
    type=float,
    help="synthetic: topic priors for setting B (default 0.01 0.02 0.03 0.04 0.08 1)",
)
@click.option(
    "--model",
    type=click.Choice(["prodlda", "combinedtm"]),
    default="combinedtm",
    show_default=True,
    help="newsgroups: the topic model (combinedtm uses the offline SBERT model)",
)
@click.option("--n-topics", type=int, default=10, show_default=True, help="newsgroups: K")
@click.option("--seed", default=0, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("gfedntm-report"), show_default=True)
def experiment_gfedntm(
    corpus: str,
    scale_name: str,
    epochs: int | None,
    seeds: int | None,
    patience: int | None,
    docs: int | None,
    vocab_size: int | None,
    jobs: int,
    daemons: bool,
    daemons_only: bool,
    float64: bool,
    k_primes: tuple[int, ...],
    etas: tuple[float, ...],
    model: str,
    n_topics: int,
    seed: int,
    out: Path,
) -> None:
    """gFedNTM: centralized vs federated (Sync-Opt) vs non-collaborative topic models (Fig. 2)."""
    from dataclasses import replace

    try:
        from fedagent_experiments import gfedntm

        news = gfedntm.NewsScale(model=model, n_topics=n_topics, seed=seed)
        if corpus == "newsgroups":
            if epochs is not None:
                news = replace(news, epochs=epochs)
            gfedntm.run_newsgroups(out, news)
            return
        scale = replace(gfedntm.SCALES[scale_name], seed=seed)
        for name, value in (("epochs", epochs), ("docs", docs), ("vocab_size", vocab_size)):
            if value is not None:
                if value < 1:
                    raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
                scale = replace(scale, **{name: value})
        if seeds is not None:
            if seeds < 1:
                raise ConfigError("--seeds must be at least 1")
            scale = replace(scale, seeds=seeds)
        if patience is not None:
            if patience < 0:
                raise ConfigError("--patience must be at least 0")
            scale = replace(scale, patience=patience)
        k_primes = k_primes or gfedntm.K_PRIME
        setting = (10, 0.01) if 10 in k_primes else (k_primes[0], 0.01)
        if float64 and not daemons_only:
            raise ConfigError("--float64 goes with --daemons-only (the in-process tables are float32)")
        if daemons_only:
            if corpus != "synthetic":
                raise ConfigError("--daemons-only goes with --corpus synthetic")
            gfedntm.run_daemons_only(
                out,
                scale if seeds is not None else replace(scale, seeds=1),
                setting,
                [seed + i for i in range(seeds or 1)],
                "float64" if float64 else "float32",
            )
            return
        if jobs < 1:
            raise ConfigError("--jobs must be at least 1")
        gfedntm.run_synthetic(
            out, scale, k_primes, etas or gfedntm.ETAS, daemons=setting if daemons else None, jobs=jobs
        )
        if corpus == "all":
            gfedntm.run_newsgroups(out, news)
            gfedntm.report_from_json(out)  # the report now quotes the newsgroups run too
    except FedagentError as exc:
        fail(exc)


@experiment.command("dp-digits")
@click.option("--rounds", default=80, show_default=True, help="DP-FedAvg rounds per run")
@click.option("--seeds", default=3, show_default=True, help="seeds per epsilon")
@click.option("--fixed-clip", is_flag=True, help="a fixed clip norm instead of adaptive clipping")
@click.option("--out", type=click.Path(path_type=Path), default=Path("results/dp_digits"), show_default=True)
def experiment_dp_digits(rounds: int, seeds: int, fixed_clip: bool, out: Path) -> None:
    """Accuracy against epsilon (1, 3, 8, no DP) of DP-FedAvg on digits, simulated in-process."""
    try:
        from fedagent_experiments.dp_digits import Setup, run_experiment

        md = run_experiment(out, Setup(rounds=rounds, seeds=tuple(range(seeds)), adaptive=not fixed_clip))
    except FedagentError as exc:
        fail(exc)
    click.echo(f"report: {md}")


@experiment.command("seec")
@click.option(
    "--scale",
    "scale_name",
    type=click.Choice(["default", "paper", "tiny"]),
    default="default",
    show_default=True,
    help="default: all documents, 10 epochs and a second centralized model (the ceiling; "
    "~30 min on 2 heavily shared cores); paper: 40 epochs, 40 inference passes; tiny: a smoke run",
)
@click.option("--sites", type=int, default=None, help="agents / edge sites [default: 3]")
@click.option(
    "--epochs",
    type=int,
    default=None,
    help="passes over the data (joint learning: --rounds-per-epoch FedAvg rounds each)",
)
@click.option("--seed", default=0, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("seec-report"), show_default=True)
@click.option("--keep", is_flag=True, help="keep the federation's work directory (logs, checkpoints)")
@click.option(
    "--corpus",
    type=click.Choice(["wiki", "manpages"]),
    default="wiki",
    show_default=True,
    help="private data: gensim's Wikipedia articles (105) or the Linux manual pages (1,083)",
)
@click.option("--limit", type=int, default=None, help="use only the corpus's first N documents (0: all)")
@click.option("--dim", type=int, default=None, help="doc2vec vector size d [default: 100 on the man pages, 50 on wiki]")
@click.option(
    "--rounds-per-epoch",
    type=int,
    default=None,
    help="joint learning: FedAvg rounds per pass over the data (a round is that fraction of a local epoch) "
    "[default: 10 on the man pages, 1 on wiki]",
)
@click.option(
    "--server-lr",
    type=float,
    default=None,
    help="joint learning: the coordinator's server step [default: 2 on the man pages, 1 on wiki]",
)
def experiment_seec(
    scale_name: str,
    sites: int | None,
    epochs: int | None,
    seed: int,
    out: Path,
    keep: bool,
    corpus: str,
    limit: int | None,
    dim: int | None,
    rounds_per_epoch: int | None,
    server_lr: float | None,
) -> None:
    """SEEC: joint doc2vec learning (daemons) and vector-space mapping vs centralized (sim_10)."""
    from dataclasses import replace

    try:
        from fedagent_experiments import seec

        scale = replace(seec.SCALES[scale_name], seed=seed)
        for name, value in (("sites", sites), ("epochs", epochs)):
            if value is not None and value < (2 if name == "sites" else 1):
                raise ConfigError(f"--{name} is too small")
        scale = replace(
            scale,
            sites=scale.sites if sites is None else sites,
            epochs=scale.epochs if epochs is None else epochs,
            corpus=corpus,
            limit=scale.limit if limit is None else limit,
        )
        joint = seec.JOINT_SETTINGS.get(corpus, (scale.rounds_per_epoch, scale.server_lr))
        scale = replace(
            scale,
            dim=seec.CORPUS_DIM.get(corpus, scale.dim) if dim is None else dim,
            rounds_per_epoch=joint[0] if rounds_per_epoch is None else rounds_per_epoch,
            server_lr=joint[1] if server_lr is None else server_lr,
        )
        if scale.limit < 0:
            raise ConfigError("--limit must be at least 0")
        if not 1 <= scale.dim <= 1000:
            raise ConfigError("--dim must be in [1, 1000]")
        if scale.rounds_per_epoch < 1 or not 0 < scale.server_lr <= 100:
            raise ConfigError("--rounds-per-epoch must be at least 1 and --server-lr in (0, 100]")
        seec.run_experiment(out, scale, keep=keep)
    except FedagentError as exc:
        fail(exc)
