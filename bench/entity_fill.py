"""How the one-pass fill of entity names compares with sequential fill, on a datastore with links::

    python -m bench.entity_fill --datastore runs/bench-entity-cost/ds-20

For each of the datastore's first ``--subjects`` articles and four relation templates, the entity answer's names of
several wordpieces are scored both ways at the query's mask; per question: whether the most probable name is the
same, the rank correlation (Spearman), and over all names the log-probability correlation and the median
|log ratio|.

Then the longest name the fill scores (`MAX_NAME_PIECES`): each question's entity answer (``top_k`` 10) with names
filled up to 8 pieces and up to ``--cap`` pieces: in how many the answers and their order stay the same, how many
of the answers' names are longer than the cap, and the largest p_MLM a name of each length got.
Writes ``bench/results/entity-fill.json`` (docs/decisions/entity-fill.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import machine, write_result
from bertknn.evaluation.lama import fill_template

TEMPLATES = ("[X] was born in [Y] .", "[X] is located in [Y] .", "[X] is a member of [Y] .", "[X] is part of [Y] .")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.entity_fill", description=__doc__.splitlines()[0])
    p.add_argument("--datastore", type=Path, required=True, help="a datastore built with links")
    p.add_argument("--subjects", type=int, default=20)
    p.add_argument("--cap", type=int, default=4, help="the name length compared with 8 (2 to 8)")
    args = p.parse_args(argv)
    if not 2 <= args.cap <= 8:
        p.error("--cap must be 2 to 8")
    from bertknn.service.cache import InMemoryCache
    from bertknn.service.entities import MAX_NAME_PIECES
    from bertknn.service.pipeline import AnswerPipeline
    from bertknn.service.results import Query

    pipe = AnswerPipeline.open(args.datastore, device="cpu", cache=InMemoryCache(max_items=0))
    if pipe.entity_answerer is None:
        p.error(f"{args.datastore} has no links; build one with links (e.g. bench.entity_cost's)")
    ea = pipe.entity_answerer
    lower = pipe.encoder.words.lowercase
    agree, rhos, logs = [], [], []
    for subject in [t for t, _ in pipe.datastore.iter_article_texts()][: args.subjects]:
        for template in TEMPLATES:
            text = fill_template(template, subject, lowercase=lower)
            answer = pipe.predict(Query(text=text, subject=subject, answer="entity", top_k=5))
            names = [ea.pieces(x.token) for x in answer.predictions]
            names = [n for n in names if 1 < len(n) <= MAX_NAME_PIECES]
            if len(names) < 2:
                continue
            one = ea.words.fill_probs(text, names, parallel=True)
            seq = ea.words.fill_probs(text, names, parallel=False)
            agree.append(int(np.argmax(one) == np.argmax(seq)))
            rhos.append(float(np.corrcoef(np.argsort(np.argsort(-one)), np.argsort(np.argsort(-seq)))[0, 1]))
            logs += list(zip(np.log(one), np.log(seq), strict=True))
    caps = compare_caps(pipe, args.subjects, args.cap)
    pipe.close()
    pairs = np.asarray(logs)
    result = {
        "datastore": str(args.datastore.name), "questions": len(agree), "names": len(pairs),
        "same_top_name": sum(agree), "mean_spearman": round(float(np.mean(rhos)), 3),
        "log_p_correlation": round(float(np.corrcoef(pairs[:, 0], pairs[:, 1])[0, 1]), 3),
        "median_abs_log_ratio": round(float(np.median(np.abs(pairs[:, 0] - pairs[:, 1]))), 2), "caps": caps,
        "machine": machine(),
    }  # fmt: skip
    print(f"{result['questions']} questions: the same most probable name in {result['same_top_name']}; mean Spearman "
          f"{result['mean_spearman']}; log p correlation {result['log_p_correlation']}; median |log ratio| "
          f"{result['median_abs_log_ratio']}")  # fmt: skip
    print(f"names filled up to {args.cap} pieces instead of 8, {caps['questions']} entity answers (top_k 10): the "
          f"same answers in the same order in {caps['same_ranking']}, the same first answer in {caps['same_top']}; "
          f"{caps['answers_longer']} of {caps['answers']} answers' names are longer than {args.cap} pieces")  # fmt: skip
    print("largest p_MLM by name length (pieces: p): " + ", ".join(f"{k}: {v:.2g}" for k, v in caps["max_p_mlm"].items()))
    print(f"wrote {write_result('entity-fill', result)}")
    return 0


def compare_caps(pipe: Any, subjects: int, cap: int) -> dict[str, Any]:
    """Every question's entity answer with names filled up to 8 pieces and up to ``cap``, compared."""
    from bertknn.service import entities
    from bertknn.service.results import Query

    lower = pipe.encoder.words.lowercase
    same, same_top, longer, answers = 0, 0, 0, 0
    largest: dict[int, float] = {}
    questions = 0
    default = entities.MAX_NAME_PIECES
    try:
        for subject in [t for t, _ in pipe.datastore.iter_article_texts()][:subjects]:
            for template in TEMPLATES:
                text = fill_template(template, subject, lowercase=lower)
                ranked = {}
                for n in (8, cap):
                    entities.MAX_NAME_PIECES = n
                    ranked[n] = pipe.predict(Query(text=text, subject=subject, answer="entity", top_k=10)).predictions
                questions += 1
                same += [x.token for x in ranked[8]] == [x.token for x in ranked[cap]]
                same_top += [x.token for x in ranked[8][:1]] == [x.token for x in ranked[cap][:1]]
                answers += len(ranked[8])
                longer += sum(x.pieces > cap for x in ranked[8])
                for x in ranked[8]:
                    largest[x.pieces] = max(largest.get(x.pieces, 0.0), x.p_mlm)
    finally:
        entities.MAX_NAME_PIECES = default
    return {"cap": cap, "questions": questions, "same_ranking": same, "same_top": same_top, "answers": answers,
            "answers_longer": longer, "max_p_mlm": {k: float(v) for k, v in sorted(largest.items())}}  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
