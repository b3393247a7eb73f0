"""Right answers from real article text: the quality benchmark on real Wikipedia leads, with its failure causes::

    python -m bench.realtext [--model DIR] [--others 300] [--split test]

Corpus: real article text, the Vital Articles lead sections in ``../shared/data/wiki``: the lead of every subject
below, and ``--others`` leads of other articles. Queries: the T-REx facts of the 22 relations in
``../shared/data/lama/TREx`` whose subject is a Vital Article and whose object is written, as a whole word, in that
article's lead (so a perfect reader of the searched article could answer), asked with LAMA's templates, with
the subject named (its own article is searched) and without (BM25 picks the articles). Facts are split into dev
and test by subject (sha256 of the title), so that no subject's article is tuned on and then tested.

For each setting: macro P@1 over relations of BERT-kNN, kNN alone and MLM alone; the ceiling (answer present in
the articles searched); and each BERT-kNN miss by its first cause: retrieval missed the subject's article, the
answer's context is not among the k neighbours, the neighbours had it but were outvoted, the interpolation
turned a right kNN answer wrong, or the answer is the subject's own name (echoed). Writes
``bench/results/realtext.json`` (and ``-MODEL`` for another model than the proxy).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import PROXY_MODEL, RUNS, SHARED, build_datastore, machine, result_name, write_result

LAMA = SHARED / "data" / "lama"
VITAL = SHARED / "data" / "wiki" / "vital_articles.jsonl"
CAUSES = ("retrieval", "not_in_neighbours", "outvoted", "interpolation", "subject_echo")


@dataclass(frozen=True)
class Fact:
    relation: str
    subject: str
    obj: str
    text: str  # the cloze question
    gold: int  # the object's label (one token of the model)
    split: str


def split_of_subject(subject: str) -> str:
    return "dev" if int(hashlib.sha256(subject.encode("utf-8")).hexdigest()[:8], 16) % 2 == 0 else "test"


def load_facts(words: Any, leads: dict[str, str]) -> list[Fact]:
    """The facts whose subject has a lead that writes the object as a whole word, one token for the model."""
    from bertknn.evaluation.lama import ObjectVocabulary, fill_template

    templates = {r["relation"]: r["template"] for r in map(json.loads, (LAMA / "relations.jsonl").open())}
    vocab = ObjectVocabulary(words.tokenizer, words=words)
    out: list[Fact] = []
    for path in sorted((LAMA / "TREx").glob("P*.jsonl")):
        rel = path.stem
        seen: set[tuple[str, str]] = set()
        for line in path.open(encoding="utf-8"):
            row = json.loads(line)
            subject, obj = str(row.get("sub_label", "")).strip(), str(row.get("obj_label", "")).strip()
            lead = leads.get(subject)
            if lead is None or not obj or (subject, obj) in seen or rel not in templates:
                continue
            if not re.search(rf"(?<!\w){re.escape(obj)}(?!\w)", lead, flags=re.IGNORECASE):
                continue
            piece = vocab.wordpiece(obj)
            if piece is None:
                continue
            seen.add((subject, obj))
            text = fill_template(templates[rel], subject, lowercase=vocab.lowercase)
            out.append(Fact(rel, subject, obj, text, piece[1], split_of_subject(subject)))
    return out


def subject_words(words: Any, subject: str) -> set[int]:
    """The labels of the subject's own words (an answer that is one of them echoes the question)."""
    ids = {words.token_word(t) for w in re.findall(r"\w+", subject) for t in words.pieces_of(w)}
    return {i for i in ids if i >= 0}


