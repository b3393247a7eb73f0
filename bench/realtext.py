"""Right answers from real article text: the quality benchmark on real Wikipedia leads, with its failure causes::

    python -m bench.realtext [--model DIR] [--others 300] [--split test] [--probe heldout] [--baseline REV]

Corpus: real article text, the Vital Articles lead sections in ``../shared/data/wiki``: the lead of every subject
below, and ``--others`` leads of other articles. Queries: the T-REx facts of the 22 relations in
``../shared/data/lama/TREx`` whose subject is a Vital Article and whose object is written, as a whole word, in that
article's lead (so a perfect reader of the searched article could answer), asked with LAMA's templates, with
the subject named (its own article is searched) and without (BM25 picks the articles). Facts are split into dev
and test by subject (sha256 of the title), so that no subject's article is tuned on and then tested.
``--probe heldout`` asks the T-REx relations of ``TREx_facts_all41`` that are not among those 22 instead (an
independent check, never tuned on: every fact is scored, as split ``heldout``), over their own subjects' leads.
``--datastore DIR`` scores an existing datastore instead, e.g. full articles built from a real Wikipedia dump: the
facts are those whose subject is one of its articles and whose object is written in that article's stored text
(split ``datastore``; facts of ``--probe``'s relations).

Each setting is scored in one run with the paper's method (``mlm_prior`` 0, ``article_sharpness`` 0), then with
each change on top: the neighbours' vote weighted by p_MLM (`bertknn.service.interpolate.weigh_vote`), then the
neighbours of lower-ranked articles counting less (`article_offsets`; the service's defaults). Each vote's BERT-kNN
P@1 is compared with the paper's on the same facts: the difference and its 95 % interval (a paired bootstrap over
facts within relations).

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
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import (
    PROXY_MODEL,
    RUNS,
    SHARED,
    baseline_or_exit,
    build_datastore,
    machine,
    result_name,
    run_from,
    write_result,
)
from bertknn.service.interpolate import DEFAULT_ARTICLE_SHARPNESS, DEFAULT_MLM_PRIOR

LAMA = SHARED / "data" / "lama"
VITAL = SHARED / "data" / "wiki" / "vital_articles.jsonl"
CAUSES = ("retrieval", "not_in_neighbours", "outvoted", "interpolation", "subject_echo")


@dataclass(frozen=True)
class Fact:
    relation: str
    subject: str
    obj: str
    text: str  # the cloze question
    gold: int  # the object's label (one token of the model); -1 for a whole-word answer of several pieces
    split: str
    word: str = ""  # the answer as the model's words spell it (lower-cased for an uncased model)


def split_of_subject(subject: str) -> str:
    return "dev" if int(hashlib.sha256(subject.encode("utf-8")).hexdigest()[:8], 16) % 2 == 0 else "test"


def probe_files(probe: str) -> list[Path]:
    """The relation files asked: the 22 of ``TREx`` (tuned on), or the held-out ones of ``TREx_facts_all41``."""
    tuned = sorted((LAMA / "TREx").glob("P*.jsonl"))
    if probe == "trex":
        return tuned
    names = {f.name for f in tuned}
    return [f for f in sorted((LAMA / "TREx_facts_all41").glob("P*.jsonl")) if f.name not in names]


def load_facts(
    words: Any, leads: dict[str, str], files: list[Path] | None = None, split: str | None = None, *,
    whole_words: bool = False,
) -> list[Fact]:  # fmt: skip
    """The facts whose subject has a lead that writes the object as a whole word, one token for the model (or,
    ``whole_words``, one word of any number of tokens). ``split``: every fact's split (default: dev or test by
    subject)."""
    from bertknn.evaluation.lama import ObjectVocabulary, fill_template

    templates = {r["relation"]: r["template"] for r in map(json.loads, (LAMA / "relations.jsonl").open())}
    vocab = ObjectVocabulary(words.tokenizer, words=words)
    out: list[Fact] = []
    for path in files if files is not None else probe_files("trex"):
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
            one_word = whole_words and re.fullmatch(r"\w+", obj) is not None
            if piece is None and not one_word:
                continue
            seen.add((subject, obj))
            text = fill_template(templates[rel], subject, lowercase=vocab.lowercase)
            word = obj.lower() if vocab.lowercase else obj
            gold = piece[1] if piece is not None else -1
            out.append(Fact(rel, subject, obj, text, gold, split or split_of_subject(subject), word))
    return out


def subject_words(words: Any, subject: str) -> set[int]:
    """The labels of the subject's own words (an answer that is one of them echoes the question)."""
    ids = {words.token_word(t) for w in re.findall(r"\w+", subject) for t in words.pieces_of(w)}
    return {i for i in ids if i >= 0}


