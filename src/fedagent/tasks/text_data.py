"""Real text that is available offline, and its splits across agents.

Everything here comes from the data files that ship inside gensim's wheel
(``gensim/test/test_data/``); nothing is downloaded.

**Wikipedia.** ``enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2``
is a real (shortened) English Wikipedia dump: 206 main-namespace pages, of which 99 are
redirects and 107 are articles (Anarchism, Autism, Albedo, ..., about 3.1 M characters of
text). Pages are read with gensim's ``extract_pages`` (namespace 0 only, redirects
dropped) and their wiki markup is stripped with gensim's ``filter_wiki``, which removes
comments, ``<ref>`` footnotes, templates ``{{...}}``, tables, files and images, external
link targets and HTML tags and keeps the visible text of internal links
(``[[target|text]]`` -> ``text``). The text is then tokenised: lower-cased, runs of
letters only (no digits, no punctuation), 2 to 20 characters, and the English stop words
the gossip-learning thesis removes (its Appendix A, the NLTK list) are dropped. Articles
with fewer than 50 tokens left (disambiguation stubs) are skipped. Parsing the dump takes
~15 s, so the token lists are cached as JSON (keyed by the dump's size and this module's
processing version) in ``$FEDAGENT_CACHE`` or ``~/.cache/fedagent``.

**Splits across N agents** (:func:`split_articles`), all deterministic for a seed, all
balancing the number of *tokens* (articles differ in length by two orders of magnitude):

* ``topic``: the topics are derived from the text, not from labels: TF-IDF over the
  articles' tokens (sublinear tf, terms in at least 2 and at most half of the articles,
  rows L2-normalised so Euclidean k-means ranks like cosine), k-means with k = the
  number of topics (default N; the thesis had 5 topics over 10 nodes, ``topics=5``), then
  a capacity-constrained assignment so topics are of similar size: (article, centroid)
  pairs in order of increasing distance, each article to its nearest centroid that still
  has room (capacity = total tokens / topics, +5 %), leftovers to the smallest topic.
  With ``topics < N`` a topic's articles are divided between the agents
  ``t, t + topics, ...`` like the ``random`` split. Each topic is named by the top
  TF-IDF terms of its centroid.
* ``random``: articles in random order, each to the agent furthest below its equal
  share of tokens.
* ``imbalanced``: the same with unequal shares: target sizes proportional to N values
  spaced evenly from 1 to 4, in random order over the agents (the thesis's "ratio of
  content size between some two nodes is up to 1:4").

**Other sets.** ``mini_newsgroup`` (SEEC's public corpus, a 200-post sample of
20-newsgroups: alt.atheism and sci.space) is stored as a zlib-compressed *pickle* of a
scikit-learn ``Bunch``. It is never unpickled: :func:`newsgroups` walks the pickle's
opcodes with ``pickletools.genops`` (a parser that builds no objects and imports
nothing) and keeps the 200 post texts (the unicode strings with a header block that has
a ``Newsgroups:`` line); each post's group is the first of the two sample groups its own
``Newsgroups:`` header names. ``wordsim353.tsv``,
``simlex999.txt`` (word pairs with mean human scores) and ``questions-words.txt``
(Mikolov's analogies) are plain text.

**Linux manual pages.** :func:`manpages`: the pages of Debian's ``manpages`` and
``manpages-dev`` packages (Linux man-pages 6.03 in bookworm: system calls, C library
functions, file formats, overviews: 2,546 files, of which 1,433 are other names of a page
(symbolic links) and 13 point to one (``.so``); 1,083 pages with at least 50 tokens,
0.59 M tokens), read from ``/usr/share/man`` as the package lists them (``dpkg -L``), so the
same files on every machine with the same package version. ``scripts/bootstrap.sh``
installs the two packages when they are missing. The roff source is turned into text by
dropping comments and layout requests and keeping the text of the font macros (``.B``,
``.BR``, ``.I``...) and of headings, with escapes (``\\fB``, ``\\-``, ``\\(em``...) removed;
pages that only point to another one (``.so`` or a symbolic link) are skipped. Titles are ``name(section)``.

**Vocabulary.** :func:`term_counts` is what an agent offers in the vocabulary consensus
(terms and counts, never documents); :func:`merge_term_counts` is the merge the
consensus stage computes (``protocols.vocab.merge_vocabularies``), so a task that
computes its vocabulary in-process gets exactly the terms and order the protocol would.
"""

