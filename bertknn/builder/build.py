"""The build loop: blocks of articles -> masked contexts -> parts cut by contexts -> embeddings -> shard files ->
manifest."""

from __future__ import annotations

import json
import logging
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from bertknn.builder.blocks import BlockPlan, check_slicing, iter_blocks, plan_blocks
from bertknn.builder.coding import Coder, open_coder
from bertknn.builder.corpus import Article, CorpusStats, SentenceSplitter, detect_format
from bertknn.builder.progress import BuildProgress
from bertknn.builder.settings import BuildSettings
from bertknn.builder.stages import StageTimes
from bertknn.builder.targets import TargetMode, TargetSelector, load_stopwords, masked_ids, stopwords_sha256
from bertknn.builder.wikitext import TEXT_RULES, sentence_problem
from bertknn.builder.writer import ShardData, finished_parts, remove_stale_temp, write_shard, write_table
from bertknn.core.calibration import measure_distance_scale
from bertknn.core.encoder import ContextTokenizer, MaskedInput, MaskedLMEncoder
from bertknn.core.errors import BuildError, BuildInterrupted, DatastoreError
from bertknn.core.format import (
    REDIRECTS,
    CodecInfo,
    Counts,
    LinkInfo,
    Manifest,
    ModelInfo,
    ShardInfo,
    SliceInfo,
    SourceInfo,
    atomic_write_json,
    read_manifest,
    sha256_file,
    write_manifest,
)
from bertknn.core.inputs import PackedInputs
from bertknn.core.model_ref import local_model_path
from bertknn.core.runtime import cpu_quota_threads, return_free_memory
from bertknn.core.words import WordEntry, WordTable, WordTableBuilder

logger = logging.getLogger(__name__)
BUILD_STATE = "build.json"



@dataclass
class PreparedShard:
    """Everything but the embeddings: made by worker processes while the model runs on the previous shard."""

    index: int
    articles: list[dict]
    sentences: list[str]
    inputs: PackedInputs  # (arrays: a worker's result pickles as a few buffers, not an object per context)
    labels: np.ndarray
    sentence_ids: np.ndarray
    spans: np.ndarray
    words: WordTable | None = None  # whole-word targets: the shard's word table (labels index it)
    times: StageTimes = field(default_factory=StageTimes)  # the worker's markup, split and targets
    entity_labels: np.ndarray | None = None  # datastores with links: int32 [rows], index into entities, or -1
    entities: list[str] | None = None  # the link targets the shard's rows name (normalised titles)

    @property
    def rows(self) -> int:
        return len(self.inputs)

    def select(self, a: int, b: int) -> PreparedShard:
        """Articles ``[a, b)`` alone, rows and sentences renumbered from 0 (the word table is kept whole)."""
        if a == 0 and b == len(self.articles):
            return self
        if a == b:
            return _empty_prepared(self.index, self.words is not None)
        r0, r1 = self.articles[a]["row_start"], self.articles[b - 1]["row_end"]
        s0, s1 = self.articles[a]["sent_start"], self.articles[b - 1]["sent_end"]
        metas = [
            {**m, "row_start": m["row_start"] - r0, "row_end": m["row_end"] - r0,
             "sent_start": m["sent_start"] - s0, "sent_end": m["sent_end"] - s0}
            for m in self.articles[a:b]
        ]  # fmt: skip
        return PreparedShard(
            self.index, metas, self.sentences[s0:s1], self.inputs[r0:r1], self.labels[r0:r1],
            self.sentence_ids[r0:r1] - s0, self.spans[r0:r1], self.words,
            entity_labels=None if self.entity_labels is None else self.entity_labels[r0:r1], entities=self.entities,
        )  # fmt: skip

    @staticmethod
    def concat(index: int, pieces: list[PreparedShard], whole_words: bool) -> PreparedShard:
        """One shard's worth of prepared pieces, in order: offsets shifted, word tables merged by word text,
        entity tables by title."""
        linked = any(p.entity_labels is not None for p in pieces)
        if len(pieces) == 1 and not whole_words and not linked:
            pieces[0].index = index
            return pieces[0]
        out = _empty_prepared(index, whole_words)
        labels, sent_ids, spans = [out.labels], [out.sentence_ids], [out.spans]
        inputs = [out.inputs]
        words = _WordTableMerger() if whole_words else None
        entity_ids: dict[str, int] = {}
        entity_labels: list[np.ndarray] = []
        for piece in pieces:
            if not linked:
                break
            if piece.entity_labels is None or piece.entities is None:
                assert piece.rows == 0, "a piece without links among pieces with links"
                continue
            used = np.unique(piece.entity_labels[piece.entity_labels >= 0])
            mapping = np.full(len(piece.entities) + 1, -1, dtype=np.int32)  # (the last slot maps -1 to -1)
            for old in used.tolist():
                mapping[old] = entity_ids.setdefault(piece.entities[old], len(entity_ids))
            entity_labels.append(mapping[piece.entity_labels])
        if linked:
            out.entity_labels = np.concatenate([np.zeros(0, np.int32), *entity_labels]).astype(np.int32)
            out.entities = list(entity_ids)
        for piece in pieces:
            rows, sents = sum(len(x) for x in inputs), len(out.sentences)
            out.articles.extend(
                {**m, "row_start": m["row_start"] + rows, "row_end": m["row_end"] + rows,
                 "sent_start": m["sent_start"] + sents, "sent_end": m["sent_end"] + sents}
                for m in piece.articles
            )  # fmt: skip
            out.sentences.extend(piece.sentences)
            inputs.append(piece.inputs)
            labels.append(piece.labels if words is None or piece.words is None else words.remap(piece.words, piece.labels))
            sent_ids.append(piece.sentence_ids + sents)
            spans.append(piece.spans)
        out.inputs = PackedInputs.concat(inputs)
        out.labels = np.concatenate(labels).astype(np.int32, copy=False)
        out.sentence_ids = np.concatenate(sent_ids).astype(np.int32, copy=False)
        out.spans = np.concatenate(spans).astype(np.int32, copy=False).reshape(-1, 2)
        if words is not None:
            out.words = words.table()
        return out


