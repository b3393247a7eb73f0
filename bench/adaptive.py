"""Adaptive retrieval: do queries that skip the kNN search answer faster? One command::

    python -m bench.adaptive [--model DIR] [--articles 150] [--queries 120] [--rule FILE]

Builds (or reuses) a datastore from the first ``--articles`` lead sections of ``wiki/vital_articles.jsonl`` with
the proxy model. The adaptive rule is ``--rule`` or the default rule with its skip threshold at the median top-1
p_MLM of the queries, so that about half of them skip: this bench measures speed; ``python -m evaluation lama
--adaptive`` fits a rule for accuracy. Every query (LAMA T-REx templates) runs in fixed and in adaptive mode,
interleaved, in two measurements, all in the same run:

- ``http``: end to end through ``python -m service`` with the cache off (every request runs the forward pass and
  the retrieval), at the server's default setting;
- ``after_forward``: in process, the work after the forward pass (`AnswerPipeline.finish`: retrieval, kNN,
  interpolation; retrieval cache off) on each query's encoding, best of ``--repeats`` runs, at the default
  setting (subject article or BM25 top 3, k=128) and at a wide one (BM25 top 20 articles, k=1024, no subject).

Each reports the p50 latency of the adaptive queries that skipped kNN over those that did not, and adaptive over
fixed on the same queries (the fair comparison: same texts). Writes ``bench/results/adaptive.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import torch

from bench.common import (
    PROXY_MODEL,
    RUNS,
    SHARED,
    build_datastore,
    lama_queries,
    machine,
    percentiles,
    running_service,
    write_result,
)
from bertknn.core.encoder import MaskedLMEncoder
from bertknn.core.format import Datastore
from bertknn.service.codec import QueryEncoding
from bertknn.service.interpolate import AdaptiveRule, Interpolation, confidence


def mlm_confidences(model: str, ds: Path, texts: list[str], measure: str) -> list[float]:
    """conf(p_MLM) of each query from the compact p_MLM the service keeps (the form its decision uses)."""
    man = Datastore(ds).manifest
    enc = MaskedLMEncoder.load(model, layer=man.layer, device="cpu", dtype="float32", max_seq_len=man.max_seq_len)
    out = []
    for i in range(0, len(texts), 32):
        res = enc.encode([enc.query_input(t) for t in texts[i : i + 32]], with_mlm=True)
        assert res.mlm_log_probs is not None
        for emb, lp in zip(res.embeddings, res.mlm_log_probs.numpy(), strict=True):
            p = QueryEncoding.from_log_probs(emb, lp, 2048).p_mlm()
            out.append(confidence(p, measure))  # type: ignore[arg-type]
    return out


def interleaved(url: str, queries: list[tuple[str, str]]) -> list[dict]:
    """Each query in both modes, alternating which goes first; latency (s), knn_skipped and server timings."""
    rows = []
    with httpx.Client(base_url=url, timeout=60) as c:
        for i, (text, subject) in enumerate(queries):
            row: dict = {"text": text}
            modes = ("fixed", "adaptive") if i % 2 == 0 else ("adaptive", "fixed")
            for mode in modes:
                t = time.perf_counter()
                r = c.post("/predict", json={"text": text, "subject": subject, "interpolation": mode})
                row[mode] = time.perf_counter() - t
                r.raise_for_status()
                body = r.json()
                assert body["interpolation"] == mode
                row[f"{mode}_timings"] = body["timings_ms"]
                if mode == "adaptive":
                    row["skipped"] = body["knn_skipped"]
            rows.append(row)
    return rows


SETTINGS = {"default": {"num_articles": 3, "k": 128, "subject": True}, "wide": {"num_articles": 20, "k": 1024,
            "subject": False}}  # fmt: skip


def after_forward(ds: Path, model: str, queries: list[tuple[str, str]], rule: AdaptiveRule, *, repeats: int) -> dict:
    """In process: `finish` (everything after the forward pass) timed per query in both modes, interleaved."""
    from bertknn.service.cache import InMemoryCache
    from bertknn.service.pipeline import AnswerPipeline, Query, Stage

    pipe = AnswerPipeline.open(ds, model=model, device="cpu", cache=InMemoryCache(0))  # retrieval never cached
    try:
        encs, _ = pipe.encode([pipe.check_query(Query(t)) for t, _ in queries])
        out = {}
        for name, s in SETTINGS.items():
            rows = []
            for (text, subject), enc in zip(queries, encs, strict=True):
                base = Query(text, subject=subject if s["subject"] else None, num_articles=int(s["num_articles"]),
                             k=int(s["k"]), rule=rule)  # fmt: skip
                row: dict = {"text": text, "fixed": [], "adaptive": []}
                for rep in range(repeats):
                    modes: tuple[Interpolation, ...] = ("fixed", "adaptive") if rep % 2 == 0 else ("adaptive", "fixed")
                    for mode in modes:
                        q = replace(base, interpolation=mode)
                        t = time.perf_counter()
                        ans = pipe.finish(q, enc, "miss", Stage())
                        row[mode].append(time.perf_counter() - t)
                        row[f"{mode}_timings"] = ans.timings_ms
                        if mode == "adaptive":
                            row["skipped"] = ans.knn_skipped
                # best of the repeats: the work itself, without other processes' interference
                row["fixed"], row["adaptive"] = min(row["fixed"]), min(row["adaptive"])
                rows.append(row)
            out[name] = {"num_articles": s["num_articles"], "k": s["k"], "subject": s["subject"],
                         **summarize_pass(rows)}  # fmt: skip
        return out
    finally:
        pipe.close()


def _ms(samples: list[float]) -> dict[str, float]:
    return {k: (v * 1000 if k != "n" else v) for k, v in percentiles(samples).items()} if samples else {}


def summarize_pass(rows: list[dict]) -> dict:
    skipped = [r for r in rows if r["skipped"]]
    kept = [r for r in rows if not r["skipped"]]
    if not skipped or not kept:
        raise SystemExit("every query skipped kNN, or none did: pass a --rule whose threshold splits the queries")
    out: dict = {
        "adaptive_skipped_ms": _ms([r["adaptive"] for r in skipped]),
        "adaptive_not_skipped_ms": _ms([r["adaptive"] for r in kept]),
        "paired": {},
        "avoided_server_ms": {  # what fixed mode spends on the queries that adaptive mode skips
            stage: float(np.mean([r["fixed_timings"].get(stage, 0.0) for r in skipped])) for stage in ("retrieval", "knn")
        },
    }
    out["skipped_over_not_skipped_p50"] = out["adaptive_skipped_ms"]["p50"] / out["adaptive_not_skipped_ms"]["p50"]
    for name, group in (("skipped", skipped), ("not_skipped", kept)):
        fixed, adaptive = _ms([r["fixed"] for r in group]), _ms([r["adaptive"] for r in group])
        per_query = [r["adaptive"] / r["fixed"] for r in group]
        out["paired"][name] = {
            "fixed_ms": fixed,
            "adaptive_ms": adaptive,
            "adaptive_over_fixed_p50": adaptive["p50"] / fixed["p50"],
            "median_per_query_ratio": float(np.median(per_query)),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.adaptive", description=__doc__)
    p.add_argument("--model", default=str(PROXY_MODEL))
    p.add_argument("--corpus", type=Path, default=SHARED / "data" / "wiki" / "vital_articles.jsonl")
    p.add_argument("--articles", type=int, default=150)
    p.add_argument("--queries", type=int, default=120)
    p.add_argument("--rule", type=Path, help="adaptive rule JSON (default: default rule, median skip threshold)")
    p.add_argument("--work", type=Path, default=RUNS / "bench-adaptive")
    p.add_argument("--threads", type=int, default=0, help="torch threads of the service (0 = its default)")
    p.add_argument("--repeats", type=int, default=5, help="in-process runs per query and mode (the best counts)")
    args = p.parse_args(argv)

    from bertknn.service.main import default_threads

    t_start = time.perf_counter()
    threads = args.threads or default_threads()
    torch.set_num_threads(threads)
    ds = build_datastore([args.corpus], args.work / "ds", args.model, limit=args.articles)
    man = Datastore(ds).manifest
    queries = lama_queries(args.queries, seed=7)
    if args.rule:
        rule = AdaptiveRule.load(args.rule)
    else:
        conf = mlm_confidences(args.model, ds, [t for t, _ in queries], "top1")
        rule = AdaptiveRule(skip_threshold=float(np.median(conf)))
    rule_path = args.work / "rule.json"
    rule.save(rule_path)
    env = {"BERTKNN_MODEL__THREADS": str(threads), "BERTKNN_DEFAULTS__ADAPTIVE_RULE": str(rule_path)}

    result: dict = {
        "model": Path(args.model).name,
        "machine": machine(),
        "datastore": {"articles": man.counts.articles, "contexts": man.counts.contexts},
        "setting": "server defaults: bm25 (or the subject's article), N=3, k=128, l=6; fixed lambda 0.3",
        "rule": rule.model_dump(),
        "queries": len(queries),
    }
    warm_up = lama_queries(8, seed=99)
    # end to end, no cache: every request runs the forward pass and the retrieval
    with running_service(ds, env={**env, "BERTKNN_CACHE__LRU_SIZE": "0"}) as url:
        interleaved(url, warm_up)
        http = interleaved(url, queries)
    result["skipped_fraction"] = sum(r["skipped"] for r in http) / len(http)
    result["http"] = summarize_pass(http)
    result["after_forward"] = after_forward(ds, args.model, queries, rule, repeats=args.repeats)
    result["wall_s"] = round(time.perf_counter() - t_start, 1)

    path = write_result("adaptive", result)
    print(f"model {result['model']}, {result['datastore']['contexts']} contexts, {len(queries)} queries, "
          f"kNN skipped for {100 * result['skipped_fraction']:.0f} % (skip threshold {rule.skip_threshold:.4f} "
          f"on top-1 p_MLM)")  # fmt: skip
    passes = {"http (default setting)": result["http"]}
    passes.update({f"after forward ({k} setting)": v for k, v in result["after_forward"].items()})
    for name, s in passes.items():
        ps, pk = s["paired"]["skipped"], s["paired"]["not_skipped"]
        print(f"{name}: adaptive p50 skipped {s['adaptive_skipped_ms']['p50']:.2f} ms vs not skipped "
              f"{s['adaptive_not_skipped_ms']['p50']:.2f} ms -> ratio {s['skipped_over_not_skipped_p50']:.2f}")
        print(f"  same queries, adaptive/fixed p50: skipped {ps['adaptive_ms']['p50']:.2f}/{ps['fixed_ms']['p50']:.2f}"
              f" ms -> {ps['adaptive_over_fixed_p50']:.2f}x; not skipped {pk['adaptive_ms']['p50']:.2f}/"
              f"{pk['fixed_ms']['p50']:.2f} ms -> {pk['adaptive_over_fixed_p50']:.2f}x; work avoided per skipped "
              f"query (fixed mode): retrieval {s['avoided_server_ms']['retrieval']:.2f} ms, kNN "
              f"{s['avoided_server_ms']['knn']:.2f} ms")  # fmt: skip
    print(f"wrote {path} ({result['wall_s']:.0f} s)")
    print(json.dumps({n: round(s["skipped_over_not_skipped_p50"], 3) for n, s in passes.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
