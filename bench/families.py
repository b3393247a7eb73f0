"""Speed per masked-LM family on each base model's real shape (random weights), against its own bare forward::

    python -m bench.families [--families roberta,xlm-roberta,...] [--queries 40] [--articles 20]

For each family a model of the published base shape (roberta-base, xlm-roberta-base with its 250,002-row
vocabulary, modernbert-base, deberta-v3-base with 128,100 rows, distilbert-base-uncased, and bert-base-uncased
for reference) is written with seeded random weights and a tokenizer of the family's kind trained on the Vital
Articles leads (`tests/support/families.py`; the model's vocabulary rows are the published size, the tokenizer's
own ids a part of them, as deberta-v3's are). How long a forward takes does not depend on the weights' values, so
the ratios are the service's and the builder's real overhead on that shape; the answers are meaningless.

Measured in one run per family, on this machine's default backend (ONNX Runtime on a CPU):
- uncached ``/predict`` p50 (a real service process, raw HTTP client) over the bare forward's p50 (one query
  with p_MLM), in alternating blocks of 10 queries so the host's drift falls on both;
- the builder's contexts/s over the bare forward of the same batches (`bench.builder.one_run`), at the builder's
  default threads (the CPU quota), on ``--builder-articles`` leads.
Writes ``bench/results/families.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.builder import one_run
from bench.common import (
    RUNS,
    SHARED,
    bare_forward,
    lama_queries,
    machine,
    percentiles,
    service_process,
    write_result,
)
from bench.serving import http_latencies

VITAL = SHARED / "data" / "wiki" / "vital_articles.jsonl"
# the published base configurations, the fields that set the compute
SHAPES: dict[str, dict[str, Any]] = {
    "bert": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
             "vocab_size": 30522, "max_position_embeddings": 512},
    "distilbert": {"dim": 768, "n_layers": 6, "n_heads": 12, "hidden_dim": 3072, "vocab_size": 30522,
                   "max_position_embeddings": 512},
    "roberta": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
                "vocab_size": 50265, "max_position_embeddings": 514},
    "xlm-roberta": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                    "intermediate_size": 3072, "vocab_size": 250002, "max_position_embeddings": 514},
    "modernbert": {"hidden_size": 768, "num_hidden_layers": 22, "num_attention_heads": 12, "intermediate_size": 1152,
                   "vocab_size": 50368, "max_position_embeddings": 8192, "global_attn_every_n_layers": 3,
                   "local_attention": 128},
    "deberta-v2": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
                   "vocab_size": 128100, "max_position_embeddings": 512, "position_buckets": 256},
}  # fmt: skip
BASE_NAMES = {"bert": "bert-base-uncased", "distilbert": "distilbert-base-uncased", "roberta": "roberta-base",
              "xlm-roberta": "xlm-roberta-base", "modernbert": "modernbert-base", "deberta-v2": "deberta-v3-base"}  # fmt: skip


def make_shaped(family: str, out: Path, *, texts: list[str]) -> Path:
    """A random model of the family's base shape with a trained tokenizer (reused when already written)."""
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import AutoModelForMaskedLM

    from tests.support.families import _config, train_tokenizer

    tok = train_tokenizer(family, texts, vocab_size=8000)
    shape = dict(SHAPES[family])
    rows = shape.pop("vocab_size")
    ids = {"pad": tok.pad_token_id, "cls": tok.cls_token_id, "sep": tok.sep_token_id}
    if family in ("distilbert",):
        cfg = _config(family, rows, ids, hidden=shape["dim"], layers=shape["n_layers"], heads=shape["n_heads"],
                      intermediate=shape["hidden_dim"], positions=shape["max_position_embeddings"])  # fmt: skip
    else:
        cfg = _config(family, rows, ids, hidden=shape["hidden_size"], layers=shape["num_hidden_layers"],
                      heads=shape["num_attention_heads"], intermediate=shape["intermediate_size"],
                      positions=shape["max_position_embeddings"] - (2 if "roberta" in family else 0))  # fmt: skip
        for key in ("global_attn_every_n_layers", "local_attention", "position_buckets"):
            if key in shape:
                setattr(cfg, key, shape[key])
    torch.manual_seed(0)
    tmp = out.with_name(out.name + ".partial")
    AutoModelForMaskedLM.from_config(cfg).eval().save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def serving_ratio(model: Path, ds: Path, queries: int) -> dict[str, Any]:
    """Uncached /predict p50 over the bare forward p50, alternating blocks of 10 queries."""
    from bertknn.core.encoder import MaskedLMEncoder
    from bertknn.core.format import Datastore

    man = Datastore(ds).manifest
    enc = MaskedLMEncoder.load(str(model), layer=man.layer, device="cpu", max_seq_len=man.max_seq_len)
    backend = enc.set_backend("auto")
    pool = lama_queries(queries + 20, seed=5)
    warm, asked = pool[:20], pool[20:]
    bare_forward(enc, [t for t, _ in warm[:5]])
    bare: list[float] = []
    served: list[float] = []
    with service_process(ds, env={"BERTKNN_MODEL__DEVICE": "cpu", "BERTKNN_MODEL__NAME": str(model)}) as svc:
        http_latencies(svc.url, warm, "raw")
        for i in range(0, len(asked), 10):
            block = asked[i : i + 10]
            bare += bare_forward(enc, [t for t, _ in block])
            served += http_latencies(svc.url, block, "raw")[0]
    b, s = percentiles(bare), percentiles(served)
    return {"backend": backend, "bare_forward_p50_ms": round(b["p50"] * 1000, 2),
            "uncached_p50_ms": round(s["p50"] * 1000, 2), "uncached_p99_ms": round(s["p99"] * 1000, 2),
            "uncached_p50_over_bare_p50": round(s["p50"] / b["p50"], 3), "queries": len(asked)}  # fmt: skip