def _empty_prepared(index: int, whole_words: bool) -> PreparedShard:
    return PreparedShard(
        index, [], [], PackedInputs.of([]), np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros((0, 2), np.int32),
        WordTable([]) if whole_words else None,
    )  # fmt: skip


class _WordTableMerger:
    """Word ids of several pieces' tables -> ids of one shard table, in first-occurrence order (by word text,
    as ``WordTableBuilder`` assigns them within a piece)."""

    def __init__(self) -> None:
        self._by_text: dict[str, int] = {}
        self.entries: list[WordEntry] = []

    def remap(self, table: WordTable, labels: np.ndarray) -> np.ndarray:
        used, first = np.unique(labels, return_index=True)
        mapping = np.zeros(max(len(table), 1), dtype=np.int32)
        for old in used[np.argsort(first)].tolist():  # first occurrence order
            entry = table[old]
            new = self._by_text.get(entry.text)
            if new is None:
                new = self._by_text[entry.text] = len(self.entries)
                self.entries.append(entry)
            mapping[old] = new
        return mapping[labels] if len(labels) else labels

    def table(self) -> WordTable:
        return WordTable(self.entries)


class ShardPreparer:
    """Sentence splitting, target selection and masking for one shard's articles (no model needed)."""

    def __init__(
        self,
        tokenizer_path: str,
        max_seq_len: int,
        stopwords: frozenset[str],
        min_sentence_chars: int,
        targets: TargetMode = "single-piece",
        links: bool = False,
    ):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, use_fast=True)
        self.links = links
        self.tokenizer = tokenizer
        self.inputs = ContextTokenizer(tokenizer, max_seq_len)
        self.selector = TargetSelector(tokenizer, stopwords, targets, words=self.inputs.words)
        self.splitter = SentenceSplitter()
        self.min_sentence_chars = min_sentence_chars

    def prepare(self, index: int, articles: list[Article]) -> PreparedShard:
        metas: list[dict] = []
        sentences: list[str] = []
        inputs: list[MaskedInput] = []
        labels: list[int] = []
        sent_ids: list[int] = []
        spans: list[tuple[int, int]] = []
        words = WordTableBuilder(self.inputs.words) if self.selector.mode == "whole-word" else None
        entity_ids: dict[str, int] = {}
        entity_labels: list[int] = []
        times = StageTimes()
        for art in articles:
            t0 = time.perf_counter()
            text, links = art.text_links() if self.links else (art.text, [])  # wikitext -> text: in the worker
            t1 = time.perf_counter()
            sents: list[str] = []
            sent_links: list[list[tuple[int, int, int]]] = []
            cursor = 0
            for sent in self.splitter.split(text):
                at = text.find(sent, cursor)
                cursor = at + len(sent) if at >= 0 else cursor
                problem = "short" if len(sent) < self.min_sentence_chars else sentence_problem(sent)
                if problem is not None:
                    times.drop(problem)
                    continue
                sents.append(sent)
                inside = [] if at < 0 else [
                    (ln.start - at, ln.end - at, entity_ids.setdefault(ln.target, len(entity_ids)))
                    for ln in links if at <= ln.start and ln.end <= at + len(sent)
                ]  # fmt: skip
                sent_links.append(inside)
            t2 = time.perf_counter()
            times.add("markup", t1 - t0, 1 if art.markup == "wikitext" else 0)
            times.add("split", t2 - t1, len(sents))
            row_start, sent_start = len(labels), len(sentences)
            for tok_sent in self.selector.select(sents, sent_links if self.links else None):
                sid = len(sentences)
                sentences.append(tok_sent.text)
                for target in tok_sent.targets:
                    ids, pos = masked_ids(tok_sent, target, self.inputs.mask_id)
                    inputs.append(self.inputs.masked_input(ids, pos))
                    if target.token_id < 0:
                        labels.append(-1)  # an anchor that is no word target: an entity's row only
                    else:
                        labels.append(target.token_id if words is None else words.add(target.pieces))
                    entity_labels.append(target.entity)
                    sent_ids.append(sid)
                    spans.append((target.char_start, target.char_end))
            times.add("targets", time.perf_counter() - t2, len(labels) - row_start)
            metas.append(
                {
                    "title": art.title,
                    "id": art.id,
                    "source": Path(art.source).name,
                    "row_start": row_start,
                    "row_end": len(labels),
                    "sent_start": sent_start,
                    "sent_end": len(sentences),
                }
            )
        return PreparedShard(
            index,
            metas,
            sentences,
            PackedInputs.of(inputs),
            np.asarray(labels, dtype=np.int32),
            np.asarray(sent_ids, dtype=np.int32),
            np.asarray(spans, dtype=np.int32).reshape(-1, 2),
            None if words is None else words.table(),
            times,
            np.asarray(entity_labels, dtype=np.int32) if self.links else None,
            list(entity_ids) if self.links else None,
        )