from __future__ import annotations

import bz2
import hashlib
import json
import os
import pickletools
import re
import zlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from fedagent.errors import ConfigError
from fedagent.extras import package_dir, require
from fedagent.protocols.search import PUBLIC_CORPORA
from fedagent.protocols.vocab import merge_vocabularies
from fedagent.storage.statefile import atomic_write_with

WIKI_DUMP = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
PROCESSING_VERSION = 1  # bump when tokenisation changes: invalidates caches
MIN_ARTICLE_TOKENS = 50
SPLITS = ("topic", "random", "imbalanced")
IMBALANCE = 4.0  # largest : smallest target share in the imbalanced split

# The gossip-learning thesis's stop words (its Appendix A).
STOP_WORDS = frozenset(
    """
a about above after again against ain all am an and any are aren aren't as at be because been before
being below between both but by can couldn couldn't d did didn didn't do does doesn doesn't doing don
don't down during each few for from further had hadn hadn't has hasn hasn't have haven haven't having
he her here hers herself him himself his how i if in into is isn isn't it it's its itself just ll m
ma me mightn mightn't more most mustn mustn't my myself needn needn't no nor not now o of off on once
only or other our ours ourselves out over own re s same shan shan't she she's should should've
shouldn shouldn't so some such t than that that'll the their theirs them themselves then there these
they this those through to too under until up ve very was wasn wasn't we were weren weren't what when
where which while who whom why will with won won't wouldn wouldn't y you you'd you'll you're you've
your yours yourself yourselves""".split()
)

_WORD = re.compile(r"[^\W\d_]+")


# ---- files ------------------------------------------------------------------------------
def test_data_dir() -> Path:
    """gensim's bundled data directory, found without importing gensim (slow)."""
    path = package_dir("gensim", "text", "the text data (gensim's bundled corpora)") / "test" / "test_data"
    if not path.is_dir():
        raise ConfigError(f"gensim is installed but has no test data at {path}")
    return path


def data_file(name: str) -> Path:
    path = test_data_dir() / name
    if not path.is_file():
        raise ConfigError(f"gensim's data file {name} is missing ({path})")
    return path


def cache_dir() -> Path:
    return Path(os.environ.get("FEDAGENT_CACHE") or Path.home() / ".cache" / "fedagent")


def _write_cache(cache: Path, doc: list[list[Any]]) -> None:
    """``doc`` as JSON to ``cache``. Several agents may build the cache at once: each
    writes its own temporary file and renames it into place, so a reader sees a whole file
    or none. Not synced: a cache a crash damaged fails to parse and is rebuilt."""
    cache.parent.mkdir(parents=True, exist_ok=True)

    def write(f: BinaryIO) -> None:
        for piece in json.JSONEncoder().iterencode(doc):
            f.write(piece.encode())

    atomic_write_with(cache, write, durable=False)


# ---- tokenisation -------------------------------------------------------------------------
def tokenize(text: str, *, stop_words: bool = True) -> list[str]:
    """Lower-cased letter runs of 2..20 characters, minus the thesis's stop words."""
    out = []
    for m in _WORD.finditer(text.lower()):
        w = m.group()
        if 2 <= len(w) <= 20 and not (stop_words and w in STOP_WORDS):
            out.append(w)
    return out


# ---- Wikipedia ------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Article:
    title: str
    tokens: tuple[str, ...]


def _parse_wiki(path: Path, stop_words: bool, limit: int) -> list[Article]:
    wikicorpus = require("gensim.corpora.wikicorpus", "text", "reading the Wikipedia dump")
    articles = []
    with bz2.open(path) as f:
        for title, text, _pageid in wikicorpus.extract_pages(f, filter_namespaces=("0",)):
            if text.lstrip().lower().startswith("#redirect"):
                continue
            tokens = tokenize(wikicorpus.filter_wiki(text), stop_words=stop_words)
            if len(tokens) >= MIN_ARTICLE_TOKENS:
                articles.append(Article(title, tuple(tokens)))
                if len(articles) == limit:
                    break
    return articles