def read_answer(pipeline: Any, f: Fact, d: Any) -> tuple[dict[str, str], str, bool, bool]:
    """The top answer's text under p, p_kNN and p_MLM; the gold's text; whether a neighbour voted for the gold;
    whether the top answer is one of the subject's own words. Single-token and whole-word distributions alike."""
    from bertknn.service.words import WordDistributions

    dists = (("bert_knn", d.p), ("knn", d.p_knn), ("mlm", d.p_mlm))
    if isinstance(d, WordDistributions):
        texts = [w.text for w in d.words]
        top = {n: texts[int(np.argmax(x))] if len(texts) and x.max() > 0 else "" for n, x in dists}
        i = d.index(f.word)
        voted = i is not None and d.p_knn[i] > 0
        echo = top["bert_knn"].lower() in {w.lower() for w in re.findall(r"\w+", f.subject)}
        return top, f.word, voted, echo
    non_words = pipeline.encoder.words.vocab.non_words
    ids = {n: int(np.argmax(np.where(non_words, -1.0, x))) for n, x in dists}
    echo = ids["bert_knn"] in subject_words(pipeline.encoder.words, f.subject)
    top = {n: pipeline.token(i) for n, i in ids.items()}
    return top, pipeline.token(f.gold), bool(d.p_knn[f.gold] > 0), echo


def miss_cause(found: bool, echo: bool, voted: bool, knn_right: bool) -> str:
    """A BERT-kNN miss's first cause (one of `CAUSES`), checked in this order: retrieval did not search the
    subject's article; the answer is one of the subject's own words; no neighbour carried the gold word; the
    neighbours' vote (kNN alone) was wrong too; else the interpolation turned kNN's right answer wrong."""
    if not found:
        return "retrieval"
    if echo:
        return "subject_echo"
    if not voted:
        return "not_in_neighbours"
    return "interpolation" if knn_right else "outvoted"


def score(pipeline: Any, facts: list[Fact], *, with_subject: bool, knobs: dict[str, float], batch: int = 32) -> dict[str, Any]:
    """Macro P@1 of BERT-kNN, kNN and MLM, the ceiling, and the misses by cause."""
    from bertknn.service.results import Query

    per_rel: dict[str, Counter[str]] = defaultdict(Counter)
    causes: Counter[str] = Counter()
    hits: list[int] = []  # BERT-kNN right (1) or not, per fact in order: for the paired comparison of two votes
    for start in range(0, len(facts), batch):
        chunk = facts[start : start + batch]
        queries = [Query(text=f.text, subject=f.subject if with_subject else None, top_k=1, return_contexts=False,
                         **knobs) for f in chunk]  # type: ignore[arg-type]  # fmt: skip
        for f, ans in zip(chunk, pipeline.predict_batch(queries, with_distributions=True), strict=True):
            d = ans.distributions
            assert d is not None and d.p_knn is not None and d.p is not None
            top, gold, voted, echo = read_answer(pipeline, f, d)
            c = per_rel[f.relation]
            c["n"] += 1
            for name, t in top.items():
                c[name] += int(t == gold)
            searched = {a.title for a in ans.articles}
            c["ceiling"] += int(f.subject in searched)
            hits.append(int(top["bert_knn"] == gold))
            if top["bert_knn"] == gold:
                continue
            causes[miss_cause(f.subject in searched, echo, voted, top["knn"] == gold)] += 1
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
        "hits": hits,
    }  # fmt: skip