_WORKER: ShardPreparer | None = None


def _init_worker(*args: object) -> None:
    global _WORKER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle (it keeps the work)
    torch.set_num_threads(1)
    _WORKER = ShardPreparer(*args)  # type: ignore[arg-type]


def _prepare_in_worker(index: int, articles: list[Article]) -> PreparedShard:
    assert _WORKER is not None
    return _WORKER.prepare(index, articles)


# Rows embedded per step (the default of ``checkpoint_contexts``), in the shard's (article) order, each step in
# length-sorted batches: an interrupted build keeps every article whose rows were all embedded.
EMBED_STEP_ROWS = 2048


def token_batches(lengths: Sequence[int], max_rows: int, max_tokens: int | None) -> list[tuple[int, int]]:
    """Cut rows of ascending ``lengths`` into batches [start, end): at most ``max_rows`` rows, and (when
    ``max_tokens``) at most ``max_tokens`` padded tokens (rows x the longest row); a row longer than the budget
    goes alone."""
    out: list[tuple[int, int]] = []
    start = 0
    for i, length in enumerate(lengths):
        rows = i - start + 1
        if rows > max_rows or (max_tokens and rows > 1 and rows * length > max_tokens):
            out.append((start, i))
            start = i
    if start < len(lengths):
        out.append((start, len(lengths)))
    return out


def embed_prepared(
    encoder: MaskedLMEncoder,
    prepared: PreparedShard,
    batch_size: int,
    on_batch: Callable[[int], None] | None = None,
    out: np.ndarray | None = None,
    done: list[int] | None = None,
    step_rows: int = EMBED_STEP_ROWS,
    times: StageTimes | None = None,
    batch_tokens: int | None = None,
) -> np.ndarray:
    """Embed every context of a shard in steps of `EMBED_STEP_ROWS` rows, each in length-sorted batches of at
    most ``batch_size`` rows and ``batch_tokens`` padded tokens (`token_batches`); rows come back in the shard's
    order. ``on_batch`` hears the number of contexts of each batch done (progress);
    ``out`` receives the rows, and ``done[0]`` says how many leading rows are embedded (an interrupted build
    writes the articles they cover). ``times`` counts each batch's tokens and padded tokens."""
    n = len(prepared.inputs)
    all_lengths = prepared.inputs.lengths
    out = np.empty((n, encoder.hidden_size), dtype=np.float16) if out is None else out
    step = max(1, step_rows)
    # A CPU forward allocates its activations on the host heap, batch after batch: trimmed after each batch
    # (docs/decisions/malloc-trim.md). A GPU forward does not: the host heap is trimmed once per step.
    trim_each_batch = encoder.device.type == "cpu"

    def land(idx: np.ndarray, result: Callable[[], np.ndarray]) -> None:
        out[idx] = result()
        if trim_each_batch:  # the CPU forward's freed buffers go back to the system, not to glibc's heap
            return_free_memory()
        if on_batch is not None:
            on_batch(len(idx))

    for lo in range(0, n, step):
        order = lo + np.argsort(all_lengths[lo : min(n, lo + step)], kind="stable")
        lengths = all_lengths[order].tolist()
        # each batch is started before the previous one's rows are taken: on a GPU the next batch's padding and
        # host-to-device copy, and the previous batch's copy back, overlap the forward (`encode_async`)
        pending: tuple[np.ndarray, Callable[[], np.ndarray]] | None = None
        for start, end in token_batches(lengths, batch_size, batch_tokens):
            idx = order[start:end]
            started = (idx, encoder.encode_async(prepared.inputs.take(idx)))
            if times is not None:
                times.pad(sum(lengths[start:end]), (end - start) * lengths[end - 1])
            if pending is not None:
                land(*pending)
            pending = started
        if pending is not None:
            land(*pending)
        if not trim_each_batch:
            return_free_memory()
        if done is not None:
            done[0] = min(n, lo + step)
    return out


class _PartialPart(Exception):
    """Ctrl-C while a part was embedded: its first ``rows`` rows are in ``vectors``."""

    def __init__(self, vectors: np.ndarray, rows: int):
        super().__init__(rows)
        self.vectors, self.rows = vectors, rows


def _whole_articles(prepared: PreparedShard, rows: int) -> tuple[int, int]:
    """How many leading articles of a part lie within its first ``rows`` rows, and the rows they hold."""
    n, end = 0, 0
    for meta in prepared.articles:
        if meta["row_end"] > rows:
            break
        n, end = n + 1, meta["row_end"]
    return n, end