def builder_ratio(model: Path, corpus: Path) -> dict[str, Any]:
    """A build at the builder's default threads (the CPU quota) against the bare forward of its batches."""
    import torch

    from bertknn.core.encoder import MaskedLMEncoder
    from bertknn.core.runtime import cpu_quota_threads

    torch.set_num_threads(cpu_quota_threads())

    args = SimpleNamespace(model=model, device="cpu", batch_size=128, max_seq_len=128, articles_per_shard=5,
                           workers=1, code_bytes=0)  # fmt: skip
    enc = MaskedLMEncoder.load(str(model), device="cpu", max_seq_len=128, mlm_head="ignored")
    try:
        run = one_run(enc, corpus, args, "auto")  # type: ignore[arg-type]
    finally:
        torch.set_num_threads(1)
    keep = ("backend", "contexts", "build_ctx_per_s", "bare_forward_ctx_per_s", "build_over_forward", "bound")
    return {"threads": cpu_quota_threads(), **{k: run[k] for k in keep}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.families", description=__doc__.splitlines()[0])
    p.add_argument("--families", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--queries", type=int, default=40, help="uncached /predict queries per family (at least 10)")
    p.add_argument("--articles", type=int, default=8, help="Vital Articles leads the served datastore holds")
    p.add_argument("--builder-articles", type=int, default=30, help="Vital Articles leads the timed build reads")
    p.add_argument("--work", type=Path, default=RUNS / "bench-families")
    args = p.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(SHAPES))
    if unknown or not families:
        p.error(f"--families: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(SHAPES)}")
    if args.queries < 10 or args.articles < 1 or args.builder_articles < 1:
        p.error("--queries must be at least 10, --articles and --builder-articles at least 1")
    logging.basicConfig(level=logging.WARNING)
    import torch

    torch.set_num_threads(1)  # the service's default on 2 cores: the CPU quota less one
    from bench.common import build_datastore

    leads = [json.loads(line) for line in VITAL.open(encoding="utf-8")]
    args.work.mkdir(parents=True, exist_ok=True)
    corpus = args.work / "corpus.jsonl"
    corpus.write_text("".join(json.dumps(a) + "\n" for a in leads[: args.articles]), encoding="utf-8")
    build_corpus = args.work / f"corpus-{args.builder_articles}.jsonl"
    build_corpus.write_text("".join(json.dumps(a) + "\n" for a in leads[: args.builder_articles]), encoding="utf-8")
    texts = [a["text"] for a in leads[:3000]]
    path = None
    result: dict[str, Any] = {"machine": machine(), "service_torch_threads": 1, "articles": args.articles,
                              "builder_articles": args.builder_articles, "families": {}}  # fmt: skip
    for family in families:
        model = make_shaped(family, args.work / f"{family}-base-shaped", texts=texts)
        ds = build_datastore([corpus], args.work / f"ds-{family}", model)
        row: dict[str, Any] = {"shape": BASE_NAMES[family], "serving": serving_ratio(model, ds, args.queries),
               "builder": builder_ratio(model, build_corpus)}  # fmt: skip
        result["families"][family] = row
        s, b = row["serving"], row["builder"]
        print(f"{BASE_NAMES[family]:24s} /predict p50 {s['uncached_p50_ms']:7.1f} ms = {s['uncached_p50_over_bare_p50']:.3f}x "
              f"bare {s['bare_forward_p50_ms']:.1f} ms ({s['backend']}); build {b['build_ctx_per_s']:.1f} ctx/s = "
              f"{b['build_over_forward']:.3f}x bare ({b['backend']})", flush=True)  # fmt: skip
        path = write_result("families", result)  # after each family: a long run that stops keeps its rows
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
