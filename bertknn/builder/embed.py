"""Embedding prepared shards: parts cut by contexts (between articles), their forward passes in length-sorted
batches, and the parts written as shard files, with the preparing workers ahead and one writer behind."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from bertknn.builder.coding import Coder
from bertknn.builder.corpus import Article
from bertknn.builder.prepare import PreparedShard, ShardPreparer, init_worker, prepare_in_worker
from bertknn.builder.stages import StageTimes
from bertknn.builder.targets import TargetMode
from bertknn.builder.writer import ShardData, write_shard
from bertknn.core.encoder import MaskedLMEncoder
from bertknn.core.errors import BuildError, BuildInterrupted
from bertknn.core.format import ShardInfo
from bertknn.core.inputs import PackedInputs
from bertknn.core.runtime import return_free_memory

logger = logging.getLogger(__name__)

# Rows embedded per step (on a CPU, the default of ``checkpoint_contexts``), in the shard's (article) order, each
# step in length-sorted batches: an interrupted build keeps every article whose rows were all embedded.
EMBED_STEP_ROWS = 2048
# On a GPU, batches per step (the default there): batches are cut from each step's length-sorted rows, so a step of
# few large batches pads them like unsorted ones; this many is a second or two of a GPU's work.
GPU_STEP_BATCHES = 32


# Under the output folder: the rows a Ctrl-C found embedded past its part's last whole article (an article is
# written whole or not at all), with what they were embedded from; the resume's first part that starts with the
# same inputs takes them instead of embedding them again.
CARRIED = "carried.npz"


def _fingerprint(inputs: PackedInputs, n: int) -> str:
    """sha256 of the first ``n`` inputs (their ids, lengths and mask positions)."""
    head = inputs[:n]
    h = hashlib.sha256()
    for arr in (head.ids[head.offsets[0] : head.offsets[-1]], np.diff(head.offsets), head.mask_pos):
        h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
    return h.hexdigest()


def save_carried(out: Path, inputs: PackedInputs, vectors: np.ndarray) -> None:
    """Keep ``vectors`` (the first rows of ``inputs``) for the resume, atomically."""
    tmp = out / (CARRIED + ".partial")
    with tmp.open("wb") as f:
        np.savez(f, vectors=vectors, fingerprint=np.array(_fingerprint(inputs, len(vectors))))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(out / CARRIED)


def take_carried(out: Path, inputs: PackedInputs) -> np.ndarray | None:
    """The kept rows when ``inputs`` starts with the inputs they were embedded from (else None: they wait for
    another part, or a build that ends without using them removes them)."""
    path = out / CARRIED
    if not path.is_file():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            vectors, fingerprint = z["vectors"], str(z["fingerprint"])
    except (OSError, ValueError, KeyError):  # unreadable: embedded again, as without it
        return None
    n = len(vectors)
    if n == 0 or n > len(inputs) or _fingerprint(inputs, n) != fingerprint:
        return None
    return vectors


def embed_step(checkpoint_contexts: int, batch_size: int, device_type: str) -> int:
    """Rows per embedding step: ``checkpoint_contexts``, or for 0 (auto) `EMBED_STEP_ROWS` on a CPU and
    `GPU_STEP_BATCHES` batches of ``batch_size`` (at least `EMBED_STEP_ROWS`) elsewhere."""
    if checkpoint_contexts > 0:
        return checkpoint_contexts
    return EMBED_STEP_ROWS if device_type == "cpu" else max(EMBED_STEP_ROWS, GPU_STEP_BATCHES * batch_size)


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
    start: int = 0,
) -> np.ndarray:
    """Embed every context of a shard from row ``start`` (the rows before it are in ``out`` already) in steps of
    `EMBED_STEP_ROWS` rows, each in length-sorted batches of at most ``batch_size`` rows and ``batch_tokens``
    padded tokens (`token_batches`); rows come back in the shard's order. ``on_batch`` hears the number of
    contexts of each batch done (progress); ``out`` receives the rows, and ``done[0]`` says how many leading rows
    are embedded (an interrupted build writes the articles they cover). ``times`` counts each batch's tokens and
    padded tokens."""
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

    for lo in range(start, n, step):
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
    vocab_cache: str = "auto"  # where the preparing workers keep the vocabulary's word table (`VocabCache`)


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
    on_carried: Callable[[int], None] | None = None,
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
        run = _ShardEmbedder(out, encoder, options, written, on_batch, times, coder, on_prepared, tok_dir, on_carried)
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
        on_prepared: Callable[[int, int], None] | None, tok_dir: str, on_carried: Callable[[int], None] | None = None,
    ):  # fmt: skip
        self.out, self.encoder, self.options, self.written = out, encoder, options, written
        self.on_batch, self.times, self.coder, self.on_prepared = on_batch, times, coder, on_prepared
        self.encode_seconds = 0.0
        prep_args = (
            tok_dir, options.max_seq_len, options.stopwords, options.min_sentence_chars, options.targets, options.links,
            options.vocab_cache,
        )  # fmt: skip
        self.pool = (
            ProcessPoolExecutor(options.workers, mp_context=get_context("spawn"), initializer=init_worker, initargs=prep_args)
            if options.workers > 0
            else None
        )
        self.local = ShardPreparer(*prep_args) if self.pool is None else None
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="shard-writer")
        self.writing: list[Future[ShardInfo]] = []
        self.carried = 0  # rows kept aside by an interrupt (`CARRIED`)
        self.on_carried = on_carried  # hears the rows an earlier interrupt kept aside, taken up

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
            (self.out / CARRIED).unlink(missing_ok=True)  # every part is written: rows kept aside are not needed
        except KeyboardInterrupt:
            self.finish_write()  # the parts already handed to the writer are finished, not dropped
            raise BuildInterrupted("interrupted", self.carried) from None
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
                pending.append((work, last, self.pool.submit(prepare_in_worker, work.block, arts)))

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
        try:
            embedded = [self.embed(cut[3]) for cut in head]
        except _PartialPart:  # nothing is written before the codec exists
            raise KeyboardInterrupt from None
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
            if partial.rows > rows:  # the rows of the articles cut short: kept for the resume
                rest = cut[3].select(articles, len(cut[3].articles))
                save_carried(self.out, rest.inputs, partial.vectors[rows : partial.rows])
                self.carried = partial.rows - rows
            raise KeyboardInterrupt from None

    def embed(self, prepared: PreparedShard) -> np.ndarray:
        t1 = time.perf_counter()
        vectors = np.empty((prepared.rows, self.encoder.hidden_size), dtype=np.float16)
        carried = take_carried(self.out, prepared.inputs)
        start = 0 if carried is None else len(carried)
        if carried is not None:
            vectors[:start] = carried
            logger.info("%d contexts embedded before the interruption taken up again", start)
            if self.on_carried is not None:
                self.on_carried(start)
        done = [start]
        o = self.options
        try:
            embed_prepared(self.encoder, prepared, o.batch_size, self.on_batch, vectors, done, o.checkpoint_contexts,
                           self.times, o.batch_tokens, start)  # fmt: skip
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