def _build_state(
    settings: BuildSettings, encoder: MaskedLMEncoder, stop_hash: str, sources: list[SourceInfo], unit: str
) -> dict:
    """What a resumed build must share with the build it resumes."""
    return {
        "corpus": [str(Path(p).resolve()) for p in settings.corpus],
        "corpus_sha256": [s.sha256 for s in sources],
        "model_sha256": encoder.weights_sha256,
        "dtype": str(encoder.dtype).removeprefix("torch."),
        "layer": encoder.layer,
        "max_seq_len": settings.max_seq_len,
        "articles_per_shard": settings.articles_per_shard,
        "limit_articles": settings.limit_articles,
        "min_sentence_chars": settings.min_sentence_chars,
        "stopwords_sha256": stop_hash,
        "num_shards": settings.num_shards,
        "shard_index": settings.shard_index,
        # only when not the default, so that a build started before this setting existed still resumes
        **({"targets": settings.targets} if settings.targets != "single-piece" else {}),
        # likewise only when kept (builds started before links existed had none)
        **({"links": True} if settings.links else {}),
        # the forward backend in use (a resumed build does not mix backends); likewise only when not eager
        **({"backend": encoder.backend} if encoder.backend != "eager" else {}),
        # the rules that turn wikitext into sentences: a build started under other rules is not resumed
        "text_rules": TEXT_RULES,
        "contexts_per_shard": settings.contexts_per_shard,
        "blocks": unit,
        # the codec asked for; only when not fp16 (builds started before codecs existed still resume)
        **({"codec": _codec_state(settings)} if settings.codec != "fp16" or settings.codec_from else {}),
    }


def _codec_state(settings: BuildSettings) -> dict:
    if settings.codec_from is not None:
        return {"from": str(Path(settings.codec_from).resolve())}
    spec = settings.codec_spec()
    return {
        "name": spec.name, "code_bytes": spec.code_bytes, "rotation": spec.rotation, "pca_dim": spec.pca_dim,
        "train_contexts": spec.train_contexts, "seed": spec.seed,
    }  # fmt: skip


@dataclass(frozen=True)
class ShardOptions:
    """How articles become shard rows: the same for a build and for an ``add`` to the datastore it made."""

    max_seq_len: int
    stopwords: frozenset[str]
    min_sentence_chars: int
    targets: TargetMode
    batch_size: int
    workers: int
    contexts_per_shard: int | None = None  # None: one part per block
    links: bool = False  # keep entity links (rows labelled with their link targets)
    checkpoint_contexts: int = EMBED_STEP_ROWS  # rows per embedding step: what an interrupt may lose
    batch_tokens: int | None = None  # padded tokens per forward batch (None: rows alone bound a batch)


@dataclass
class Work:
    """A block's articles still to embed, written as parts ``first_part``, ``first_part + 1``, ...; resuming a
    block starts after its finished parts."""

    block: int
    first_part: int
    articles: list[Article]


# What one worker call prepares: a bound on the memory in flight, not on the shards (parts are cut by contexts,
# between articles, whatever the pieces were).
PIECE_CHARS = 1 << 18
PIECE_ARTICLES = 64


def _pieces(works: Iterator[Work]) -> Iterator[tuple[Work, list[Article], bool]]:
    """(work, a few consecutive articles, whether they end the block)."""
    for w in works:
        if not w.articles:
            yield w, [], True
            continue
        batch: list[Article] = []
        chars = 0
        for i, art in enumerate(w.articles):
            batch.append(art)
            chars += len(art.raw)
            if chars >= PIECE_CHARS or len(batch) >= PIECE_ARTICLES or i == len(w.articles) - 1:
                yield w, batch, i == len(w.articles) - 1
                batch, chars = [], 0


class _PartCutter:
    """Prepared pieces in, parts out: a part closes before the article that would start past ``limit`` contexts
    (never inside an article), and a block's final part closes with the block (``last``, even when empty)."""

    def __init__(self, limit: int | None, whole_words: bool):
        self.limit = limit
        self.whole_words = whole_words
        self.segments: list[PreparedShard] = []
        self.rows = 0
        self.articles = 0
        self.part = 0
        self.work: Work | None = None

    def feed(self, work: Work, prepared: PreparedShard, last: bool) -> Iterator[tuple[int, int, bool, PreparedShard]]:
        """(block, part, last, the part's prepared rows) for each part the piece closes."""
        if work is not self.work:
            self.work, self.part = work, work.first_part
        start = 0
        for i, meta in enumerate(prepared.articles):
            if self.limit is not None and self.articles and self.rows >= self.limit:
                self.segments.append(prepared.select(start, i))
                yield self._close(work.block, last=False)
                start = i
            self.rows += meta["row_end"] - meta["row_start"]
            self.articles += 1
        self.segments.append(prepared.select(start, len(prepared.articles)))
        if last:
            yield self._close(work.block, last=True)

    def _close(self, block: int, *, last: bool) -> tuple[int, int, bool, PreparedShard]:
        pieces = [s for s in self.segments if s.articles] or self.segments[:1]  # an empty block: one empty part
        joined = PreparedShard.concat(block, pieces, self.whole_words)
        out = (block, self.part, last, joined)
        self.segments, self.rows, self.articles = [], 0, 0
        self.part += 1
        return out