def score(pipeline: Any, facts: list[Fact], *, with_subject: bool, batch: int = 32) -> dict[str, Any]:
    """Macro P@1 of BERT-kNN, kNN and MLM, the ceiling, and the misses by cause."""
    from bertknn.service.results import Query

    words = pipeline.encoder.words
    non_words = words.vocab.non_words
    per_rel: dict[str, Counter[str]] = defaultdict(Counter)
    causes: Counter[str] = Counter()
    for start in range(0, len(facts), batch):
        chunk = facts[start : start + batch]
        queries = [Query(text=f.text, subject=f.subject if with_subject else None, top_k=1, return_contexts=False)
                   for f in chunk]  # fmt: skip
        for f, ans in zip(chunk, pipeline.predict_batch(queries, with_distributions=True), strict=True):
            d = ans.distributions
            assert d is not None and d.p_knn is not None and d.p is not None
            top = {name: int(np.argmax(np.where(non_words, -1.0, dist))) for name, dist in
                   (("bert_knn", d.p), ("knn", d.p_knn), ("mlm", d.p_mlm))}  # fmt: skip
            c = per_rel[f.relation]
            c["n"] += 1
            for name, t in top.items():
                c[name] += int(t == f.gold)
            searched = {a.title for a in ans.articles}
            c["ceiling"] += int(f.subject in searched)
            if top["bert_knn"] == f.gold:
                continue
            if f.subject not in searched:
                cause = "retrieval"
            elif top["bert_knn"] in subject_words(words, f.subject):
                cause = "subject_echo"
            elif d.p_knn[f.gold] <= 0:
                cause = "not_in_neighbours"
            elif top["knn"] != f.gold:
                cause = "outvoted"
            else:
                cause = "interpolation"
            causes[cause] += 1
    rels = sorted(per_rel)

    def macro(key: str) -> float:
        return round(100.0 * float(np.mean([per_rel[r][key] / per_rel[r]["n"] for r in rels])), 1) if rels else 0.0

    misses = sum(causes.values())
    return {
        "facts": sum(per_rel[r]["n"] for r in rels), "relations": len(rels),
        "p@1": {"bert_knn": macro("bert_knn"), "knn": macro("knn"), "mlm": macro("mlm")},
        "ceiling": macro("ceiling"),
        "misses": misses,
        "miss_causes": {k: round(100.0 * causes[k] / misses, 1) if misses else 0.0 for k in CAUSES},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.realtext", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(PROXY_MODEL))
    p.add_argument("--others", type=int, default=300, help="leads of other articles added to the corpus")
    p.add_argument("--split", choices=["dev", "test", "all"], default="all", help="facts scored (default: both "
                   "splits, each reported)")  # fmt: skip
    p.add_argument("--work", type=Path, default=RUNS / "bench-realtext")
    args = p.parse_args(argv)
    if args.others < 0:
        p.error("--others must be at least 0")
    from transformers import AutoTokenizer

    from bertknn.core.wordmodel import WordModel
    from bertknn.service.pipeline import AnswerPipeline

    rows = [json.loads(line) for line in VITAL.open(encoding="utf-8")]
    leads = {r["title"]: r["text"] for r in rows}
    facts = load_facts(WordModel(AutoTokenizer.from_pretrained(args.model)), leads)
    subjects = {f.subject for f in facts}
    others = [r for r in rows if r["title"] not in subjects][: args.others]
    args.work.mkdir(parents=True, exist_ok=True)
    corpus = args.work / f"corpus-{len(subjects)}-{args.others}.jsonl"
    if not corpus.is_file():
        chosen = [r for r in rows if r["title"] in subjects] + others
        corpus.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in chosen), encoding="utf-8")
    ds = build_datastore([corpus], args.work / f"ds-{Path(args.model).name}-{len(subjects)}-{args.others}", args.model)
    pipeline = AnswerPipeline.open(ds, device="cpu")
    pipeline.encoder.set_backend("auto")
    splits = ["dev", "test"] if args.split == "all" else [args.split]
    result: dict[str, Any] = {"model": Path(args.model).name, "machine": machine(), "corpus": {
        "subject_leads": len(subjects), "other_leads": len(others),
        "contexts": pipeline.datastore.manifest.counts.contexts}, "splits": {}}  # fmt: skip
    for split in splits:
        chosen = [f for f in facts if f.split == split]
        result["splits"][split] = {
            "with_subject": score(pipeline, chosen, with_subject=True),
            "without_subject": score(pipeline, chosen, with_subject=False),
        }
        for setting, r in result["splits"][split].items():
            print(f"{split:4s} {setting:15s} facts {r['facts']:4d}  BERT-kNN {r['p@1']['bert_knn']:5.1f}  kNN "
                  f"{r['p@1']['knn']:5.1f}  MLM {r['p@1']['mlm']:5.1f}  ceiling {r['ceiling']:5.1f}  misses: "
                  + ", ".join(f"{k} {v:.0f}%" for k, v in r["miss_causes"].items()), flush=True)  # fmt: skip
    path = write_result(result_name("realtext", args.model), result)
    print(f"wrote {path}")
    pipeline.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
