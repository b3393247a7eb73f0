"""The restricted kNN's rows copied once into its index, against the copy through intermediate arrays, in one run::

    python -m bench.bert_base && python -m bench.knn_prepare --dump enwiki-...-pages-articles1.xml-p000000010p000030302-shortened.bz2

Full Wikipedia articles carry thousands of contexts each, and a question without a subject searches BM25's top 3
of them: the restricted kNN reads all their rows before it compares one query with them. The dump's first
``--articles`` articles are built (bert-base-uncased's shape by default: 768-d rows, what the default model
stores; links kept), then every article set a question searches (the first N articles for N = 1 .. ``--articles``)
is prepared and searched (k 128) both ways, alternating: `RestrictedKnn.prepare` as it is (each article's rows
from the memory-mapped shard straight into the FAISS index, `fp16_index_filled`), and as it was
(`Datastore.article_rows` per article, then their concatenation, then `fp16_index`'s copy). Both must find the
same neighbours. Then ``--questions`` LAMA questions without a subject (BM25 picks the articles) are answered in
process with no cache, the restricted kNN's `prepare` switched between the two ways, alternating: the whole
answer's p50 each way. Prints p50 of each and their ratio; writes ``bench/results/knn-prepare[-MODEL].json``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from bench.common import RUNS, build_datastore, lama_queries, machine, percentiles, result_name, write_result

if TYPE_CHECKING:
    from bertknn.core.format import Datastore
    from bertknn.service.retrieval.knn import ArticleSearch, Neighbours, RestrictedKnn

T = TypeVar("T")


def before(datastore: Datastore, titles: list[str]) -> ArticleSearch:
    """`RestrictedKnn.prepare` of float16 rows as it was: rows copied per article, concatenated, then indexed."""
    from bertknn.core.format.codec import fp16_index
    from bertknn.service.retrieval.knn import ArticleSearch

    per = [datastore.article_rows([t]) for t in titles]
    vectors, labels, rows = (np.concatenate([p[i] for p in per]) for i in range(3))
    arts = np.repeat(np.arange(len(titles), dtype=np.int16), [len(p[2]) for p in per]) if len(titles) > 1 else None
    return ArticleSearch(tuple(titles), labels, rows, fp16_index(vectors), None, row_article=arts)


def search_before(datastore: Datastore, titles: list[str], q: np.ndarray) -> Neighbours:
    return before(datastore, titles).search(q, 128)


def search_now(knn: RestrictedKnn, titles: list[str], q: np.ndarray) -> Neighbours:
    return knn.prepare(titles).search(q, 128)


def answers(ds_dir: Path, questions: int) -> dict[str, float]:
    """p50 ms of uncached in-process answers without a subject, `RestrictedKnn.prepare` as it was / as it is."""
    from bertknn.service.cache import InMemoryCache
    from bertknn.service.pipeline import AnswerPipeline
    from bertknn.service.results import Query
    from bertknn.service.retrieval.knn import RestrictedKnn

    pipe = AnswerPipeline.open(ds_dir, device="cpu", cache=InMemoryCache(max_items=0))
    pipe.encoder.set_backend("auto")
    knn = pipe.knn
    now = RestrictedKnn.prepare
    ways: dict[str, Callable[..., ArticleSearch]] = {"before": lambda titles, answer="word": before(knn.datastore, titles), "after": partial(now, knn)}
    texts = [t for t, _ in lama_queries(questions, seed=5)]
    pipe.predict(Query(text=texts[0]))  # warm-up (JVM, first forward)
    times: dict[str, list[float]] = {"before": [], "after": []}
    rows: list[int] = []
    try:
        for i, text in enumerate(texts):
            for name in ("before", "after") if i % 2 else ("after", "before"):
                knn.prepare = ways[name]  # type: ignore[method-assign]
                t, ans = timed(partial(pipe.predict, Query(text=text)))
                times[name].append(t)
            rows.append(sum(pipe.datastore.articles[a.title].rows for a in ans.articles))
    finally:
        pipe.close()
    p50 = {k: percentiles(v)["p50"] * 1000 for k, v in times.items()}
    return {"before_ms": round(p50["before"], 2), "after_ms": round(p50["after"], 2),
            "ratio": round(p50["before"] / p50["after"], 3), "rows_searched_mean": round(float(np.mean(rows)))}  # fmt: skip


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.knn_prepare", description=__doc__.splitlines()[0])
    p.add_argument("--dump", type=Path, required=True, help="a pages-articles dump (plain, .bz2 or .gz)")
    p.add_argument("--model", type=Path, default=RUNS / "bert-base-shaped", help="python -m bench.bert_base writes it")
    p.add_argument("--articles", type=int, default=3, help="the dump's first N articles are built and searched")
    p.add_argument("--repeats", type=int, default=40, help="timings per article set and way")
    p.add_argument("--questions", type=int, default=40, help="LAMA questions answered each way (0: none)")
    p.add_argument("--work", type=Path, default=RUNS / "bench-knn-prepare")
    args = p.parse_args(argv)
    if not args.dump.is_file():
        p.error(f"--dump {args.dump}: no such file (bench/entity_cost.py's docstring names a small real one)")
    if not (args.model / "config.json").is_file():
        p.error(f"--model {args.model}: no model there (python -m bench.bert_base writes the default one)")
    if args.articles < 1 or args.repeats < 5 or args.questions < 0:
        p.error("--articles must be at least 1, --repeats at least 5 and --questions at least 0")
    return args


def alternating(ds: Datastore, sets: list[list[str]], repeats: int) -> dict[str, dict[str, list[float]]]:
    """For each set of titles: a query near the first article's rows searched both ways, each way
    first every other time, ``repeats`` times after one untimed pass (the pages read from disk); the seconds of
    each way. Both ways must find the same neighbours."""
    from bertknn.service.retrieval.knn import RestrictedKnn

    knn = RestrictedKnn(ds)
    rng = np.random.default_rng(0)
    times: dict[str, dict[str, list[float]]] = {}
    for titles_n in sets:
        got = times["+".join(titles_n)] = {"before": [], "after": []}
        probe = ds.article_rows(titles_n[:1])[0]
        for i in range(repeats + 1):
            q = probe[int(rng.integers(len(probe)))].astype(np.float32)
            q += 0.1 * rng.standard_normal(len(q), dtype=np.float32)
            ways = [partial(search_before, ds, titles_n, q), partial(search_now, knn, titles_n, q)]
            if i % 2:  # each way goes first every other time (the first one reads the pages for both)
                (t_new, new), (t_old, old) = timed(ways[1]), timed(ways[0])
            else:
                (t_old, old), (t_new, new) = timed(ways[0]), timed(ways[1])
            assert old.rows.tolist() == new.rows.tolist(), "the two ways found different neighbours"
            if i:  # (the first of each: pages read from disk)
                got["before"].append(t_old)
                got["after"].append(t_new)
    return times


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from bertknn.core.format import Datastore

    ds_dir = build_datastore([args.dump], args.work / f"ds-{args.model.name}-{args.articles}", args.model,
                             limit=args.articles)  # fmt: skip
    ds = Datastore(ds_dir)
    titles = [e.title for e in ds.table.live()][: args.articles]
    sets = [titles[: n + 1] for n in range(len(titles))]  # the first 1, 2, ... articles
    times = alternating(ds, sets, args.repeats)
    found: dict[str, dict[str, float]] = {}
    result: dict[str, object] = {
        "model": args.model.name, "machine": machine(), "dump": args.dump.name, "dim": ds.manifest.model.hidden_size,
        "k": 128, "repeats": args.repeats, "sets": found,
    }  # fmt: skip
    for titles_n, (key, t) in zip(sets, times.items(), strict=True):
        rows = int(sum(ds.articles[title].rows for title in titles_n))
        b, a = percentiles(t["before"])["p50"] * 1000, percentiles(t["after"])["p50"] * 1000
        found[key] = {"rows": rows, "before_ms": round(b, 2), "after_ms": round(a, 2), "ratio": round(b / a, 2)}
        print(f"{key} ({rows:,} rows, {ds.manifest.model.hidden_size}-d): prepare + search p50 "
              f"{b:.2f} -> {a:.2f} ms ({b / a:.2f}x)")  # fmt: skip
    if args.questions:
        result["answers"] = e2e = answers(ds_dir, args.questions)
        print(f"uncached answers without a subject (BM25's articles, {e2e['rows_searched_mean']:,} rows on average): "
              f"p50 {e2e['before_ms']:.2f} -> {e2e['after_ms']:.2f} ms ({e2e['ratio']:.3f}x)")  # fmt: skip
    print(f"wrote {write_result(result_name('knn-prepare', args.model), result)}")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
