"""The self-probe: a check that needs no labelled facts, so that it runs on a datastore in any language.

Stored sentences are asked back with one of their word targets masked:
- **with the subject** (the sentence's own article), by the kNN alone with a near-zero temperature: the stored
  context at distance 0 must win, so its word comes back at rank 1 whatever a (random, tiny) model's calibration
  says. It checks that a question is tokenised, masked and embedded as the builder stored it;
- **without a subject**, by the sparse retriever: the sentence's own article among the top ``num_articles`` (or
  another that stores the same sentence).

``bert-knn eval self-probe --datastore DIR`` prints both shares; ``bench.languages`` reports them per language.
"""

from __future__ import annotations

import argparse
import random
import time
import unicodedata
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field

import numpy as np

from bertknn.core.errors import EvaluationError
from bertknn.core.format.reader import Datastore
from bertknn.evaluation.common import open_pipeline, write_report
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import Query


@dataclass(frozen=True)
class ProbeItem:
    """One stored word target: its article, sentence and the word's characters in it."""

    title: str
    sentence: str
    start: int
    end: int

    @property
    def word(self) -> str:
        return self.sentence[self.start : self.end]

    @property
    def question(self) -> str:
        return f"{self.sentence[: self.start]}[MASK]{self.sentence[self.end :]}"


@dataclass
class SelfProbeResult:
    items: int
    knn_top1: float  # the masked word at rank 1 from the kNN alone, with the subject
    retrieval_top: float | None  # the own article among the retriever's top num_articles (None: not run)
    retriever: str
    num_articles: int
    misses: list[dict[str, str]] = field(default_factory=list)  # a few, to read

    def report(self) -> dict[str, object]:
        return {
            "items": self.items, "knn_top1": round(self.knn_top1, 4),
            "retrieval_top": None if self.retrieval_top is None else round(self.retrieval_top, 4),
            "retriever": self.retriever, "num_articles": self.num_articles, "misses": self.misses,
        }  # fmt: skip


def sample_items(datastore: Datastore, n: int, seed: int = 0) -> list[ProbeItem]:
    """``n`` word targets (rows with a word label), each from a different stored sentence, drawn at random."""
    candidates: list[tuple[int, int]] = []
    for pos, shard in enumerate(datastore.shards):
        labels = np.asarray(shard.labels)
        candidates.extend((pos, int(r)) for r in np.flatnonzero(labels >= 0))
    rng = random.Random(seed)
    rng.shuffle(candidates)
    items: list[ProbeItem] = []
    seen: set[tuple[int, int]] = set()
    metas: dict[int, list[dict]] = {}
    for pos, row in candidates:
        shard = datastore.shards[pos]
        if pos not in metas:
            metas[pos] = shard.articles()
        sid = int(shard.sentence_ids[row])
        if (pos, sid) in seen:
            continue
        seen.add((pos, sid))
        start, end = (int(x) for x in shard.spans[row])
        items.append(ProbeItem(_title_of(metas[pos], row), shard.sentence(sid), start, end))
        if len(items) == n:
            break
    return items


def _title_of(articles: list[dict], row: int) -> str:
    for meta in articles:
        if meta["row_start"] <= row < meta["row_end"]:
            return str(meta["title"])
    raise EvaluationError(f"row {row} belongs to no article of its shard; run `bert-knn validate`")


def _same(a: str, b: str) -> bool:
    return unicodedata.normalize("NFC", a).strip().casefold() == unicodedata.normalize("NFC", b).strip().casefold()


def self_probe(
    pipeline: AnswerPipeline, n: int = 200, *, seed: int = 0, retriever: str | None = "bm25", num_articles: int = 3,
    batch_size: int = 32, progress: Callable[[int], None] | None = None,
) -> SelfProbeResult:  # fmt: skip
    """Ask ``n`` stored sentences back (the module docstring says how); the shares answered right."""
    if n < 1:
        raise EvaluationError("the self-probe needs at least 1 item (--n)")
    if not pipeline.datastore.manifest.counts.contexts:
        raise EvaluationError("the datastore holds no context to probe (its corpus gave none; `bert-knn validate` says why)")
    items = sample_items(pipeline.datastore, n, seed)
    if not items:
        raise EvaluationError("the datastore has no word targets to probe (every row is an entity link's anchor)")
    right = 0
    misses: list[dict[str, str]] = []
    for i in range(0, len(items), batch_size):
        batch = items[i : i + batch_size]
        answers = pipeline.predict_batch([_knn_query(it) for it in batch])
        for it, ans in zip(batch, answers, strict=True):
            got = ans.predictions[0].token if ans.predictions else ""
            if _same(got, it.word):
                right += 1
            elif len(misses) < 5:
                misses.append({"question": it.question, "subject": it.title, "gold": it.word, "top1": got})
        if progress is not None:
            progress(len(batch))
    found = None
    if retriever is not None:
        found = sum(_retrieved(pipeline, it, retriever, num_articles) for it in items) / len(items)
    return SelfProbeResult(len(items), right / len(items), found, retriever or "none", num_articles, misses)


def _knn_query(item: ProbeItem) -> Query:
    return Query(
        text=item.question, subject=item.title, top_k=1, lambda_=1.0, temperature=1e-6, mlm_prior=0.0,
        article_sharpness=0.0, return_contexts=False,
    )  # fmt: skip


def _retrieved(pipeline: AnswerPipeline, item: ProbeItem, retriever: str, num_articles: int) -> bool:
    """The sentence's article among the retrieved, or an article that stores the very same sentence (pages of a
    series, such as years, repeat whole sentences: no retriever can tell which of them a copy came from)."""
    hits, _ = pipeline.articles.retrieve(Query(text=item.question, retriever=retriever, num_articles=num_articles))  # type: ignore[arg-type]
    return any(
        h.title == item.title or item.sentence in pipeline.datastore.article_sentences(h.title) for h in hits
    )


def run_self_probe(args: argparse.Namespace, stack: ExitStack) -> int:
    """``bert-knn eval self-probe``: `bertknn.evaluation.selfprobe` on a datastore, in process."""
    t0 = time.perf_counter()
    pipeline = open_pipeline(args.datastore, model=args.model, device=args.device, threads=args.threads,
                             cache_items=1 << 12)  # fmt: skip
    stack.callback(pipeline.close)
    retriever = None if args.retriever == "none" else args.retriever
    result = self_probe(pipeline, args.n, seed=args.seed, retriever=retriever, num_articles=args.num_articles)
    language = pipeline.datastore.manifest.language
    print(f"self-probe of {args.datastore} ({language}), {result.items} stored sentences:")
    print(f"  masked word at rank 1, kNN alone with the subject: {result.knn_top1:.1%}")
    if result.retrieval_top is not None:
        print(f"  own article in the {retriever} top {args.num_articles}, no subject: {result.retrieval_top:.1%}")
    report = {"settings": {"datastore": str(args.datastore), "language": language, "n": args.n, "seed": args.seed,
                           **pipeline.identity(), "wall_s": round(time.perf_counter() - t0, 2)},
              **result.report()}  # fmt: skip
    write_report(args.out, report)
    return 0