def wiki_articles(*, limit: int = 0, stop_words: bool = True, use_cache: bool = True) -> list[Article]:
    """The dump's articles, tokenised (module docstring), in dump order; ``limit`` > 0
    stops after that many (tests use a small slice)."""
    path = data_file(WIKI_DUMP)
    st = path.stat()
    key = hashlib.sha256(
        f"{st.st_size}:{int(st.st_mtime)}:{PROCESSING_VERSION}:{stop_words}:{limit}".encode()
    ).hexdigest()[:16]
    cache = cache_dir() / f"wiki-{key}.json"
    if use_cache and cache.is_file():
        try:
            raw = json.loads(cache.read_text())
            return [Article(t, tuple(toks)) for t, toks in raw]
        except (ValueError, TypeError):
            pass  # a damaged cache is rebuilt below
    articles = _parse_wiki(path, stop_words, limit)
    if use_cache:
        _write_cache(cache, [[a.title, list(a.tokens)] for a in articles])
    return articles


# ---- Linux manual pages -------------------------------------------------------------------
MANPAGE_PACKAGES = ("manpages", "manpages-dev")
MANPAGE_DIR = Path("/usr/share/man")
# Requests whose arguments are running text (font changes, headings, tagged paragraphs).
_ROFF_TEXT = frozenset("B I BR BI IB IR RB RI SB SM SH SS IP UR MT".split())
# mdoc (BSD) macros whose arguments are running text: names, descriptions, headings, list
# items, functions and arguments, cross references, constants, emphasis.
_MDOC_TEXT = frozenset(
    "Nm Nd Sh Ss It Fn Fa Fo Ft Xr Dv Va Em Ar Cm Fl Pa Er Li Sy Vt Tn Ql Dq Sq Pq Ev Ic Cd In Dl D1 Op".split()
)
# The man-page corpora: (Debian packages, the requests whose arguments are text). "linux"
# is the private corpus of the SEEC and Word2Vec experiments; "freebsd" (FreeBSD's system
# calls, devices and kernel interfaces, mdoc sources) is a *public* corpus of the same kind
# of text and no page in common, what SEEC's mappers learn from (its public Wikipedia).
MANPAGE_CORPORA: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "linux": (MANPAGE_PACKAGES, _ROFF_TEXT),
    "freebsd": (("freebsd-manpages",), _ROFF_TEXT | _MDOC_TEXT),
}
_ROFF_ESCAPE = re.compile(r"\\f(?:\[[^]]*\]|\(..|.)|\\\*(?:\[[^]]*\]|\(..|.)|\\\((..)|\\\[[^]]*\]|\\.")


def roff_text(source: str, text_requests: frozenset[str] = _ROFF_TEXT) -> str:
    """The running text of a man page's roff source (see the module docstring): plain
    lines, and the arguments of ``text_requests``."""
    out = []
    for line in source.splitlines():
        if line.startswith(('.\\"', "'\\\"", '\\"')):
            continue
        if line.startswith((".", "'")):
            request, _, args = line[1:].strip().partition(" ")
            if request not in text_requests:
                continue
            line = args.replace('"', " ")
        out.append(_ROFF_ESCAPE.sub(lambda m: "-" if m.group(0) == "\\-" else " ", line))
    return "\n".join(out)