def paired_interval(
    relations: list[str], a: list[int], b: list[int], *, resamples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """Macro P@1 of ``b`` minus that of ``a`` on the same facts, and its 95 % interval by a paired bootstrap:
    facts resampled with replacement within each relation, both votes read at the same draws."""
    rng = np.random.default_rng(seed)
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    groups = [np.flatnonzero(np.asarray(relations) == r) for r in sorted(set(relations))]
    diff = 100.0 * float(np.mean([y[g].mean() - x[g].mean() for g in groups]))
    draws = np.empty(resamples)
    for i in range(resamples):
        picks = [rng.choice(g, len(g)) for g in groups]
        draws[i] = 100.0 * np.mean([y[d].mean() - x[d].mean() for d in picks])
    lo, hi = np.percentile(draws, [2.5, 97.5])
    return round(diff, 1), round(float(lo), 1), round(float(hi), 1)


# the settings scored, each change on top of the one before: the paper's vote, then the vote weighted by p_MLM,
# then (the service's defaults) lower-ranked articles counting less
VOTES = {
    "paper": {"mlm_prior": 0.0, "article_sharpness": 0.0},
    "weighted_vote": {"mlm_prior": DEFAULT_MLM_PRIOR, "article_sharpness": 0.0},
    "default": {"mlm_prior": DEFAULT_MLM_PRIOR, "article_sharpness": DEFAULT_ARTICLE_SHARPNESS},
}


# --sweep: the service's other knob at its default, this one varied
SWEEP = [{"mlm_prior": b, "article_sharpness": DEFAULT_ARTICLE_SHARPNESS} for b in (0.0, 0.05, 0.1, 0.15, 0.25, 0.5)] + [
    {"mlm_prior": DEFAULT_MLM_PRIOR, "article_sharpness": s} for s in (0.0, 5.0, 20.0)
]


def open_datastore(args: argparse.Namespace) -> tuple[Any, list[Fact], dict[str, int]]:
    """``--datastore``: its pipeline, and the facts its own articles' text writes (split ``datastore``)."""
    from bertknn.service.pipeline import AnswerPipeline

    pipeline = AnswerPipeline.open(args.datastore, device="cpu")
    pipeline.local_encoder.set_backend("auto")
    texts = dict(pipeline.datastore.iter_article_texts())
    whole = pipeline.datastore.whole_words
    facts = load_facts(pipeline.encoder.words, texts, probe_files(args.probe), "datastore", whole_words=whole)
    sizes = {"articles": len(texts), "subjects": len({f.subject for f in facts}),
             "contexts": pipeline.datastore.manifest.counts.contexts}  # fmt: skip
    return pipeline, facts, sizes


def open_benchmark(args: argparse.Namespace) -> tuple[Any, list[Fact], dict[str, int]]:
    """The facts of ``--probe``, and a pipeline over their subjects' leads plus ``--others`` other leads."""
    from transformers import AutoTokenizer

    from bertknn.core.wordmodel import WordModel
    from bertknn.service.pipeline import AnswerPipeline

    if args.datastore is not None:
        return open_datastore(args)

    rows = [json.loads(line) for line in VITAL.open(encoding="utf-8")]
    leads = {r["title"]: r["text"] for r in rows}
    words = WordModel(AutoTokenizer.from_pretrained(args.model))
    whole = args.answers == "whole-word"
    split = "heldout" if args.probe == "heldout" else None
    facts = load_facts(words, leads, probe_files(args.probe), split, whole_words=whole)
    subjects = {f.subject for f in facts}
    others = [r for r in rows if r["title"] not in subjects][: args.others]
    args.work.mkdir(parents=True, exist_ok=True)
    name = f"{len(subjects)}-{args.others}" + ("-heldout" if args.probe == "heldout" else "")
    corpus = args.work / f"corpus-{name}.jsonl"
    name += "-whole-word" if whole else ""
    if not corpus.is_file():
        chosen = [r for r in rows if r["title"] in subjects] + others
        corpus.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in chosen), encoding="utf-8")
    ds = build_datastore([corpus], args.work / f"ds-{Path(args.model).name}-{name}", args.model,
                         targets=args.answers)
    pipeline = AnswerPipeline.open(ds, device="cpu")
    pipeline.local_encoder.set_backend("auto")
    sizes = {"subject_leads": len(subjects), "other_leads": len(others),
             "contexts": pipeline.datastore.manifest.counts.contexts}  # fmt: skip
    return pipeline, facts, sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.realtext", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(PROXY_MODEL))
    p.add_argument("--others", type=int, default=300, help="leads of other articles added to the corpus")
    p.add_argument("--split", choices=["dev", "test", "all"], default="all", help="facts scored (default: both "
                   "splits, each reported)")  # fmt: skip
    p.add_argument("--probe", choices=["trex", "heldout"], default="trex", help="trex: the 22 relations (dev and "
                   "test); heldout: the other T-REx relations, an independent check")  # fmt: skip
    p.add_argument("--answers", choices=["single-piece", "whole-word"], default="single-piece", help="whole-word: "
                   "a datastore of whole words (any number of tokens), and the facts whose object is one such word")  # fmt: skip
    p.add_argument("--sweep", action="store_true", help="also score each mlm_prior and article_sharpness of the "
                   "sweep (how the defaults were chosen: docs/decisions/mlm-weighted-vote.md)")  # fmt: skip
    p.add_argument("--datastore", type=Path, help="score this datastore (e.g. a real dump's full articles) "
                   "instead of building the leads' one")  # fmt: skip
    p.add_argument("--work", type=Path, default=RUNS / "bench-realtext")
    p.add_argument("--baseline", help="a commit whose run of this benchmark with the same options (its own datastore, "
                   "from a git worktree under runs/) is compared with this run's, row by row")  # fmt: skip
    return p