def embed_shards(
    out: Path,
    works: Iterator[Work],
    encoder: MaskedLMEncoder,
    options: ShardOptions,
    written: Callable[[ShardInfo], None],
    on_batch: Callable[[int], None] | None = None,
    times: StageTimes | None = None,
    coder: Coder | None = None,
    *,
    train_only: bool = False,
    on_prepared: Callable[[int, int], None] | None = None,
) -> float:
    """Prepare (worker processes, a few articles per call), cut into parts of at most ``contexts_per_shard``
    contexts, embed and write every part of every work's block, in order.

    ``coder``: the rows are stored as its codec's codes; an untrained codec is trained on the first parts
    (at least its minimum of contexts, counted before any forward pass, else BuildError) before they are written.
    ``train_only``: stop once the codec is trained (``train-codec``), writing no shard.

    Each finished part is renamed into ``out/shards/`` atomically and reported to ``written``; returns the
    seconds spent in the model. Memory in flight: the pieces being prepared plus one part.
    """
    tok_dir = tempfile.mkdtemp(prefix="bertknn-tok-")
    try:
        encoder.tokenizer.save_pretrained(tok_dir)
        run = _ShardEmbedder(out, encoder, options, written, on_batch, times, coder, on_prepared, tok_dir)
        return run.run(works, train_only=train_only)
    finally:
        shutil.rmtree(tok_dir, ignore_errors=True)


_Cut = tuple[int, int, bool, PreparedShard]  # (block, part, last part of its block, the part's prepared rows)


class _ShardEmbedder:
    """`embed_shards`' one run: the preparing workers ahead of the model, the model, and one writer thread behind
    it (a part's write runs while the next part is embedded)."""

    def __init__(
        self, out: Path, encoder: MaskedLMEncoder, options: ShardOptions, written: Callable[[ShardInfo], None],
        on_batch: Callable[[int], None] | None, times: StageTimes | None, coder: Coder | None,
        on_prepared: Callable[[int, int], None] | None, tok_dir: str,
    ):  # fmt: skip
        self.out, self.encoder, self.options, self.written = out, encoder, options, written
        self.on_batch, self.times, self.coder, self.on_prepared = on_batch, times, coder, on_prepared
        self.encode_seconds = 0.0
        prep_args = (
            tok_dir, options.max_seq_len, options.stopwords, options.min_sentence_chars, options.targets, options.links
        )  # fmt: skip
        self.pool = (
            ProcessPoolExecutor(options.workers, mp_context=get_context("spawn"), initializer=_init_worker, initargs=prep_args)
            if options.workers > 0
            else None
        )
        self.local = ShardPreparer(*prep_args) if self.pool is None else None
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="shard-writer")
        self.writing: list[Future[ShardInfo]] = []

    def run(self, works: Iterator[Work], *, train_only: bool) -> float:
        cutter = _PartCutter(self.options.contexts_per_shard, self.options.targets == "whole-word")
        parts = (cut for work, piece, last in self.prepared_pieces(works) for cut in cutter.feed(work, piece, last))
        try:
            if self.coder is not None and not self.coder.ready:
                head = self.train_codec(parts)
                if train_only:
                    return self.encode_seconds
                for cut, vectors in head:
                    self.write(cut, vectors)
            for cut in parts:
                self.write(cut, self.embed_or_keep(cut))
            self.finish_write()
        except KeyboardInterrupt:
            self.finish_write()  # the parts already handed to the writer are finished, not dropped
            raise BuildInterrupted("interrupted") from None
        finally:
            self.writer.shutdown(wait=True)  # a write in flight completes (atomically) or never appears
            if self.pool is not None:
                self.pool.shutdown(cancel_futures=True)
        return self.encode_seconds

    def prepared_pieces(self, works: Iterator[Work]) -> Iterator[tuple[Work, PreparedShard, bool]]:
        """The works' pieces prepared, in order: by the workers, a few pieces ahead, or here without workers."""
        pieces = _pieces(works)
        pending: list[tuple[Work, bool, Future[PreparedShard]]] = []
        lookahead = 2 * max(1, self.options.workers)

        def refill() -> None:
            while len(pending) < lookahead:
                nxt = next(pieces, None)
                if nxt is None:
                    return
                assert self.pool is not None
                work, arts, last = nxt
                pending.append((work, last, self.pool.submit(_prepare_in_worker, work.block, arts)))

        while True:
            if self.pool is not None:
                refill()
                if not pending:
                    return
                work, last, fut = pending.pop(0)
                prepared = fut.result()
                refill()
            else:
                nxt = next(pieces, None)
                if nxt is None:
                    return
                assert self.local is not None
                work, arts, last = nxt
                prepared = self.local.prepare(work.block, arts)
            if self.times is not None:
                self.times.merge(prepared.times)
            if self.on_prepared is not None:
                self.on_prepared(len(prepared.articles), prepared.rows)
            yield work, prepared, last

    def train_codec(self, parts: Iterator[_Cut]) -> list[tuple[_Cut, np.ndarray]]:
        """The codec trained on the first parts' vectors, which are held (and returned) until it exists."""
        coder = self.coder
        assert coder is not None
        head = _head_parts(parts, coder.spec.train_contexts)
        found = sum(cut[3].rows for cut in head)
        if found < coder.min_train():
            raise BuildError(
                f"codec {coder.spec.name} needs at least {coder.min_train()} contexts to train "
                f"({coder.spec.factory(coder.dim)}), this build has {found}; add articles, or use --codec fp16"
            )
        embedded = [self.embed(cut[3]) for cut in head]
        coder.train(np.concatenate(embedded), self.out)
        return list(zip(head, embedded, strict=True))

    def embed_or_keep(self, cut: _Cut) -> np.ndarray:
        """The part's vectors; interrupted inside it, the articles embedded so far are written as a finished
        part (a resume continues after them), then the interruption goes on."""
        try:
            return self.embed(cut[3])
        except _PartialPart as partial:
            articles, rows = _whole_articles(cut[3], partial.rows)
            if articles:
                self.write((cut[0], cut[1], False, cut[3].select(0, articles)), partial.vectors[:rows])
            raise KeyboardInterrupt from None

    def embed(self, prepared: PreparedShard) -> np.ndarray:
        t1 = time.perf_counter()
        vectors = np.empty((prepared.rows, self.encoder.hidden_size), dtype=np.float16)
        done = [0]
        o = self.options
        try:
            embed_prepared(self.encoder, prepared, o.batch_size, self.on_batch, vectors, done, o.checkpoint_contexts,
                           self.times, o.batch_tokens)  # fmt: skip
        except KeyboardInterrupt:
            raise _PartialPart(vectors, done[0]) from None
        forward_s = time.perf_counter() - t1
        self.encode_seconds += forward_s
        if self.times is not None:
            self.times.add("forward", forward_s, len(prepared.inputs))
        return vectors

    def write(self, cut: _Cut, vectors: np.ndarray) -> None:
        block, part, is_last, prepared = cut
        self.finish_write()  # the previous part's write (fsyncs, checksums) ran while this one was embedded
        payload = self.coder.encode(vectors) if self.coder is not None else vectors
        data = ShardData(
            payload, prepared.labels, prepared.sentence_ids, prepared.spans, prepared.sentences, prepared.articles,
            prepared.words, prepared.entity_labels, prepared.entities,
        )  # fmt: skip
        self.writing.append(self.writer.submit(_timed_write, self.out, block, part, is_last, data, self.times))

    def finish_write(self) -> None:
        while self.writing:
            self.written(self.writing.pop(0).result())


