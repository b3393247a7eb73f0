"""How much the forward's numerics (dtype, backend) change the answers of one datastore::

    python -m bench.numerics --datastore DIR [--questions 200]

The same questions (the datastore's own article subjects with four relation templates, then LAMA T-REx
questions) are answered in process by the datastore's model in each of float32/eager (the reference),
float32/onnx, bfloat16/eager and float16/eager, on the CPU, with no cache. Per numerics: the top-1 answer's
agreement with the reference, the largest change of the top-1 probability, and the query embeddings' relative L2
difference. Writes ``bench/results/numerics.json``; docs/decisions/numerics.md reads it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bench.common import lama_queries, machine, write_result

TEMPLATES = ("[X] was born in [Y] .", "[X] is located in [Y] .", "[X] is a member of [Y] .", "[X] is part of [Y] .")
NUMERICS = (("float32", "eager"), ("float32", "onnx"), ("bfloat16", "eager"), ("float16", "eager"))


def _questions(datastore: Path, n: int) -> list[tuple[str, str | None]]:
    from bertknn.core.format import Datastore

    ds = Datastore(datastore)
    subjects = [title for title, _ in ds.iter_article_texts()][:20]
    own: list[tuple[str, str | None]] = [(t.replace("[X]", s).replace("[Y]", "[MASK]"), s) for s in subjects for t in TEMPLATES]
    lama: list[tuple[str, str | None]] = [(text, None) for text, _ in lama_queries(max(0, n - len(own)))]
    return (own + lama)[:n]


def _answers(datastore: Path, dtype: str, backend: str, questions: list[tuple[str, str | None]]) -> dict:
    from bertknn.service.cache import InMemoryCache
    from bertknn.service.pipeline import AnswerPipeline
    from bertknn.service.results import Query

    pipe = AnswerPipeline.open(datastore, device="cpu", dtype=dtype, cache=InMemoryCache(max_items=0))
    try:
        pipe.local_encoder.set_backend(backend)
        lower = pipe.encoder.words.lowercase
        texts = [(t.lower().replace("[mask]", "[MASK]") if lower else t, s) for t, s in questions]
        top, prob, emb = [], [], []
        for text, subject in texts:
            answer = pipe.predict(Query(text=text, subject=subject, top_k=1))
            top.append(answer.predictions[0].token)
            prob.append(answer.predictions[0].prob)
            emb.append(pipe.encoder.encode([pipe.encoder.query_input(text)], with_mlm=True).embeddings[0])  # (the served path)
        return {"numerics": pipe.encoder.numerics, "top": top, "prob": np.array(prob), "emb": np.stack(emb)}
    finally:
        pipe.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.numerics", description=__doc__.splitlines()[0])
    p.add_argument("--datastore", type=Path, required=True, help="a built datastore (its manifest names the model)")
    p.add_argument("--questions", type=int, default=200)
    args = p.parse_args(argv)
    if not (args.datastore / "manifest.json").is_file():
        p.error(f"--datastore {args.datastore}: no manifest.json there; build one first (bert-knn build)")
    questions = _questions(args.datastore, args.questions)
    runs = {f"{d}/{b}": _answers(args.datastore, d, b, questions) for d, b in NUMERICS}
    ref = runs["float32/eager"]
    rows = {}
    for name, run in runs.items():
        rel = np.linalg.norm(run["emb"] - ref["emb"], axis=1) / np.linalg.norm(ref["emb"], axis=1)
        rows[name] = {
            "served_as": run["numerics"],
            "top1_agreement_pct": round(100.0 * float(np.mean([a == b for a, b in zip(run["top"], ref["top"], strict=True)])), 2),
            "top1_prob_max_abs_change": float(f"{np.max(np.abs(run['prob'] - ref['prob'])):.3g}"),
            "embedding_rel_l2_mean": float(f"{rel.mean():.3g}"),
            "embedding_rel_l2_max": float(f"{rel.max():.3g}"),
        }
        print(f"{name:16s} {rows[name]}")
    from bertknn.core.format import read_manifest

    man = read_manifest(args.datastore)
    result = {"datastore": {"contexts": man.counts.contexts, "built_as": man.model.numerics, "model": Path(man.model.name).name},
              "questions": len(questions), "reference": "float32/eager", "machine": machine(), "numerics": rows}  # fmt: skip
    print(f"wrote {write_result('numerics', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