def baseline_argv(argv: list[str]) -> list[str]:
    """This run's options for the baseline's run: without ``--baseline`` and ``--work`` (it builds its own)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--baseline", "--work"):
            skip = True
        elif not arg.startswith(("--baseline=", "--work=")):
            out.append(arg)
    return out


def same_rows(ours: dict[str, Any], theirs: dict[str, Any], rev: str) -> dict[str, Any]:
    """This run's rows (split, setting) against another run's: how many are the same in every figure, which differ
    (with BERT-kNN's P@1 in each) and which that run lacks."""
    rows = [(split, setting) for split, table in ours.items() for setting in table]
    missing = [f"{s} {k}" for s, k in rows if k not in theirs.get(s, {})]
    differing = [
        f"{s} {k}: BERT-kNN {ours[s][k]['p@1']['bert_knn']} against {theirs[s][k]['p@1']['bert_knn']}"
        for s, k in rows if k in theirs.get(s, {}) and ours[s][k] != theirs[s][k]
    ]  # fmt: skip
    same = len(rows) - len(missing) - len(differing)
    return {"commit": rev, "rows": len(rows), "identical": same, "differing": differing, "missing": missing}


def score_split(pipeline: Any, facts: list[Fact], votes: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Every vote, with and without the subject, on one split's facts; each compared with the paper's vote."""
    rows = {
        f"{setting}/{vote}": score(pipeline, facts, with_subject=setting == "with_subject", knobs=knobs)
        for setting in ("with_subject", "without_subject") for vote, knobs in votes.items()
    }  # fmt: skip
    rels = [f.relation for f in facts]
    for setting, r in rows.items():
        paper = rows[setting.split("/")[0] + "/paper"]
        r["vs_paper"] = dict(zip(("diff", "low", "high"), paired_interval(rels, paper["hits"], r["hits"]), strict=True))
    for r in rows.values():  # (the per-fact hits served the comparison; the report keeps its result)
        r.pop("hits")
    return rows


def print_row(split: str, setting: str, r: dict[str, Any]) -> None:
    print(f"{split:7s} {setting:50s} facts {r['facts']:4d}  BERT-kNN {r['p@1']['bert_knn']:5.1f}  kNN "
          f"{r['p@1']['knn']:5.1f}  MLM {r['p@1']['mlm']:5.1f}  ceiling {r['ceiling']:5.1f}  misses: "
          + ", ".join(f"{k} {v:.0f}%" for k, v in r["miss_causes"].items())
          + "  BERT-kNN vs the paper's vote: {diff:+.1f} [{low:+.1f}, {high:+.1f}]".format(**r["vs_paper"]),
          flush=True)  # fmt: skip


def result_file(args: argparse.Namespace) -> str:
    name = "realtext" + ("-heldout" if args.probe == "heldout" else "") + ("-datastore" if args.datastore else "")
    name += "-whole-word" if args.answers == "whole-word" and args.datastore is None else ""
    return result_name(name, args.model)


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.datastore is not None and not (args.datastore / "manifest.json").is_file():
        p.error(f"--datastore {args.datastore}: no datastore there (no manifest.json)")
    if args.others < 0:
        p.error("--others must be at least 0")
    if args.baseline:
        baseline_or_exit(p, args.baseline)  # (before this run's minutes, not after them)
    pipeline, facts, sizes = open_benchmark(args)
    if args.datastore is not None:
        splits = ["datastore"]
    elif args.probe == "heldout":
        splits = ["heldout"]
    else:
        splits = ["dev", "test"] if args.split == "all" else [args.split]
    votes = dict(VOTES)
    if args.sweep:
        votes.update({f"mlm_prior={k['mlm_prior']:g},article_sharpness={k['article_sharpness']:g}": k for k in SWEEP})
    result: dict[str, Any] = {"model": Path(args.model).name, "machine": machine(), "probe": args.probe,
                              "corpus": sizes, "votes": votes, "splits": {}}  # fmt: skip
    if args.datastore is not None:
        result["datastore"] = str(args.datastore)
    for split in splits:
        result["splits"][split] = score_split(pipeline, [f for f in facts if f.split == split], votes)
        for setting, r in result["splits"][split].items():
            print_row(split, setting, r)
    if args.baseline:
        theirs = run_from(args.baseline, "bench.realtext", baseline_argv(sys.argv[1:] if argv is None else argv),
                          result_file(args))  # fmt: skip
        result["vs_baseline"] = same_rows(result["splits"], theirs["splits"], args.baseline)
        got = result["vs_baseline"]
        print(f"against {args.baseline}: {got['identical']} of {got['rows']} rows the same in every figure; "
              f"differing: {got['differing'] or 'none'}; missing there: {got['missing'] or 'none'}")
    print(f"wrote {write_result(result_file(args), result)}")
    pipeline.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