def manpage_files(packages: Sequence[str] = MANPAGE_PACKAGES) -> list[Path]:
    """The man pages of ``packages``, sorted; a missing package is an error that names
    the fix."""
    import subprocess

    files: set[Path] = set()
    for pkg in packages:
        try:
            listing = subprocess.run(["dpkg", "-L", pkg], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            raise ConfigError(
                f"the Debian package {pkg} is not installed: run ./scripts/bootstrap.sh "
                f"(or apt-get install {' '.join(packages)})"
            ) from None
        for name in listing.splitlines():
            path = Path(name)
            if path.suffix == ".gz" and path.parent.parent == MANPAGE_DIR and path.parent.name.startswith("man"):
                files.add(path)
    return sorted(files)


def _parse_manpages(
    paths: Sequence[Path], stop_words: bool, limit: int, text_requests: frozenset[str] = _ROFF_TEXT
) -> list[Article]:
    import gzip

    pages: list[Article] = []
    seen: set[tuple[str, ...]] = set()
    for path in paths:
        if path.is_symlink():
            continue  # another name of a page read under its own name
        try:
            source = gzip.decompress(path.read_bytes()).decode("utf-8", "replace")
        except OSError:
            continue  # listed by the package but removed (e.g. a slimmed image)
        if source.lstrip().startswith(".so "):
            continue  # an alias of another page
        tokens = tuple(tokenize(roff_text(source, text_requests), stop_words=stop_words))
        if len(tokens) >= MIN_ARTICLE_TOKENS and tokens not in seen:  # a page installed twice: once
            seen.add(tokens)
            name = path.name[: -len(".gz")]
            stem, _, section = name.rpartition(".")
            pages.append(Article(f"{stem}({section})", tokens))
            if len(pages) == limit:
                break
    return pages


def manpages(
    *, limit: int = 0, stop_words: bool = True, use_cache: bool = True, corpus: str = "linux"
) -> list[Article]:
    """The manual pages of ``corpus`` (a key of :data:`MANPAGE_CORPORA`; module
    docstring), tokenised, sorted by file name; ``limit`` > 0 stops after that many."""
    if corpus not in MANPAGE_CORPORA:
        raise ConfigError(f"unknown man-page corpus {corpus!r} (available: {', '.join(MANPAGE_CORPORA)})")
    packages, text_requests = MANPAGE_CORPORA[corpus]
    paths = manpage_files(packages)
    if not paths:
        raise ConfigError(f"the packages {', '.join(packages)} list no man page under {MANPAGE_DIR}")
    digest = hashlib.sha256()
    for path in paths:
        st = path.stat() if path.exists() else None
        digest.update(f"{path}:{st.st_size if st else -1}\n".encode())
    key = hashlib.sha256(f"{digest.hexdigest()}:{PROCESSING_VERSION}:{stop_words}:{limit}".encode()).hexdigest()[:16]
    cache = cache_dir() / (f"manpages-{key}.json" if corpus == "linux" else f"manpages-{corpus}-{key}.json")
    if use_cache and cache.is_file():
        try:
            return [Article(t, tuple(toks)) for t, toks in json.loads(cache.read_text())]
        except (ValueError, TypeError):
            pass
    pages = _parse_manpages(paths, stop_words, limit, text_requests)
    if use_cache:
        _write_cache(cache, [[a.title, list(a.tokens)] for a in pages])
    return pages


# ---- splits ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Split:
    how: str
    shards: tuple[tuple[int, ...], ...]  # article indices of each agent, sorted
    topic_of_shard: tuple[int, ...] | None = None
    topic_terms: tuple[tuple[str, ...], ...] | None = None  # top terms of each topic

    def sizes(self, lengths: Sequence[int]) -> list[int]:
        return [sum(lengths[i] for i in s) for s in self.shards]


def _fill(order: Iterable[int], lengths: Sequence[int], targets: np.ndarray) -> list[list[int]]:
    """Each item in ``order`` to the bin furthest below its target (ties: lower bin)."""
    bins: list[list[int]] = [[] for _ in targets]
    filled = np.zeros(len(targets))
    for i in order:
        b = int(np.argmax(targets - filled))
        bins[b].append(i)
        filled[b] += lengths[i]
    return bins


def _kmeans_topics(docs: Sequence[Sequence[str]], k: int, seed: int) -> tuple[np.ndarray, tuple[tuple[str, ...], ...]]:
    feature = "the topic split"
    cluster = require("sklearn.cluster", "text", feature)
    text = require("sklearn.feature_extraction.text", "text", feature)
    threadpoolctl = require("threadpoolctl", "text", feature)
    vec = text.TfidfVectorizer(analyzer=lambda d: d, min_df=2, max_df=0.5, sublinear_tf=True)
    x = vec.fit_transform(docs)
    # One thread: a hundred articles need no parallelism, and OpenMP threads spinning
    # next to the agent's own work (or other agents on the same cores) cost seconds.
    with threadpoolctl.threadpool_limits(limits=1):
        km = cluster.KMeans(n_clusters=k, n_init=10, random_state=seed).fit(x)
    dist = km.transform(x)  # articles x centroids
    terms = vec.get_feature_names_out()
    top = tuple(tuple(str(terms[j]) for j in np.argsort(-c)[:6]) for c in km.cluster_centers_)
    return dist, top


def _balanced_topics(dist: np.ndarray, lengths: Sequence[int], slack: float = 0.05) -> list[list[int]]:
    n_docs, k = dist.shape
    cap = sum(lengths) / k * (1 + slack)
    filled = np.zeros(k)
    topic = np.full(n_docs, -1)
    flat = np.argsort(dist, axis=None, kind="stable")
    for f in flat:
        d, t = divmod(int(f), k)
        if topic[d] < 0 and filled[t] + lengths[d] <= cap:
            topic[d] = t
            filled[t] += lengths[d]
    for d in np.flatnonzero(topic < 0).tolist():  # too long for any topic's remaining room
        t = int(np.argmin(filled))
        topic[d] = t
        filled[t] += lengths[d]
    return [np.flatnonzero(topic == t).tolist() for t in range(k)]


def split_articles(
    docs: Sequence[Sequence[str]], n: int, how: str, *, seed: int = 0, topics: int | None = None
) -> Split:
    """Divide documents (token lists) among ``n`` agents (module docstring)."""
    if how not in SPLITS:
        raise ConfigError(f"unknown split {how!r}: use one of {', '.join(SPLITS)}")
    if n < 1 or n > len(docs):
        raise ConfigError(f"cannot split {len(docs)} documents among {n} agents")
    lengths = [len(d) for d in docs]
    rng = np.random.default_rng(seed)
    if how in ("random", "imbalanced"):
        weights = np.ones(n) if how == "random" else rng.permutation(np.linspace(1.0, IMBALANCE, n))
        targets = weights / weights.sum() * sum(lengths)
        bins = _fill(rng.permutation(len(docs)).tolist(), lengths, targets)
        return Split(how, tuple(tuple(sorted(b)) for b in bins))
    k = n if topics is None else int(topics)
    if not 1 <= k <= n:
        raise ConfigError(f"topics must be between 1 and the number of agents ({n}), got {k}")
    dist, top = _kmeans_topics(docs, k, seed)
    groups = _balanced_topics(dist, lengths)
    shards: list[list[int]] = [[] for _ in range(n)]
    for t, members in enumerate(groups):
        agents = list(range(t, n, k))
        share = np.full(len(agents), sum(lengths[i] for i in members) / len(agents))
        for a, b in zip(agents, _fill(rng.permutation(members).tolist(), lengths, share)):
            shards[a] = b
    return Split(
        how, tuple(tuple(sorted(s)) for s in shards), topic_of_shard=tuple(a % k for a in range(n)), topic_terms=top
    )


# ---- vocabulary ------------------------------------------------------------------------------
def term_counts(docs: Iterable[Sequence[str]]) -> dict[str, int]:
    """What an agent offers in the vocabulary consensus: its terms and their counts."""
    c: Counter[str] = Counter()
    for d in docs:
        c.update(d)
    return dict(c)


def merge_term_counts(
    offers: Iterable[Mapping[str, int]], *, min_count: int = 1, max_size: int = 0
) -> list[tuple[str, int]]:
    """The vocabulary the consensus stage agrees on for these offers: the consensus
    protocol's own merge (union with summed counts, terms with at least ``min_count``, at
    most ``max_size`` (0 = all), by descending count then term)."""
    return merge_vocabularies(offers, min_count=min_count, max_size=max_size)


# ---- 20-newsgroups sample (SEEC's public corpus) ------------------------------------------------
@dataclass(frozen=True, slots=True)
class Post:
    group: str
    subject: str
    body: str

    @property
    def text(self) -> str:
        return f"{self.subject}\n{self.body}"


NEWSGROUPS = ("alt.atheism", "sci.space")
_MAX_NEWSGROUP_BYTES = 8 << 20


def _split_post(raw: str) -> Post:
    head, _, body = raw.partition("\n\n")
    group, subject = "", ""
    for line in head.splitlines():
        name, _, value = line.partition(":")
        if name.lower() == "newsgroups" and not group:
            listed = [g.strip() for g in value.split(",")]
            group = next((g for g in listed if g in NEWSGROUPS), listed[0] if listed else "")
        elif name.lower() == "subject" and not subject:
            subject = value.strip()
    return Post(group, subject, body.strip())


def newsgroups() -> list[Post]:
    """The 200 posts of gensim's ``mini_newsgroup`` (never unpickled; module docstring)."""
    raw = data_file("mini_newsgroup").read_bytes()
    d = zlib.decompressobj()
    data = d.decompress(raw, _MAX_NEWSGROUP_BYTES)
    if d.unconsumed_tail:
        raise ConfigError("mini_newsgroup decompresses to more than 8 MiB; refusing it")
    posts = []
    for op, arg, _pos in pickletools.genops(data):
        if (
            op.name in ("UNICODE", "BINUNICODE", "SHORT_BINUNICODE")
            and isinstance(arg, str)
            and re.search(r"^Newsgroups:", arg.partition("\n\n")[0], re.MULTILINE)
        ):
            posts.append(_split_post(arg))
    if not posts or any(p.group not in NEWSGROUPS for p in posts):
        raise ConfigError("mini_newsgroup does not look like the 20-newsgroups sample gensim ships")
    return posts


# ---- evaluation sets ----------------------------------------------------------------------
def _pairs(name: str) -> list[tuple[str, str, float]]:
    out = []
    for line in data_file(name).read_text(encoding="utf-8").splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split("\t")
        if len(parts) < 3:
            raise ConfigError(f"{name}: malformed line {line[:60]!r}")
        out.append((parts[0].strip(), parts[1].strip(), float(parts[2])))
    return out


def wordsim353() -> list[tuple[str, str, float]]:
    """WordSimilarity-353: (word, word, mean human score 0..10)."""
    return _pairs("wordsim353.tsv")


def simlex999() -> list[tuple[str, str, float]]:
    """SimLex-999: (word, word, mean human similarity 0..10)."""
    return _pairs("simlex999.txt")


def analogies() -> dict[str, list[tuple[str, str, str, str]]]:
    """Mikolov's ``questions-words.txt`` by section, lower-cased (a : b :: c : d)."""
    sections: dict[str, list[tuple[str, str, str, str]]] = {}
    current = None
    for line in data_file("questions-words.txt").read_text(encoding="utf-8").splitlines():
        if line.startswith(":"):
            current = line[1:].strip()
            sections[current] = []
        elif line.strip():
            words = line.lower().split()
            if current is None or len(words) != 4:
                raise ConfigError(f"questions-words.txt: malformed line {line[:60]!r}")
            sections[current].append((words[0], words[1], words[2], words[3]))
    return sections


# ---- public corpora (SEEC's mappers) ---------------------------------------------------------
def public_corpus(name: str, n: int) -> tuple[str, list[list[str]]]:
    """(digest, token lists) of the first ``n`` documents of a public corpus, what every
    site of a mapped federation vectorises to train its mappers: ``newsgroups`` (the 200
    posts of the 20-newsgroups sample, SEEC's own choice) or ``freebsd-manpages`` (the
    FreeBSD manual pages, :data:`MANPAGE_CORPORA`). The digest names the documents, so two
    sites can check they learn from the same ones."""
    if name == "newsgroups":
        posts = newsgroups()[:n]
        texts = [p.text for p in posts]
        docs = [tokenize(t) for t in texts]
    elif name == "freebsd-manpages":
        pages = manpages(corpus="freebsd", limit=n)
        texts = [" ".join(a.tokens) for a in pages]
        docs = [list(a.tokens) for a in pages]
    else:
        raise ConfigError(f"unknown public corpus {name!r} (available: {', '.join(PUBLIC_CORPORA)})")
    if len(docs) != n:
        raise ConfigError(f"the public corpus {name} has {len(docs)} documents, {n} asked for")
    h = hashlib.sha256("\x00".join(texts).encode())
    if name != "newsgroups":
        h.update(f"\x00{name}".encode())
    return h.hexdigest()[:32], docs