def _head_parts(
    parts: Iterator[tuple[int, int, bool, PreparedShard]], contexts: int
) -> list[tuple[int, int, bool, PreparedShard]]:
    """The first parts, prepared but not embedded, until they hold ``contexts`` contexts or the corpus ends."""
    head: list[tuple[int, int, bool, PreparedShard]] = []
    rows = 0
    while rows < contexts and (cut := next(parts, None)) is not None:
        head.append(cut)
        rows += cut[3].rows
    return head


def _timed_write(out: Path, index: int, part: int, last: bool, data: ShardData, times: StageTimes | None) -> ShardInfo:
    t = time.perf_counter()
    info = write_shard(out, index, data, part=part, last=last)
    if times is not None:
        times.add("write", time.perf_counter() - t, info.rows)  # one writer thread: no concurrent adds
    return info


def check_corpus_files(paths: list[Path]) -> None:
    """Every corpus file exists, has a known format and can be read: checked before the model loads, so a bad
    path fails in a second, not after minutes."""
    if not paths:
        raise BuildError("no corpus given: pass --corpus FILE (JSONL or MediaWiki XML dump), repeatable")
    for path in paths:
        if not Path(path).is_file():
            what = "not a regular file" if Path(path).exists() else "no such corpus file"
            raise BuildError(f"{path}: {what}")
        detect_format(Path(path))
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as exc:
            raise BuildError(f"{path}: cannot be read ({exc.strerror or exc}); check its permissions") from exc


