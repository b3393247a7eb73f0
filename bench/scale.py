"""Wikipedia's scale on one machine: synthesise datastores of Wikipedia's shape, then measure the service on them.

    python -m bench.scale synth --articles 6900000 --redirects 11000000 --contexts 20000000 \\
        --model ../shared/models/proxy-minilm-l6-mlm --out runs/scale/full
    python -m bench.scale synth --articles 10000 --redirects 16000 --contexts 29000 --model ... --out runs/scale/small
    python -m bench.scale run runs/scale/small runs/scale/full

``synth`` writes a datastore that passes ``validate`` and that the service opens with that model, the way the
builder writes one (``write_shard``, the article table, ``redirects.json``, the BM25 and TF-IDF indexes over the
articles' stored sentences): real titles from ``../shared/data/wiki`` plus generated ones, with case and accent
variants that fold together; a long-tailed number of contexts per article (a log-normal body with a Pareto tail
scaled to the total: a few articles with tens of thousands of rows); redirects to articles, chains of redirects and dangling ones; short
synthetic sentences. Vectors are random (seeded), labels random token ids: shapes and sizes are real, answers
are not. Blocks and parts are cut as the builder cuts them (``--articles-per-shard``, ``--contexts-per-shard``).

``run`` measures each datastore in turn, one service process at a time (the model and settings the same): start-up
to ready, RSS after start-up and after the queries, uncached ``/predict`` p50/p99 with the subject rule and with
BM25, reload time and peak RSS during a reload to a new version (one more shard, its own article table) while a
client keeps asking (failed requests counted), and the disk size per part. It writes ``bench/results/scale.json``
and a table, and extrapolates to 900M contexts with the arithmetic shown.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import threading
import time
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import RESULTS, SHARED, machine, percentiles, service_process, write_json

WIKI = SHARED / "data" / "wiki"
PAPER_CONTEXTS = 900_000_000
WIKI_ARTICLES = 6_900_000
_ACCENTS = {"a": "á", "e": "é", "i": "í", "o": "ö", "u": "ü", "c": "ç", "n": "ñ"}
_SUFFIXES = ["film", "band", "album", "river", "village", "novel", "song", "surname", "ship", "company", "footballer",
             "politician", "mountain", "play", "magazine"]  # fmt: skip


# ---- synth ----------------------------------------------------------------------------------------------------


def real_titles() -> list[str]:
    out: list[str] = []
    for path in sorted(WIKI.glob("*.jsonl")):
        with open(path, encoding="utf-8") as f:
            out.extend(json.loads(line)["title"] for line in f if line.strip())
    return out


def _accented(title: str, rng: np.random.Generator) -> str | None:
    spots = [i for i, ch in enumerate(title) if ch in _ACCENTS]
    if not spots:
        return None
    i = spots[int(rng.integers(len(spots)))]
    return title[:i] + _ACCENTS[title[i]] + title[i + 1 :]


def make_titles(n: int, rng: np.random.Generator, vocab_words: list[str]) -> list[str]:
    """``n`` unique normalised titles: the real ones first, then generated "Word Word (suffix)" titles; about 2% are
    case or accent variants of another title (same folded form), as "Paris"/"PARIS" and "Emile"/"Émile" are."""
    from bertknn.core.titles import normalize_title

    seen: set[str] = set()
    titles: list[str] = []

    def take(t: str) -> None:
        t = normalize_title(t)
        if t and t not in seen:
            seen.add(t)
            titles.append(t)

    for t in real_titles():
        if len(titles) >= n:
            break
        take(t)
    words = [w.capitalize() for w in vocab_words]
    while len(titles) < n:
        k = min(n - len(titles), 1_000_000)
        a = rng.integers(len(words), size=k)
        b = rng.integers(len(words), size=k)
        suffix = rng.integers(len(_SUFFIXES) * 4, size=k)
        for i in range(k):
            t = f"{words[a[i]]} {words[b[i]]}"
            if suffix[i] < len(_SUFFIXES):
                t += f" ({_SUFFIXES[suffix[i]]})"
            if t in seen:  # a small vocabulary runs out of pairs: number them
                t = f"{t} {len(titles)}"
            take(t)
            if len(titles) < n and rng.random() < 0.02:
                variant = t.upper() if rng.random() < 0.5 else _accented(t, rng)
                if variant:
                    take(variant)
    return titles[:n]


def long_tail(n: int, total: int, rng: np.random.Generator, biggest: int = 50_000) -> np.ndarray:
    """Contexts per article: a log-normal body with a Pareto tail, scaled to ``total`` (at most ``biggest`` each),
    summing to ``total``."""
    w = rng.lognormal(0.0, 1.0, size=n) + 0.3 * rng.pareto(1.1, size=n)
    rows = np.minimum(np.floor(w / w.sum() * total), biggest).astype(np.int64)
    short = total - int(rows.sum())
    if short > 0:  # spread the rounding and the capped mass over random articles, one each
        extra = rng.choice(n, size=min(short, n), replace=short > n)
        np.add.at(rows, extra, 1)
        short = total - int(rows.sum())
        while short > 0:
            take = rng.choice(n, size=min(short, n), replace=False)
            np.add.at(rows, take, 1)
            short = total - int(rows.sum())
    return rows


def make_redirects(titles: list[str], count: int, rng: np.random.Generator) -> list[tuple[str, str]]:
    """``count`` redirects: mostly to articles (lower-cased, accent-stripped, "The ..." and alias forms), 5% to
    another redirect (a chain), 1% to no article (dangling), as a dump has them."""
    from bertknn.core.titles import normalize_title

    taken = set(titles)
    out: list[tuple[str, str]] = []
    forms = 0
    while len(out) < count:
        k = min(count - len(out), 1_000_000)
        targets = rng.integers(len(titles), size=k)
        kinds = rng.random(size=k)
        for i in range(k):
            target = titles[targets[i]]
            if kinds[i] < 0.25:
                source = target[:1] + target[1:].lower()
            elif kinds[i] < 0.45:
                source = "".join(c for c in unicodedata.normalize("NFKD", target) if not unicodedata.combining(c))
            elif kinds[i] < 0.55:
                source = f"The {target}"
            else:
                source = f"{target} (alias {forms})"
                forms += 1
            source = normalize_title(source)
            if source in taken:
                continue
            taken.add(source)
            if kinds[i] > 0.99:
                target = f"Missing article {forms}"
                forms += 1
            elif kinds[i] > 0.94 and out:
                target = out[int(rng.integers(len(out)))][0]
            out.append((source, target))
    return out


class _Parts:
    """Synthetic shard parts: each article's rows in sentences of 8 rows, each sentence the article's title and six
    of the tokenizer's whole words drawn Zipf-like (rank r with weight 1/r), as text has them; random vectors and
    labels."""

    def __init__(self, titles: list[str], rows: np.ndarray, vocab_words: list[str], rng: np.random.Generator,
                 hidden: int, vocab: int):  # fmt: skip
        self.titles, self.rows, self.rng = titles, rows, rng
        self.hidden, self.vocab = hidden, vocab
        self.words = np.array(vocab_words)
        zipf = np.cumsum(1.0 / np.arange(1, len(self.words) + 1))
        self.zipf = zipf / zipf[-1]

    def data(self, start: int, end: int) -> Any:
        """Articles ``start`` to ``end`` as one part's arrays (`ShardData`)."""
        from bertknn.builder.writer import ShardData

        arts: list[dict[str, Any]] = []
        sentences: list[str] = []
        sent_ids: list[np.ndarray] = []
        r = 0
        for j in range(start, end):
            n = int(self.rows[j])
            first_sent = len(sentences)
            draws = self.rng.random((max(1, math.ceil(n / 8)), 6))
            picks = self.words[np.minimum(np.searchsorted(self.zipf, draws), len(self.words) - 1)]
            sentences.extend(f"{self.titles[j]} {' '.join(p)} ." for p in picks)
            sent_ids.append(first_sent + np.arange(n, dtype=np.int32) // 8)
            arts.append({"title": self.titles[j], "id": str(j), "source": "synthetic", "row_start": r, "row_end": r + n,
                         "sent_start": first_sent, "sent_end": len(sentences)})  # fmt: skip
            r += n
        vectors = self.rng.standard_normal((r, self.hidden), dtype=np.float32).astype(np.float16)
        labels = self.rng.integers(min(1000, self.vocab // 2), self.vocab, size=r, dtype=np.int32)
        sids = np.concatenate(sent_ids) if sent_ids else np.zeros(0, np.int32)
        return ShardData(vectors, labels, sids, np.zeros((r, 2), np.int32), sentences, arts)

    def write(self, out: Path, articles_per_shard: int, limit: int | None) -> tuple[list, int]:
        """Every shard (``articles_per_shard`` articles, in parts of at most ``limit`` rows): their infos and the
        number of sentences."""
        from bertknn.builder.writer import write_shard

        shards, sentences = [], 0
        for block_start in range(0, len(self.titles), articles_per_shard):
            block = range(block_start, min(block_start + articles_per_shard, len(self.titles)))
            part, start = 0, block.start
            while start < block.stop:
                end, total = start, 0
                while end < block.stop and (limit is None or total < limit or end == start):
                    total += int(self.rows[end])
                    end += 1
                data = self.data(start, end)
                shards.append(write_shard(out, block_start // articles_per_shard, data, part=part,
                                          last=end == block.stop))  # fmt: skip
                sentences += len(data.sentences)
                part, start = part + 1, end
        return shards, sentences


def synth(args: argparse.Namespace) -> int:
    import torch

    from bertknn.builder.sparse_index import build_sparse_indexes
    from bertknn.builder.targets import load_stopwords, stopwords_sha256
    from bertknn.builder.writer import write_table
    from bertknn.core.encoder import MaskedLMEncoder
    from bertknn.core.format import REDIRECTS, Counts, Manifest, ModelInfo, atomic_write_json, write_manifest
    from bertknn.core.model_ref import local_model_path

    out = Path(args.out)
    if (out / "manifest.json").exists():
        raise SystemExit(f"{out} already holds a datastore; give another --out")
    t0 = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    torch.set_num_threads(1)
    encoder = MaskedLMEncoder.load(args.model, device="cpu")
    hidden, vocab = encoder.hidden_size, encoder.vocab_size
    # in id order (a fast tokenizer's get_vocab() is a hash map's order, which changes from run to run): the same
    # --seed makes the same datastore
    by_id = sorted(encoder.tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    vocab_words = [w for w, _ in by_id if re.fullmatch(r"[a-z]{4,}", w)]
    titles = make_titles(args.articles, rng, vocab_words)
    rows = long_tail(len(titles), args.contexts, rng)
    print(f"titles and rows: {time.perf_counter() - t0:.0f} s; largest article {rows.max()} rows, median "
          f"{int(np.median(rows))}, articles with 0 rows {int((rows == 0).sum())}", flush=True)  # fmt: skip
    limit = args.contexts_per_shard or None
    shards, n_sent_total = _Parts(titles, rows, vocab_words, rng, hidden, vocab).write(out, args.articles_per_shard, limit)
    print(f"shards written: {len(shards)} in {time.perf_counter() - t0:.0f} s", flush=True)
    redirects = sorted(make_redirects(titles, args.redirects, rng))
    atomic_write_json(out / REDIRECTS, dict(redirects))
    manifest = Manifest(
        model=ModelInfo(name=encoder.name, path=local_model_path(encoder.name), weights_sha256=encoder.weights_sha256,
                        architecture=type(encoder.model).__name__, num_layers=encoder.num_layers, hidden_size=hidden,
                        vocab_size=vocab),  # fmt: skip
        layer=encoder.layer,
        max_seq_len=128,
        articles_per_shard=args.articles_per_shard,
        contexts_per_shard=limit,
        stopwords_sha256=stopwords_sha256(load_stopwords(None)),
        counts=Counts(articles=len(titles), sentences=n_sent_total, contexts=int(rows.sum())),
        shards=shards,
    )
    write_table(out, manifest, redirects)
    print(f"article table written in {time.perf_counter() - t0:.0f} s", flush=True)
    if args.sparse:
        manifest.indexes.update(build_sparse_indexes(out, manifest))
        print(f"sparse indexes written in {time.perf_counter() - t0:.0f} s", flush=True)
    manifest.datastore_id = manifest.compute_id()
    write_manifest(out, manifest)
    print(json.dumps({"datastore": str(out), "articles": len(titles), "redirects": len(redirects),
                      "contexts": int(rows.sum()), "shards": len(shards),
                      "seconds": round(time.perf_counter() - t0, 1)}))  # fmt: skip
    return 0

def next_version(root: Path, seed: int = 1) -> None:
    """A new version of ``root`` as ``add`` makes one: one more shard (10 new articles), its own article table under
    ``index/vN``, the manifest bumped. (The sparse indexes stay the previous version's: enough to reload.)"""
    from bertknn.builder.writer import ShardData, write_shard, write_table
    from bertknn.core.format import ARTICLE_TABLE, INDEX_DIR, UpdateInfo, read_manifest, write_manifest

    old = read_manifest(root)
    new = old.model_copy(deep=True)
    new.version = old.version + 1
    rng = np.random.default_rng(seed)
    arts, sentences = [], []
    for i in range(10):
        arts.append({"title": f"Added article {new.version} {i}", "id": f"a{i}", "source": "added", "row_start": 8 * i,
                     "row_end": 8 * i + 8, "sent_start": i, "sent_end": i + 1})  # fmt: skip
        sentences.append(f"Added article {new.version} {i} is new .")
    data = ShardData(rng.standard_normal((80, old.model.hidden_size), dtype=np.float32).astype(np.float16),
                     rng.integers(old.model.vocab_size // 2, old.model.vocab_size, size=80, dtype=np.int32),
                     np.arange(80, dtype=np.int32) // 8, np.zeros((80, 2), np.int32), sentences, arts)  # fmt: skip
    info = write_shard(root, max(s.index for s in old.shards) + 1, data)
    new.shards = [*old.shards, info]
    new.updates = [*old.updates, UpdateInfo(version=new.version, shards=[info.name], added=10, replaced=0,
                                            unchanged=0, sources=[])]  # fmt: skip
    new.counts.articles += 10
    new.counts.sentences += 10
    new.counts.contexts += 80
    write_table(root, new, [], f"{INDEX_DIR}/v{new.version}/{ARTICLE_TABLE}", base=old.article_table,
                first_shard=len(old.shards))  # fmt: skip
    new.datastore_id = new.compute_id()
    write_manifest(root, new)


# ---- run ------------------------------------------------------------------------------------------------------


def rss_mib(pid: int, kind: str = "VmRSS") -> float:
    """``VmRSS`` (all), ``RssAnon`` (the process's own memory) or ``RssFile`` (mapped file pages: the page cache
    of the shards and indexes the queries touched, shared and reclaimable)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(kind + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def disk_parts(root: Path) -> dict[str, int]:
    parts: dict[str, int] = {}
    for p in root.rglob("*"):
        if not p.is_file():
            continue
        rel = p.relative_to(root).as_posix()
        if rel.startswith("shards/"):
            key = "shards/" + p.name
        elif "articles.sqlite" in rel:
            key = "article table"
        elif "/bm25/" in f"/{rel}":
            key = "bm25"
        elif "/tfidf/" in f"/{rel}":
            key = "tfidf"
        else:
            key = rel
        parts[key] = parts.get(key, 0) + p.stat().st_size
    return dict(sorted(parts.items()))


def ms(samples: list[float]) -> dict[str, float]:
    return {k: round(v * 1000, 2) for k, v in percentiles(samples).items() if k != "n"}


def _subjects(root: Path, queries: int, seed: int) -> list[str]:
    """Titles with contexts, drawn at random: asked as written, or lower-cased (one in three), as users type them."""
    from bertknn.core.format import Datastore

    ds = Datastore(root)
    rng = np.random.default_rng(seed)
    n = len(ds.table)
    subjects: list[str] = []
    con = ds.table._cons.get()
    while len(subjects) < queries:
        pos = int(rng.integers(n))
        row = con.execute("SELECT title FROM entries WHERE live = 1 AND row_end > row_start AND pos >= ? ORDER BY pos "
                          "LIMIT 1", (pos,)).fetchone()  # fmt: skip
        if row:
            t = row[0]
            subjects.append(t if len(subjects) % 3 else t.lower())
    ds.close()
    return subjects


def _passes(client: Any, subjects: list[str]) -> tuple[dict[str, dict[str, list[float]]], int]:
    """Two passes over the same subjects with different texts (both answer-cache misses; the cache is off anyway):
    the first reads the articles' rows from disk ("cold" when the datastore is larger than the page cache), the
    second finds them in the page cache ("warm"): the service's own cost. Seconds per request by pass and mode
    (the subject named, or BM25), and the requests that failed."""
    failures = 0
    passes: dict[str, dict[str, list[float]]] = {}
    for name in ("cold", "warm"):
        lat: dict[str, list[float]] = {"subject": [], "bm25": []}
        for i, title in enumerate(subjects):
            for mode in ("subject", "bm25"):
                body: dict[str, Any] = {"text": f"{title} {name} {i} is known for its [MASK] ."}
                body.update({"subject": title} if mode == "subject" else {"retriever": "bm25"})
                t = time.perf_counter()
                r = client.post("/predict", json=body)
                lat[mode].append(time.perf_counter() - t)
                failures += r.status_code != 200
        passes[name] = lat
    return passes, failures


def _reload_under_load(svc: Any, client: Any, subjects: list[str], root: Path, seed: int) -> dict[str, Any]:
    """A new version written and reloaded while one client keeps asking: the reload's seconds, the process's peak
    RSS meanwhile (all and anonymous) and the requests answered or failed during it."""
    import httpx

    pid = svc.proc.pid
    next_version(root, seed=seed + 1)
    stop = threading.Event()
    peak = {"VmRSS": rss_mib(pid), "RssAnon": rss_mib(pid, "RssAnon")}
    during = {"ok": 0, "failed": 0}

    def sample() -> None:
        while not stop.is_set():
            for kind in peak:
                peak[kind] = max(peak[kind], rss_mib(pid, kind))
            time.sleep(0.01)

    def ask() -> None:
        c = httpx.Client(base_url=svc.url, timeout=60)
        k = 0
        while not stop.is_set():
            r = c.post("/predict", json={"text": f"{subjects[k % len(subjects)]} r{k} is a [MASK] .",
                                         "subject": subjects[k % len(subjects)]})  # fmt: skip
            during["ok" if r.status_code == 200 else "failed"] += 1
            k += 1

    threads = [threading.Thread(target=sample), threading.Thread(target=ask)]
    for th in threads:
        th.start()
    time.sleep(0.5)
    t = time.perf_counter()
    rr = client.post("/admin/reload", headers={"Authorization": "Bearer bench-token"})
    reload_s = time.perf_counter() - t
    time.sleep(1.0)
    stop.set()
    for th in threads:
        th.join()
    if rr.status_code != 200 or rr.json().get("status") != "reloaded":
        raise SystemExit(f"reload failed: {rr.status_code} {rr.text}")
    return {"reload_s": reload_s, "peak": peak, "during": during}


def measure(root: Path, queries: int, seed: int) -> dict[str, Any]:
    import httpx

    from bertknn.core.format import Datastore, read_manifest

    manifest = read_manifest(root)
    subjects = _subjects(root, queries, seed)
    env = {"BERTKNN_ADMIN_TOKEN": "bench-token", "BERTKNN_CACHE__LRU_SIZE": "0", "HF_HUB_OFFLINE": "1"}
    t0 = time.perf_counter()
    with service_process(root, env=env, timeout_s=1800) as svc:
        startup = time.perf_counter() - t0
        kinds = ("VmRSS", "RssAnon", "RssFile")
        rss_start = {k: rss_mib(svc.proc.pid, k) for k in kinds}
        client = httpx.Client(base_url=svc.url, timeout=60)
        passes, failures = _passes(client, subjects)
        rss_q = {k: rss_mib(svc.proc.pid, k) for k in kinds}
        reload = _reload_under_load(svc, client, subjects, root, seed)
    peak = {k: max(v, rss_q[k]) for k, v in reload["peak"].items()}
    return {
        "datastore": str(root),
        "articles": manifest.counts.articles,
        "redirects": len(Datastore(root).redirects),
        "contexts": manifest.counts.contexts,
        "shards": len(manifest.shards),
        "startup_s": round(startup, 2),
        "rss_after_startup_mib": round(rss_start["VmRSS"], 1),
        "rss_anon_after_startup_mib": round(rss_start["RssAnon"], 1),
        "rss_after_queries_mib": round(rss_q["VmRSS"], 1),
        "rss_anon_after_queries_mib": round(rss_q["RssAnon"], 1),
        "rss_file_after_queries_mib": round(rss_q["RssFile"], 1),
        "predict_subject_ms": ms(passes["warm"]["subject"]),
        "predict_bm25_ms": ms(passes["warm"]["bm25"]),
        "predict_subject_cold_ms": ms(passes["cold"]["subject"]),
        "predict_bm25_cold_ms": ms(passes["cold"]["bm25"]),
        "queries_per_mode": queries,
        "failed_requests": failures,
        "reload_s": round(reload["reload_s"], 2),
        "reload_peak_rss_mib": round(peak["VmRSS"], 1),
        "reload_peak_above_steady_mib": round(peak["VmRSS"] - rss_q["VmRSS"], 1),
        "reload_peak_anon_above_steady_mib": round(peak["RssAnon"] - rss_q["RssAnon"], 1),
        "requests_during_reload": reload["during"],
        "disk_bytes": disk_parts(root),
    }

def extrapolate(full: dict[str, Any], small: dict[str, Any]) -> dict[str, Any]:
    disk = full["disk_bytes"]
    per_context = sum(v for k, v in disk.items() if k.startswith("shards/")) / full["contexts"]
    per_article = sum(v for k, v in disk.items() if not k.startswith("shards/")) / full["articles"]
    disk_900m = per_context * PAPER_CONTEXTS + per_article * WIKI_ARTICLES
    return {
        "disk_bytes_per_context": round(per_context, 1),
        "disk_bytes_per_article_outside_shards": round(per_article, 1),
        "disk_900m_tb": round(disk_900m / 1e12, 2),
        "disk_arithmetic": f"{per_context:.1f} B x 900M contexts + {per_article:.1f} B x 6.9M articles "
        f"= {disk_900m / 1e12:.2f} TB",
        "rss_anon_growth_mib": round(full["rss_anon_after_queries_mib"] - small["rss_anon_after_queries_mib"], 1),
        "startup_growth_s": round(full["startup_s"] - small["startup_s"], 2),
        "ram_arithmetic": "the process's own memory (RssAnon) does not grow with the contexts (memory-mapped shards, an "
        f"opened table): {small['rss_anon_after_queries_mib']:.0f} MiB at {small['articles']:,} articles, "
        f"{full['rss_anon_after_queries_mib']:.0f} MiB at {full['articles']:,}; 900M contexts need the same plus the "
        "page cache of the articles the queries touch (file pages, shared and reclaimable)",
        "startup_arithmetic": f"start-up grows with the shards listed in the manifest ({full['shards']} here); 900M "
        f"contexts at 100,000 per shard make about {PAPER_CONTEXTS // 100_000} shards",
    }


def run(args: argparse.Namespace) -> int:
    rows = [measure(Path(d), args.queries, args.seed) for d in args.datastores]
    result: dict[str, Any] = {"model": rows and json.loads(Path(args.datastores[0], "manifest.json").read_text())
                              ["model"]["name"], "machine": machine(), "runs": rows}  # fmt: skip
    if len(rows) >= 2:
        small, full = rows[0], rows[-1]
        result["ratios_full_over_small"] = {
            "startup_s_more": round(full["startup_s"] - small["startup_s"], 2),
            "rss_mib_more": round(full["rss_after_startup_mib"] - small["rss_after_startup_mib"], 1),
            "predict_subject_p50": round(full["predict_subject_ms"]["p50"] / small["predict_subject_ms"]["p50"], 3),
            "predict_bm25_p50": round(full["predict_bm25_ms"]["p50"] / small["predict_bm25_ms"]["p50"], 3),
            "predict_subject_p50_cold": round(full["predict_subject_cold_ms"]["p50"]
                                              / small["predict_subject_cold_ms"]["p50"], 3),
            "predict_bm25_p50_cold": round(full["predict_bm25_cold_ms"]["p50"] / small["predict_bm25_cold_ms"]["p50"], 3),
            "rss_anon_mib_more_after_queries": round(full["rss_anon_after_queries_mib"]
                                                     - small["rss_anon_after_queries_mib"], 1),
        }  # fmt: skip
        result["extrapolation_900m"] = extrapolate(full, small)
    print(f"\n{'articles':>10} {'redirects':>10} {'contexts':>11} {'shards':>7} {'start s':>8} {'RSS MiB':>8} "
          f"{'anon q':>7} {'file q':>7} {'subj p50/p99':>14} {'bm25 p50/p99':>14} {'cold subj/bm25':>15} "
          f"{'reload s':>9} {'peak+':>6} {'anon+':>6} {'fail':>5}")  # fmt: skip
    for r in rows:
        s, b = r["predict_subject_ms"], r["predict_bm25_ms"]
        cs, cb = r["predict_subject_cold_ms"], r["predict_bm25_cold_ms"]
        print(f"{r['articles']:>10} {r['redirects']:>10} {r['contexts']:>11} {r['shards']:>7} {r['startup_s']:>8} "
              f"{r['rss_after_startup_mib']:>8} {r['rss_anon_after_queries_mib']:>7} {r['rss_file_after_queries_mib']:>7} "
              f"{s['p50']:>6}/{s['p99']:<7} {b['p50']:>6}/{b['p99']:<7} {cs['p50']:>7}/{cb['p50']:<7} "
              f"{r['reload_s']:>9} {r['reload_peak_above_steady_mib']:>6} {r['reload_peak_anon_above_steady_mib']:>6} "
              f"{r['failed_requests'] + r['requests_during_reload']['failed']:>5}")  # fmt: skip
    if "extrapolation_900m" in result:
        print(json.dumps(result["ratios_full_over_small"]))
        for k, v in result["extrapolation_900m"].items():
            if k.endswith("arithmetic"):
                print(f"{k}: {v}")
    write_json(args.out, result)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("synth", help="write a datastore of Wikipedia's shape")
    s.add_argument("--articles", type=int, required=True)
    s.add_argument("--redirects", type=int, required=True)
    s.add_argument("--contexts", type=int, required=True)
    s.add_argument("--model", required=True, help="model name or directory (the service opens the datastore with it)")
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--articles-per-shard", type=int, default=5000)
    s.add_argument("--contexts-per-shard", type=int, default=100_000)
    s.add_argument("--no-sparse", dest="sparse", action="store_false", help="skip the BM25 and TF-IDF indexes")
    s.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run", help="measure the service on each datastore (smallest first)")
    r.add_argument("datastores", nargs="+")
    r.add_argument("--queries", type=int, default=1000, help="uncached /predict requests per mode")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", type=Path, default=RESULTS / "scale.json")
    args = p.parse_args(argv)
    if args.command == "synth":
        for name in ("articles", "contexts"):
            if getattr(args, name) < 1:
                p.error(f"--{name} must be at least 1")
        if args.redirects < 0:
            p.error("--redirects must be at least 0")
        return synth(args)
    return run(args)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
