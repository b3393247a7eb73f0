"""How the one-pass fill of entity names compares with sequential fill, on a datastore with links::

    python -m bench.entity_fill --datastore runs/bench-entity-cost/ds-20

For each of the datastore's first ``--subjects`` articles and four relation templates, the entity answer's names of
several wordpieces are scored both ways at the query's mask; per question: whether the most probable name is the
same, the rank correlation (Spearman), and over all names the log-probability correlation and the median
|log ratio|. Writes ``bench/results/entity-fill.json`` (docs/decisions/entity-fill.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bench.common import machine, write_result

TEMPLATES = ("[X] was born in [Y] .", "[X] is located in [Y] .", "[X] is a member of [Y] .", "[X] is part of [Y] .")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.entity_fill", description=__doc__.splitlines()[0])
    p.add_argument("--datastore", type=Path, required=True, help="a datastore built with links")
    p.add_argument("--subjects", type=int, default=20)
    args = p.parse_args(argv)
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
            text = template.replace("[X]", subject).replace("[Y]", "[MASK]")
            text = text.lower().replace("[mask]", "[MASK]") if lower else text
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
    pipe.close()
    pairs = np.asarray(logs)
    result = {
        "datastore": str(args.datastore.name), "questions": len(agree), "names": len(pairs),
        "same_top_name": sum(agree), "mean_spearman": round(float(np.mean(rhos)), 3),
        "log_p_correlation": round(float(np.corrcoef(pairs[:, 0], pairs[:, 1])[0, 1]), 3),
        "median_abs_log_ratio": round(float(np.median(np.abs(pairs[:, 0] - pairs[:, 1]))), 2), "machine": machine(),
    }  # fmt: skip
    print(f"{result['questions']} questions: the same most probable name in {result['same_top_name']}; mean Spearman "
          f"{result['mean_spearman']}; log p correlation {result['log_p_correlation']}; median |log ratio| "
          f"{result['median_abs_log_ratio']}")  # fmt: skip
    print(f"wrote {write_result('entity-fill', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