def build(settings: BuildSettings, encoder: MaskedLMEncoder | None = None) -> Manifest:
    """Build (or resume) a datastore as the settings say, and return its manifest: check the corpus and the output
    directory, load the model, check (or record) the build's settings, embed the shards, then write the article
    table, the indexes and the manifest."""
    check_corpus_files(settings.corpus)
    plan = plan_blocks(settings.corpus, settings.index, settings.multistream)
    check_slicing(plan, settings.limit_articles, settings.num_shards)
    out = Path(settings.out)
    _refuse_updated(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(settings.threads or cpu_quota_threads())
    encoder = encoder or MaskedLMEncoder.load(
        settings.model, layer=settings.layer, device=settings.device, dtype=settings.dtype,
        max_seq_len=settings.max_seq_len, mlm_head="ignored",
    )  # fmt: skip
    state_path = out / BUILD_STATE
    previous = json.loads(state_path.read_text()) if state_path.is_file() else None
    _choose_backend(encoder, settings, previous)
    if settings.num_shards > 1 and settings.codec != "fp16" and settings.codec_from is None:
        raise BuildError(
            f"the slices of a sliced build must share one codec: train it first (`bert-knn "
            f"train-codec --corpus ... --model ... --codec {settings.codec} --out CODEC_DIR`), then give every slice "
            "--codec-from CODEC_DIR"
        )
    stopwords = load_stopwords(settings.stopwords)
    sources = [
        SourceInfo(path=Path(p).name, format=detect_format(Path(p)), sha256=sha256_file(Path(p))) for p in settings.corpus
    ]
    state = _build_state(settings, encoder, stopwords_sha256(stopwords), sources, plan.unit)
    _check_state(out, state, previous)
    remove_stale_temp(out)
    coder = open_coder(out, settings.codec_spec(), encoder.hidden_size, settings.codec_from)
    run = _BuildRun(settings, out, plan)
    encode_seconds = run.embed(encoder, stopwords, coder)
    manifest = run.write_manifest(encoder, stopwords_sha256(stopwords), sources, coder)
    run.log_summary(encode_seconds)
    return manifest


def _refuse_updated(out: Path) -> None:
    """A datastore that `add` updated is not built into again: that would drop what was added."""
    updated = existing_manifest(out)
    if updated is not None and updated.updates:
        raise BuildError(
            f"{out} holds version {updated.version} of a datastore that `add` updated; building into it again would "
            "drop what was added. Use `bert-knn add` to update it, or another --out"
        )


def _choose_backend(encoder: MaskedLMEncoder, settings: BuildSettings, previous: dict | None) -> None:
    """The forward's backend: the one asked, and for ``auto`` the one a resumed build started with."""
    asked = settings.backend
    if asked == "auto" and previous is not None:
        asked = previous.get("backend", "eager")  # a resumed build keeps the forward it started with
    if asked != "eager":
        used = encoder.set_backend(asked, with_mlm=False)
        logger.info("forward backend: %s (asked: %s)", used, settings.backend)


def _check_state(out: Path, state: dict, previous: dict | None) -> None:
    """A resumed build must have been started with the same settings; a new one records them."""
    if previous is None:
        atomic_write_json(out / BUILD_STATE, state)
    elif previous != state:
        diff = sorted(k for k in {*state, *previous} if previous.get(k) != state.get(k))
        raise BuildError(
            f"{out} holds a build made with other settings ({', '.join(diff)} differ); "
            "use another --out, or delete the directory to start over"
        )


class _BuildRun:
    """One run of `build` after its checks: the parts it finds finished (resume) or embeds, what it counted on the
    way, its progress line, and the manifest it writes at the end."""

    def __init__(self, settings: BuildSettings, out: Path, plan: BlockPlan):
        self.settings, self.out, self.plan = settings, out, plan
        self.stats = CorpusStats()
        self.counts = Counts()
        self.infos: list[ShardInfo] = []
        self.new_contexts = 0
        self.whole = settings.num_shards == 1  # False: this process builds one slice (shards j with j % n == i)
        self.t0 = time.perf_counter()
        stored = sum(Path(p).stat().st_size for p in settings.corpus)
        if plan.unit == "streams" and not self.whole:
            stored //= settings.num_shards  # a slice of a multistream dump reads about its share of the streams
        self.stored = stored
        self.progress = BuildProgress(
            total_articles=settings.limit_articles, stages=self.stats.times, workers=settings.workers,
            read_fraction=self.read_fraction,
        )  # fmt: skip

    def read_fraction(self) -> float | None:
        return min(1.0, sum(self.stats.read.values()) / self.stored) if self.stored else None

    def works(self) -> Iterator[Work]:
        """The blocks' articles still to embed: a finished part is kept (and counted), a finished block skipped."""
        s = self.settings
        blocks = iter_blocks(
            self.plan, s.articles_per_shard, self.stats, self.counts,
            num_slices=s.num_shards, slice_index=s.shard_index, limit_articles=s.limit_articles,
        )  # fmt: skip
        for block in blocks:
            done = finished_parts(self.out, block.index)
            self.infos.extend(done)
            self.progress.resumed(sum(i.articles for i in done), sum(i.rows for i in done))
            for info in done:
                logger.info("shard %s already complete, skipped (resume)", info.name.removeprefix("shard-"))
            if done and done[-1].last:
                continue
            skip = sum(i.articles for i in done)
            if done:
                logger.info("block %05d resumed after its %d finished parts", block.index, len(done))
            yield Work(block.index, len(done), block.articles[skip:])

    def written(self, info: ShardInfo) -> None:
        self.infos.append(info)
        self.new_contexts += info.rows
        self.progress.shard_written(info.articles)

    def embed(self, encoder: MaskedLMEncoder, stopwords: frozenset[str], coder: Coder | None) -> float:
        """Embed what is left (`embed_shards`); the forward passes' seconds. Interrupted, it says what is kept."""
        s = self.settings
        options = ShardOptions(
            s.max_seq_len, stopwords, s.min_sentence_chars, s.targets, s.batch_size, s.workers,
            s.contexts_per_shard or None, s.links, s.checkpoint_contexts, s.batch_tokens or None,
        )  # fmt: skip
        try:
            return embed_shards(
                self.out, self.works(), encoder, options, self.written, self.progress.embedded, self.stats.times,
                coder, on_prepared=self.progress.prepared,
            )  # fmt: skip
        except BuildInterrupted:
            kept = sorted({i.key: i for i in self.infos}.values(), key=lambda i: i.key)
            raise BuildInterrupted(
                f"stopped: {self.out} keeps {len(kept)} finished parts ({sum(i.rows for i in kept):,} contexts of "
                f"{sum(i.articles for i in kept):,} articles; {self.new_contexts:,} contexts of them from this run); "
                f"at most {s.checkpoint_contexts:,} contexts of work in flight were lost"
            ) from None
        finally:
            self.progress.close()

    def write_manifest(
        self, encoder: MaskedLMEncoder, stop_hash: str, sources: list[SourceInfo], coder: Coder | None
    ) -> Manifest:
        """The article table, the distance scale, the indexes (a whole build) and the manifest, written."""
        s, infos, counts = self.settings, sorted(self.infos, key=lambda i: i.key), self.counts
        counts.articles = sum(i.articles for i in infos)
        counts.sentences = sum(i.sentences for i in infos)
        counts.contexts = sum(i.rows for i in infos)
        counts.skipped_pages = self.stats.skipped_pages
        atomic_write_json(self.out / REDIRECTS, dict(sorted(self.stats.redirects.items())))
        manifest = Manifest(
            model=ModelInfo(
                name=encoder.name, path=local_model_path(encoder.name), weights_sha256=encoder.weights_sha256,
                architecture=type(encoder.model).__name__, num_layers=encoder.num_layers,
                hidden_size=encoder.hidden_size, vocab_size=encoder.vocab_size, numerics=encoder.numerics,
            ),
            layer=encoder.layer, max_seq_len=s.max_seq_len, articles_per_shard=s.articles_per_shard,
            contexts_per_shard=s.contexts_per_shard or None, stopwords_sha256=stop_hash, counts=counts,
            sources=sources, shards=infos,
            slice=None if self.whole else SliceInfo(index=s.shard_index, count=s.num_shards, unit=self.plan.unit),
            targets=s.targets, codec=coder.info if coder is not None else None,
            links=LinkInfo() if s.links else None,  # (its counts come with the article table)
        )  # fmt: skip
        write_table(self.out, manifest, sorted(self.stats.redirects.items()))
        manifest.distance_scale = measure_distance_scale(self.out, manifest)
        if self.whole:
            manifest.indexes.update(_build_indexes(self.out, s, manifest))
        manifest.datastore_id = manifest.compute_id()
        write_manifest(self.out, manifest)
        self.infos = infos
        return manifest

    def log_summary(self, encode_seconds: float) -> None:
        elapsed = time.perf_counter() - self.t0
        disk = sum(f.bytes for i in self.infos for f in i.files.values())
        contexts, new = self.counts.contexts, self.new_contexts
        summary = {
            "articles": self.counts.articles,
            "sentences": self.counts.sentences,
            "contexts": contexts,
            "new_contexts": new,
            "bytes_per_context": round(disk / max(1, contexts), 1),
            "contexts_per_s": round(new / elapsed, 1) if new else None,
            "encode_contexts_per_s": round(new / encode_seconds, 1) if encode_seconds else None,
            "seconds": round(elapsed, 2),
            **self.stats.times.summary(self.settings.workers),
        }
        logger.info("build finished: %s", json.dumps(summary))


def train_codec_only(settings: BuildSettings, encoder: MaskedLMEncoder | None = None) -> CodecInfo:
    """``train-codec``: the codec a build with these settings would train, from the corpus's first contexts,
    written to ``settings.out`` (codec.faiss and codec.json) for ``build --codec-from`` (every slice of a sliced
    build). No shard is written; slicing flags are ignored (the codec is the whole corpus's)."""
    check_corpus_files(settings.corpus)
    spec = settings.codec_spec()
    if not spec.trained:
        raise BuildError("train-codec trains a codec: give --codec int8 or --codec pq")
    plan = plan_blocks(settings.corpus, settings.index, settings.multistream)
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(settings.threads or cpu_quota_threads())
    encoder = encoder or MaskedLMEncoder.load(
        settings.model, layer=settings.layer, device=settings.device, dtype=settings.dtype,
        max_seq_len=settings.max_seq_len, mlm_head="ignored",
    )  # fmt: skip
    coder = open_coder(out, spec, encoder.hidden_size)
    assert coder is not None
    if coder.ready:
        assert coder.info is not None
        return coder.info
    stopwords = load_stopwords(settings.stopwords)
    blocks = iter_blocks(plan, settings.articles_per_shard, CorpusStats(), Counts(), limit_articles=settings.limit_articles)
    options = ShardOptions(
        settings.max_seq_len, stopwords, settings.min_sentence_chars, settings.targets, settings.batch_size,
        settings.workers, settings.contexts_per_shard or None, settings.links, settings.checkpoint_contexts,
        settings.batch_tokens or None,
    )
    works = (Work(b.index, 0, b.articles) for b in blocks)
    embed_shards(out, works, encoder, options, lambda info: None, coder=coder, train_only=True)
    assert coder.info is not None
    return coder.info


def _build_indexes(out: Path, settings: BuildSettings, manifest: Manifest) -> dict[str, str]:
    """Sparse article indexes (and optionally IVF-PQ) over the finished shards."""
    indexes: dict[str, str] = {}
    if settings.sparse_indexes:
        from bertknn.builder.sparse_index import build_sparse_indexes

        indexes.update(build_sparse_indexes(out, manifest))
    if settings.ivfpq:
        from bertknn.builder.ivfpq import build_ivfpq

        indexes.update(build_ivfpq(out, manifest))
    return indexes


def existing_manifest(out: Path) -> Manifest | None:
    try:
        return read_manifest(out)
    except DatastoreError:
        return None

