"""The corpus cut into blocks: the unit of slicing (block j belongs to slice j % n).

Two ways to cut, chosen per build:

- ``articles``: the articles of all corpus files in order, first title wins, ``articles_per_shard`` per block.
  Every slice of a parallel build reads the whole corpus and keeps its own blocks.
- ``streams``: a multistream dump with its index (``...-multistream-index.txt.bz2`` beside it, or ``--index``):
  a block is a run of whole bz2 streams of at most ``articles_per_shard`` pages, cut from the index alone, and a
  slice decompresses and parses only its own blocks' streams. A single build cuts the same blocks, so n slices
  merged equal one build.

Each block is then written as one or more parts cut by contexts (``embed.embed_shards``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import count, islice
from pathlib import Path
from typing import Literal

from bertknn.builder.corpus import (
    Article,
    CorpusStats,
    StreamIndex,
    index_beside,
    read_corpora,
    read_stream_index,
    read_streams,
)
from bertknn.core.errors import BuildError
from bertknn.core.format import Counts

BlockUnit = Literal["articles", "streams"]


@dataclass
class Block:
    index: int
    articles: list[Article]


@dataclass(frozen=True)
class BlockPlan:
    """How a build's corpus is cut: by articles, or by the streams of the dumps that have an index."""

    corpus: tuple[Path, ...]
    indexes: tuple[StreamIndex | None, ...]  # per corpus file

    @property
    def unit(self) -> BlockUnit:
        return "streams" if any(i is not None for i in self.indexes) else "articles"


def plan_blocks(corpus: list[Path], index: Path | None, multistream: bool) -> BlockPlan:
    """Find each dump's multistream index (``index`` names it for a single corpus file; otherwise Wikimedia's name
    beside the dump). ``multistream=False`` ignores indexes: every slice reads the whole corpus."""
    paths = tuple(Path(p) for p in corpus)
    if index is not None:
        if len(paths) != 1:
            raise BuildError(
                f"--index {index} names the index of one dump, but {len(paths)} corpus files are given; put each "
                "dump's index beside it under Wikimedia's name (...-multistream-index.txt.bz2) instead"
            )
        if not multistream:
            raise BuildError("--index was given together with --no-multistream; leave one out")
        if not Path(index).is_file():
            raise BuildError(f"--index {index}: no such file")
        return BlockPlan(paths, (read_stream_index(paths[0], Path(index)),))
    if not multistream:
        return BlockPlan(paths, tuple(None for _ in paths))
    found = []
    for p in paths:
        beside = index_beside(p)
        found.append(read_stream_index(p, beside) if beside is not None else None)
    return BlockPlan(paths, tuple(found))


def check_slicing(plan: BlockPlan, limit_articles: int | None, num_slices: int) -> None:
    if plan.unit == "streams" and limit_articles is not None and num_slices > 1:
        raise BuildError(
            "--limit-articles cannot be split across slices of a multistream dump (a slice does not read the others' "
            "streams, so it cannot count their articles); leave out --limit-articles, build one slice, or pass "
            "--no-multistream"
        )


def iter_blocks(
    plan: BlockPlan,
    articles_per_block: int,
    stats: CorpusStats,
    counts: Counts,
    *,
    num_slices: int = 1,
    slice_index: int = 0,
    limit_articles: int | None = None,
) -> Iterator[Block]:
    """This slice's blocks, in order, with their articles (first title wins within what this process reads)."""
    check_slicing(plan, limit_articles, num_slices)
    seen: set[str] = set()
    left = [limit_articles]

    def exhausted() -> bool:
        return left[0] is not None and left[0] <= 0

    def unique(articles: Iterator[Article]) -> Iterator[Article]:
        for art in articles:
            if exhausted():
                return
            if art.title in seen:
                counts.skipped_duplicate_titles += 1
                continue
            seen.add(art.title)
            if left[0] is not None:
                left[0] -= 1
            yield art

    numbers = count()

    def article_blocks(paths: Iterable[Path]) -> Iterator[Block]:
        stream = unique(read_corpora(paths, stats))
        while chunk := list(islice(stream, articles_per_block)):
            index = next(numbers)
            if index % num_slices == slice_index:
                yield Block(index, chunk)

    if plan.unit == "articles":
        yield from article_blocks(plan.corpus)
        return
    for path, stream_index in zip(plan.corpus, plan.indexes, strict=True):
        if exhausted():
            return
        if stream_index is None:  # a file without an index among dumps with one: cut by articles, read by all
            yield from article_blocks([path])
            continue
        for first, end in stream_index.groups(articles_per_block):
            if exhausted():
                return
            index = next(numbers)
            if index % num_slices == slice_index:
                yield Block(index, list(unique(read_streams(stream_index, first, end, stats))))
