"""``bert-knn add``: new or changed articles into new shards and a new manifest version.

An update never modifies a file an older version reads, so a reader (or a running service) that holds the
old manifest keeps working, and a crash at any point leaves the old version valid:

1. the corpus is read once to sort its articles into added (new title), replaced (known title, other stored
   sentences) and unchanged (same stored sentences: skipped) -- before the model loads, so bad input fails fast;
2. the added and replaced articles are embedded into new shards ``shard-{max+1:05d}...`` by the build's own
   loop (``embed.embed_shards``: same model, layer, max_seq_len, stopwords and targets as the manifest);
3. the sparse indexes (BM25 + TF-IDF) are rebuilt from all current article texts into ``index/v{N}/``, and the
   IVF-PQ index, when the datastore has one, is copied there with the new rows appended (not retrained);
4. the new manifest (version N, an ``updates`` record, counts of reachable and superseded rows) is validated,
   then written atomically: that rename is the commit;
5. index folders of versions older than N-1 are deleted (a service still on N-1 keeps its files).

A replaced article's old rows stay in their shard (shards are immutable and may be hard-linked) and become
unreachable: see ``format.Datastore`` ("a later shard wins") and ``Datastore.superseded_rows``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

import torch

from bertknn.builder.build import check_corpus_files
from bertknn.builder.coding import Coder
from bertknn.builder.corpus import (
    Article,
    CorpusStats,
    corpus_language,
    detect_format,
    read_corpora,
    read_siteinfo,
)
from bertknn.builder.embed import ShardOptions, Work, embed_shards
from bertknn.builder.sentences import SentenceSplitter
from bertknn.builder.settings import AddSettings
from bertknn.builder.targets import load_stopwords, stopwords_sha256
from bertknn.builder.wikitext import drop_reason
from bertknn.builder.writer import write_table
from bertknn.core import logs
from bertknn.core.encoder import MaskedLMEncoder
from bertknn.core.errors import UpdateError
from bertknn.core.format import (
    ARTICLE_TABLE,
    BM25_DIR,
    BUILD_STATE,
    INDEX_DIR,
    IVFPQ_FILE,
    REDIRECTS,
    SHARDS_DIR,
    TFIDF_DIR,
    Counts,
    Datastore,
    Manifest,
    ShardInfo,
    SourceInfo,
    UpdateInfo,
    atomic_write_json,
    parse_shard_name,
    read_manifest,
    sha256_file,
    validate_datastore,
    write_manifest,
)
from bertknn.core.format.codec import CodecSpec
from bertknn.core.format.health import with_empty_warning
from bertknn.core.model_ref import locate_model
from bertknn.core.runtime import cpu_quota_threads

logger = logging.getLogger(__name__)
DEFAULT_MIN_SENTENCE_CHARS = 10


@dataclass(frozen=True)
class UpdateResult:
    manifest: Manifest
    added: int
    replaced: int
    unchanged: int
    duplicates: int  # later occurrences of a title within the new corpus (the first one wins, as in build)
    shards: list[str]
    seconds: float

    def summary(self) -> dict[str, object]:
        m = self.manifest
        return {
            "version": m.version,
            "id": m.datastore_id,
            "added": self.added,
            "replaced": self.replaced,
            "unchanged": self.unchanged,
            "duplicate_titles": self.duplicates,
            "shards": self.shards,
            "articles": m.counts.articles,
            "contexts": m.counts.contexts,
            "superseded_contexts": m.counts.superseded_contexts,
            "seconds": round(self.seconds, 2),
        }


@dataclass
class _Plan:
    """What the new corpus holds, relative to the datastore (titles in corpus order)."""

    embed: dict[str, str] = field(default_factory=dict)  # title -> "added" | "replaced"
    unchanged: int = 0
    duplicates: int = 0
    stats: CorpusStats = field(default_factory=CorpusStats)

    @property
    def total(self) -> int:
        return len(self.embed) + self.unchanged

    def count(self, kind: str) -> int:
        return sum(1 for v in self.embed.values() if v == kind)


def add_articles(settings: AddSettings, encoder: MaskedLMEncoder | None = None) -> UpdateResult:
    """Embed the new and changed articles of ``settings.corpus`` into ``settings.datastore`` (see module doc).

    Raises:
        UpdateError: bad input (no corpus, no articles, another model, another stopword list, a slice, a datastore
            that fails validation) or a new version that fails validation; the datastore is unchanged.
    """
    t0 = time.perf_counter()
    root = Path(settings.datastore)
    check_corpus_files(settings.corpus)
    if not root.is_dir():
        raise UpdateError(f"{root}: no such datastore directory; build one first (bert-knn build)")
    read_manifest(root)  # a directory without a finished datastore gets no lock file either
    with _exclusive(root):
        old, datastore, stopwords = _open_checked(root, settings)
        min_chars = settings.min_sentence_chars
        if min_chars is None:
            min_chars = _recorded_min_sentence_chars(root)
        plan = _classify(settings.corpus, datastore, min_chars, _corpus_language(settings.corpus, old.language, root))
        if plan.total == 0:
            names = ", ".join(str(p) for p in settings.corpus)
            raise UpdateError(f"{names}: no articles found; nothing was added")
        if not plan.embed:
            logger.info("add: all %d articles are unchanged; %s stays at version %d", plan.unchanged, root, old.version)
            return UpdateResult(old, 0, 0, plan.unchanged, plan.duplicates, [], time.perf_counter() - t0)
        torch.set_num_threads(settings.threads or cpu_quota_threads())
        encoder = encoder or MaskedLMEncoder.load(
            locate_model(old.model.name, old.model.path, settings.model), layer=old.layer, device=settings.device,
            dtype=settings.dtype, max_seq_len=old.max_seq_len, mlm_head="ignored",
        )  # fmt: skip
        check_same_model(encoder, old)
        index_dir = f"{INDEX_DIR}/v{old.version + 1}"
        _remove_debris(root, old, index_dir)
        options = ShardOptions(
            old.max_seq_len, stopwords, min_chars, old.targets, settings.batch_size, settings.workers,
            old.contexts_per_shard, old.links is not None, batch_tokens=settings.batch_tokens or None,
        )  # fmt: skip
        infos, encode_s = _embed_changes(root, settings, old, datastore, plan, encoder, options)
        new = _commit_version(root, settings, old, plan, infos, index_dir)
        result = UpdateResult(
            new, plan.count("added"), plan.count("replaced"), plan.unchanged, plan.duplicates,
            [i.name for i in infos], time.perf_counter() - t0,
        )  # fmt: skip
        figures = {**result.summary(), "new_contexts": sum(i.rows for i in infos), "encode_s": round(encode_s, 2)}
        logger.info(logs.summary("add finished", figures))
        return result


def _open_checked(root: Path, settings: AddSettings) -> tuple[Manifest, Datastore, frozenset[str]]:
    """The datastore to add to, if it can take new articles: whole (not a slice), valid, and built with this
    stopword list; with that list."""
    old = read_manifest(root)
    if old.slice is not None:
        raise UpdateError(
            f"{root} is slice {old.slice.index} of {old.slice.count}; merge the slices first, then add to the merge"
        )
    problems = validate_datastore(root, hashes=False)
    if problems:
        raise UpdateError(f"{root} failed validation, so nothing was added: {problems[0]}")
    stopwords = load_stopwords(settings.stopwords, old.language)
    if stopwords_sha256(stopwords) != old.stopwords_sha256:
        raise UpdateError(
            f"the stopword list {settings.stopwords or '(bundled)'} is not the one {root} was built with; "
            "pass the build's --stopwords FILE"
        )
    return old, Datastore(root, old), stopwords


def _embed_changes(
    root: Path, settings: AddSettings, old: Manifest, datastore: Datastore, plan: _Plan, encoder: MaskedLMEncoder,
    options: ShardOptions,
) -> tuple[list[ShardInfo], float]:  # fmt: skip
    """The new and changed articles embedded into new shards after the existing ones (their infos, in order, and
    the forward passes' seconds)."""
    first = max((s.index for s in old.shards), default=-1) + 1
    per_shard = settings.articles_per_shard or old.articles_per_shard
    infos: list[ShardInfo] = []
    # new rows are coded with the datastore's own codec (never retrained: old and new codes must compare)
    coder = None
    if old.codec is not None:
        assert datastore.codec is not None
        coder = Coder(CodecSpec(), encoder.hidden_size, datastore.codec, old.codec)
    encode_s = embed_shards(
        root, _chunks(settings.corpus, plan, first, per_shard), encoder, options, infos.append, coder=coder
    )
    return sorted(infos, key=lambda i: i.key), encode_s


def _commit_version(
    root: Path, settings: AddSettings, old: Manifest, plan: _Plan, infos: list[ShardInfo], index_dir: str
) -> Manifest:
    """Version N+1: its article table and indexes beside version N's, validated, then its manifest written (the
    commit: readers see it from there on); the indexes no version names are pruned."""
    new = old.model_copy(deep=True)
    new.version = old.version + 1
    new.shards = [*old.shards, *infos]
    sources = [
        SourceInfo(path=p.name, format=detect_format(p), sha256=sha256_file(p)) for p in map(Path, settings.corpus)
    ]
    new.updates = [
        *old.updates,
        UpdateInfo(version=new.version, shards=[i.name for i in infos], added=plan.count("added"),
                   replaced=plan.count("replaced"), unchanged=plan.unchanged, sources=sources),
    ]  # fmt: skip
    write_table(root, new, sorted(plan.stats.redirects.items()), f"{index_dir}/{ARTICLE_TABLE}",
                base=old.article_table, first_shard=len(old.shards))  # fmt: skip
    updated = Datastore(root, new)
    new.counts = _counts(updated, old.counts)
    new.warnings = with_empty_warning(new.warnings, new.counts)  # (an add fills a datastore built empty)
    new.indexes = {}
    if "bm25" in old.indexes or "tfidf" in old.indexes:
        from bertknn.builder.sparse_index import language_hasher, write_sparse_indexes

        new.indexes.update(  # the same sparse indexes as before: a TF-IDF-only datastore stays one (no Java)
            write_sparse_indexes(root, updated.iter_article_texts(), content_id=new.compute_id(), index_dir=index_dir,
                                 bm25="bm25" in old.indexes, hasher=language_hasher(old.language))
        )  # fmt: skip
    if "ivfpq" in old.indexes:
        from bertknn.builder.ivfpq import extend_ivfpq

        new.indexes.update(extend_ivfpq(root, old, new, f"{index_dir}/ivfpq.faiss"))
    new.datastore_id = new.compute_id()
    _merge_redirects(root, plan.stats.redirects)  # the builder's record; readers use the article table
    problems = validate_datastore(root, hashes=False, manifest=new)
    if problems:
        raise UpdateError(f"the new version failed validation, so {root} stays at version {old.version}: {problems[0]}")
    write_manifest(root, new)  # the commit: readers see version N from here on
    _prune_indexes(root, keep={*old.indexes.values(), *new.indexes.values(), old.article_table or "",
                               new.article_table or ""})  # fmt: skip
    return new


def check_same_model(encoder: MaskedLMEncoder, manifest: Manifest) -> None:
    """New rows must come from the weights the existing rows came from, or distances between them mean nothing."""
    if encoder.weights_sha256 != manifest.model.weights_sha256:
        raise UpdateError(
            f"model {encoder.name!r} (weights sha256 {encoder.weights_sha256[:12]}...) is not the model this datastore "
            f"was built with: {manifest.model.name!r} ({manifest.model.weights_sha256[:12]}...); add with that model "
            "(leave out --model to use it), or build a new datastore with this one"
        )


@contextmanager
def _exclusive(root: Path) -> Iterator[None]:
    """One ``add`` at a time per datastore: an advisory lock on the directory itself (no lock file is left
    behind; a killed holder releases it)."""
    fd = os.open(root, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise UpdateError(f"{root}: another `add` is updating this datastore; wait for it to finish") from exc
        yield
    finally:
        os.close(fd)  # releases the lock


def _corpus_language(paths: Sequence[Path], language: str, root: Path) -> str:
    """The corpus's language, which must be the datastore's: a dump in another is refused, naming both."""
    for path in paths:
        if detect_format(Path(path)) == "mediawiki-xml" and (own := read_siteinfo(Path(path)).language) != language:
            raise UpdateError(
                f"{path}: the dump is in {own!r} (its <mediawiki xml:lang>), the datastore {root} in {language!r}; "
                f"a datastore holds one language: add the dump to one built from a {own!r} corpus"
            )
    return corpus_language(paths, language)


def _recorded_min_sentence_chars(root: Path) -> int:
    try:
        return int(json.loads((root / BUILD_STATE).read_text())["min_sentence_chars"])
    except (OSError, ValueError, KeyError, TypeError):
        return DEFAULT_MIN_SENTENCE_CHARS


def stored_sentences(splitter: SentenceSplitter, article: Article, min_chars: int) -> list[str]:
    """The sentences the build would store for ``article`` (its unchanged-test compares these): its split
    sentences that the build's rule keeps (`drop_reason`)."""
    return [s for s in splitter.split(article.text) if drop_reason(s, min_chars) is None]


def _classify(corpus: list[Path], datastore: Datastore, min_chars: int, language: str = "en") -> _Plan:
    plan = _Plan()
    plan.stats.language = language
    splitter = SentenceSplitter(language)
    seen: set[str] = set()
    for art in read_corpora(corpus, plan.stats):
        if art.title in seen:
            plan.duplicates += 1
            continue
        seen.add(art.title)
        if art.title not in datastore.articles:
            plan.embed[art.title] = "added"
        elif stored_sentences(splitter, art, min_chars) == datastore.article_sentences(art.title):
            plan.unchanged += 1
        else:
            plan.embed[art.title] = "replaced"
    logger.info(
        "add: %d new, %d changed, %d unchanged articles, %d duplicate titles skipped",
        plan.count("added"), plan.count("replaced"), plan.unchanged, plan.duplicates,
    )  # fmt: skip
    return plan


def _chunks(corpus: list[Path], plan: _Plan, first: int, per_shard: int) -> Iterator[Work]:
    """The articles to embed (second pass over the corpus, first occurrence of each title), in blocks of
    ``per_shard`` articles numbered from ``first`` (each written in parts, as the build's were)."""

    def wanted() -> Iterator[Article]:
        taken: set[str] = set()
        for art in read_corpora(corpus, CorpusStats(language=plan.stats.language)):
            if art.title in plan.embed and art.title not in taken:
                taken.add(art.title)
                yield art

    stream = wanted()
    index = first
    while chunk := list(islice(stream, per_shard)):
        yield Work(index, 0, chunk)
        index += 1


def _counts(datastore: Datastore, previous: Counts) -> Counts:
    live, gone = datastore.table.totals(live=True), datastore.table.totals(live=False)
    return Counts(
        articles=live[0],
        sentences=live[1],
        contexts=live[2],
        skipped_duplicate_titles=previous.skipped_duplicate_titles,
        skipped_pages=previous.skipped_pages,
        superseded_articles=gone[0],
        superseded_sentences=gone[1],
        superseded_contexts=gone[2],
    )


def _remove_debris(root: Path, manifest: Manifest, index_dir: str) -> None:
    """What an interrupted ``add`` left: shards past the manifest's last one, and the next version's index folder.
    No manifest names them, so no reader uses them."""
    last = max((s.index for s in manifest.shards), default=-1)
    shards = root / SHARDS_DIR
    for p in shards.iterdir() if shards.is_dir() else ():
        key = parse_shard_name(p.name)
        if (key is not None and key[0] > last) or p.name.startswith(".tmp-"):
            shutil.rmtree(p, ignore_errors=True)
    shutil.rmtree(root / index_dir, ignore_errors=True)


def _merge_redirects(root: Path, new: dict[str, str]) -> None:
    if not new:
        return
    path = root / REDIRECTS
    old = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    merged = {**old, **new}
    if merged != old:
        atomic_write_json(path, dict(sorted(merged.items())))


def _prune_indexes(root: Path, keep: set[str]) -> None:
    """Delete index folders and files that neither the new version nor the one before it uses."""
    index = root / INDEX_DIR
    if not index.is_dir():
        return

    def kept(rel: str) -> bool:
        return any(k == rel or k.startswith(rel + "/") for k in keep)

    for p in index.iterdir():
        if p.is_dir() and p.name[:1] == "v" and p.name[1:].isdigit() and not kept(f"{INDEX_DIR}/{p.name}"):
            shutil.rmtree(p, ignore_errors=True)
    # the first build's own indexes, once no kept version names them
    for rel in (BM25_DIR, TFIDF_DIR):
        if not kept(rel) and (root / rel).is_dir():
            shutil.rmtree(root / rel, ignore_errors=True)
    if not kept(ARTICLE_TABLE):
        (root / ARTICLE_TABLE).unlink(missing_ok=True)
    if not kept(IVFPQ_FILE):
        (root / IVFPQ_FILE).unlink(missing_ok=True)
        (root / IVFPQ_FILE).with_suffix(".json").unlink(missing_ok=True)
