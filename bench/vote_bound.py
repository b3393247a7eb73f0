"""How far a better vote can take BERT-kNN on real article text: the best linear vote, solved exactly::

    python -m bench.vote_bound [--model DIR] [--others 300] [--time-limit 120] [--probe heldout]

The facts, corpus and splits are `bench.realtext`'s (the same datastore). For each fact, asked with the subject
named (its own article searched) and without it (the articles the service's ranker picks), every word that the
service's vote, the paper's vote or p_MLM ranks among the top ``--candidates`` is a candidate, described by what
one forward pass and the searched articles' stored contexts give (`FEATURES`): the neighbours' vote at two
temperatures and weighted by p_MLM, p_MLM and its rank, how near the word's nearest contexts lie, how many
contexts it has, whether it is one of the subject's words, how many of the question's words its sentence shares;
and, for the best found only, two that fit this benchmark and no general rule (`BENCHMARK_ONLY`): whether the word is
written in the article's first sentence, and whether it is a number (no object of these relations is).

A vote here is a linear score over those features; the answer is the candidate that scores highest. Two figures:

- **the best linear vote** (`best_vote`): the highest macro P@1 any weights give on a split's facts, tuned on those
  very facts: a mixed-integer program (one binary per fact: "the gold outscores every other candidate"), solved
  by HiGHS. Where the solver stops at ``--time-limit``, the vote it found and its upper bound are both reported.
- **fitted on dev**: the weights that maximise the dev facts' likelihood (a softmax over each fact's candidates),
  scored on test: what a learned vote honestly gives.

The service's default vote is scored from the same candidates first, as a check: it must give `bench.realtext`'s
figures. Writes ``bench/results/vote_bound.json`` (``vote_bound-heldout.json`` with ``--probe heldout``; ``-MODEL``
for another model than the proxy).
"""

from __future__ import annotations

import argparse
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import PROXY_MODEL, RUNS, machine, result_name, write_result
from bench.realtext import Fact, open_benchmark
from bertknn.builder.targets import load_stopwords
from bertknn.core.text import MASK_RE
from bertknn.service.interpolate import (
    DEFAULT_ARTICLE_SHARPNESS,
    DEFAULT_MLM_PRIOR,
    article_offsets,
    interpolate,
    knn_sparse,
    weigh_vote,
)

FEATURES = (
    "log_p_knn", "log_p_knn_2t", "log_p_knn_weighted", "log_p_mlm", "log_mlm_rank", "nearest", "nearest_3",
    "cosine", "log_contexts", "subject_word", "shared_words",
)  # fmt: skip
BENCHMARK_ONLY = ("first_sentence", "number")
ALL_FEATURES = FEATURES + BENCHMARK_ONLY
_WORD = re.compile(r"\w+")


@dataclass(frozen=True)
class Candidates:
    """One question's candidate answers: token ids, their features (rows in `ALL_FEATURES` order), the index of
    the service's default answer among them and its interpolated probability (compared with the service's)."""

    fact: Fact
    words: np.ndarray
    features: np.ndarray
    default: int
    default_p: float = 0.0


@dataclass(frozen=True)
class Searched:
    """The stored contexts of the articles a question searched: float32 vectors, word labels, whether each row's
    sentence is its article's first, its text, and its article (index into the searched articles)."""

    vectors: np.ndarray
    labels: np.ndarray
    first_sentence: np.ndarray
    texts: list[str]
    article: np.ndarray


def searched_rows(datastore: Any, titles: list[str]) -> Searched:
    """`Searched` for these articles: their word rows as the service's restricted kNN reads them
    (`Datastore.row_slices`), and each row's sentence (`Datastore.contexts`)."""
    found = [(a, s) for a, s in enumerate(datastore.row_slices(titles)) if s is not None]
    if not found:
        raise ValueError(f"none of the searched articles {titles} has stored contexts")
    payload = np.concatenate([s.taken() for _, s in found])
    if datastore.codec is None:
        vectors = payload.astype(np.float32)
    else:
        from bertknn.core.format.codec import decode

        vectors = decode(datastore.codec, payload)
    ids = np.concatenate([s.ids for _, s in found])
    texts = [ref.sentence for ref in datastore.contexts(ids.tolist())]
    first = {titles[a]: datastore.article_sentences(titles[a])[0] for a, _ in found}
    article = np.repeat([a for a, _ in found], [len(s.ids) for _, s in found])
    in_first = np.array([t == first[titles[a]] for t, a in zip(texts, article, strict=True)])
    return Searched(vectors, np.concatenate([s.labels for _, s in found]), in_first, texts, article)


@dataclass(frozen=True)
class Question:
    """What one asked question gives: the [MASK] embedding and p_MLM (one forward pass), the searched articles'
    rows and retrieval scores, its subject's words and its other content words."""

    fact: Fact
    embedding: np.ndarray
    p_mlm: np.ndarray
    rows: Searched
    scores: list[float | None]
    subject: set[str]
    words: set[str]


def content_words(text: str, stopwords: frozenset[str]) -> set[str]:
    return {w for w in _WORD.findall(text.lower()) if w not in stopwords}


def votes(
    question: Question, k: int, temperature_of: Any
) -> tuple[dict[str, dict[int, float]], np.ndarray, float]:
    """The neighbours' votes (word -> mass): the paper's, the paper's at twice the temperature, and the
    service's default (weighted by p_MLM, lower-ranked articles counting less); with every row's distance and
    the temperature."""
    rows = question.rows
    d = ((rows.vectors - question.embedding) ** 2).sum(axis=1)
    near = np.argsort(d, kind="stable")[:k]
    dn, labels = d[near], rows.labels[near]
    temperature = float(temperature_of(dn))
    offsets = article_offsets(rows.article[near], question.scores, DEFAULT_ARTICLE_SHARPNESS)
    out: dict[str, dict[int, float]] = {}
    for name, t, off in (
        ("paper", temperature, None),
        ("paper_2t", 2 * temperature, None),
        ("default", temperature, offsets),
    ):
        ids, probs = knn_sparse(dn, labels, t, off)
        if name == "default":
            probs = weigh_vote(probs, question.p_mlm[ids], DEFAULT_MLM_PRIOR)
        out[name] = dict(zip(ids.tolist(), probs.tolist(), strict=True))
    return out, d, temperature


def word_features(
    word: int, text: str, question: Question, vote: dict[str, dict[int, float]], d: np.ndarray, cos: np.ndarray,
    scale: float, stopwords: frozenset[str],
) -> list[float]:  # fmt: skip
    """One candidate's features, in `ALL_FEATURES` order. ``d``, ``cos``: the question's squared L2 distance and
    cosine to every searched row; ``scale``: the temperature, so that distances read in its units."""
    rows, p_mlm = question.rows, question.p_mlm
    mine = np.flatnonzero(rows.labels == word)
    log_votes = [float(np.log(vote[v].get(word, 0.0) + 1e-6)) for v in ("paper", "paper_2t", "default")]
    rank = float(np.log1p(np.count_nonzero(p_mlm > p_mlm[word])))
    nearest = nearest_3 = 10.0
    cosine = shared = first = 0.0
    if len(mine):
        near = np.sort(d[mine])
        nearest, nearest_3 = (near[0] - d.min()) / scale, (near[:3].mean() - d.min()) / scale
        best = int(mine[np.argmin(d[mine])])
        shared = float(len(question.words & content_words(rows.texts[best], stopwords)))
        first = float(bool(rows.first_sentence[mine].any()))
        cosine = float(cos[mine].max())
    return [
        *log_votes, float(np.log(p_mlm[word] + 1e-9)), -rank, -nearest, -nearest_3, cosine,
        float(np.log1p(len(mine))), float(text.lower() in question.subject), shared, first, float(text.isdigit()),
    ]  # fmt: skip


def candidates(
    question: Question, *, k: int, lam: float, top: int, temperature_of: Any, vocab: list[str], non_words: np.ndarray,
    stopwords: frozenset[str],
) -> Candidates:  # fmt: skip
    """The question's candidates: every word a neighbour carries (what any vote can choose), and the ``top`` most
    probable words of p_MLM; the service's default answer first."""
    vote, d, temperature = votes(question, k, temperature_of)
    voted = np.fromiter(vote["paper"], np.int64, len(vote["paper"]))
    p_knn = np.zeros(len(question.p_mlm), np.float32)
    p_knn[np.fromiter(vote["default"], np.int64, len(vote["default"]))] = list(vote["default"].values())
    p = np.where(non_words, -1.0, interpolate(p_knn, question.p_mlm, lam))
    mlm = np.where(non_words, -1.0, question.p_mlm)
    top_mlm = np.argsort(-mlm, kind="stable")[:top]
    words = [int(np.argmax(p)), *(int(i) for i in voted if not non_words[i]), *(int(i) for i in top_mlm)]
    words = list(dict.fromkeys(words))
    norms = np.linalg.norm(question.rows.vectors, axis=1) * np.linalg.norm(question.embedding)
    cos = question.rows.vectors @ question.embedding / np.maximum(norms, 1e-12)
    feats = [word_features(w, vocab[w], question, vote, d, cos, temperature, stopwords) for w in words]
    return Candidates(question.fact, np.asarray(words, np.int64), np.asarray(feats, np.float64), 0, float(p[words[0]]))


def macro_p1(cands: list[Candidates], weights: np.ndarray | None = None) -> float:
    """Macro P@1 over relations of the candidates that ``weights`` score highest (None: the service's default)."""
    per: dict[str, list[bool]] = defaultdict(list)
    for c in cands:
        pick = c.default if weights is None else int(np.argmax(c.features[:, : len(weights)] @ weights))
        per[c.fact.relation].append(int(c.words[pick]) == c.fact.gold)
    return round(100.0 * float(np.mean([np.mean(v) for v in per.values()])), 1) if per else 0.0


@dataclass(frozen=True)
class BestVote:
    """The best macro P@1 of any linear vote over some features on some facts (`best_vote`)."""

    p1: float  # the vote found, re-scored with `macro_p1`
    upper_bound: float  # no vote of this kind scores above it (the solver's bound; equal to p1 when proven optimal)
    optimal: bool  # the solver proved it (else it stopped at its time limit)
    weights: np.ndarray


def best_vote(cands: list[Candidates], n_features: int, *, margin: float = 1e-4, time_limit: float = 120.0) -> BestVote:
    """The highest macro P@1 of any linear vote over the first ``n_features`` features, as a mixed-integer program
    (HiGHS, through ``scipy.optimize.milp``): a weight per feature in [-1, 1], a binary per fact that may be 1 only
    where the gold outscores every other candidate, by ``margin`` (a tie counts where the gold comes first, as
    `macro_p1` breaks it), each fact weighted 1 / its relation's facts. Facts whose gold is no candidate cannot
    count. Exact for the votes that win by at least ``margin`` at that scale; ``time_limit`` seconds then the
    solver's bound (``upper_bound``) says how far the vote found may be from the best."""
    from scipy.optimize import Bounds, LinearConstraint, milp

    rel_size: dict[str, int] = defaultdict(int)
    for c in cands:
        rel_size[c.fact.relation] += 1
    winnable = [(i, c, int(np.flatnonzero(c.words == c.fact.gold)[0])) for i, c in enumerate(cands)
                if c.fact.gold in c.words]  # fmt: skip
    n_fact = len(winnable)
    rows, lows = [], []
    for j, (_, c, g) in enumerate(winnable):
        x = c.features[:, :n_features]
        for other in range(len(x)):
            if other == g:
                continue
            diff = x[g] - x[other]  # w . diff >= need, unless the fact's binary is 0
            need = margin if other < g else 0.0
            big = float(np.abs(diff).sum()) + need  # |w . diff| <= sum |diff| with |w| <= 1
            row = np.zeros(n_features + n_fact)
            row[:n_features], row[n_features + j] = diff, -big
            rows.append(row)
            lows.append(need - big)
    gain = np.array([100.0 / (len(rel_size) * rel_size[c.fact.relation]) for _, c, _ in winnable])
    objective = np.concatenate([np.zeros(n_features), -gain])
    integrality = np.concatenate([np.zeros(n_features), np.ones(n_fact)])
    bounds = Bounds(np.concatenate([-np.ones(n_features), np.zeros(n_fact)]), np.ones(n_features + n_fact))
    constraints = [LinearConstraint(np.array(rows), np.array(lows), np.inf)] if rows else []
    res = milp(objective, integrality=integrality, bounds=bounds, constraints=constraints,
               options={"time_limit": time_limit, "disp": False})  # fmt: skip
    if res.x is None:
        raise RuntimeError(f"the vote's mixed-integer program found no solution: {res.message}")
    w = np.asarray(res.x[:n_features])
    bound = -float(getattr(res, "mip_dual_bound", res.fun))
    upper = math.ceil(min(100.0, bound) * 10 - 1e-6) / 10  # rounded up: still a bound
    return BestVote(macro_p1(cands, w), upper, res.status == 0, w)


def fit_likelihood(cands: list[Candidates], n_features: int, reg: float = 0.0) -> np.ndarray:
    """The weights that maximise the gold's softmax likelihood among each fact's candidates (facts whose gold is
    no candidate left out), with an L2 penalty ``reg``."""
    from scipy.optimize import minimize

    data = []
    for c in cands:
        gold = np.flatnonzero(c.words == c.fact.gold)
        if len(gold):
            data.append((c.features[:, :n_features], int(gold[0])))

    def loss(w: np.ndarray) -> float:
        total = 0.0
        for x, g in data:
            s = x @ w
            total += float(np.logaddexp.reduce(s) - s[g])
        return total / max(1, len(data)) + reg * float(w @ w)

    start = np.zeros(n_features)
    start[FEATURES.index("log_p_knn_weighted")] = 1.0
    return np.asarray(minimize(loss, start, method="L-BFGS-B").x)


def ask(pipeline: Any, fact: Fact, *, with_subject: bool, stopwords: frozenset[str]) -> Question:
    """One question as the service asks it: its forward pass, and the articles its retrieval picks (their rows)."""
    from bertknn.service.results import Query

    query = Query(
        text=fact.text, subject=fact.subject if with_subject else None, top_k=1, return_contexts=False
    )
    hits, _ = pipeline.articles.retrieve(query)
    enc = pipeline.encoder
    out = enc.encode([enc.query_input(fact.text)], with_mlm=True)
    assert out.mlm_log_probs is not None
    subject = {w.lower() for w in _WORD.findall(fact.subject)}
    return Question(
        fact, out.embeddings[0], np.exp(out.mlm_log_probs[0].numpy().astype(np.float64)),
        searched_rows(pipeline.datastore, [h.title for h in hits]), [h.score for h in hits], subject,
        content_words(MASK_RE.sub(" ", fact.text), stopwords) - subject,
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.vote_bound", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(PROXY_MODEL))
    p.add_argument("--others", type=int, default=300, help="leads of other articles added to the corpus")
    p.add_argument("--candidates", type=int, default=20, help="p_MLM's most probable words taken as candidates "
                   "(besides every word the neighbours carry)")  # fmt: skip
    p.add_argument("--time-limit", type=float, default=120.0, help="seconds the solver gets for each best vote; "
                   "past it, the vote found and the solver's upper bound are reported")  # fmt: skip
    p.add_argument("--work", type=Path, default=RUNS / "bench-realtext")
    p.add_argument("--probe", choices=["trex", "heldout"], default="trex", help="trex: the 22 relations (dev and "
                   "test); heldout: the other T-REx relations, an independent check (no dev split: no fitted vote)")  # fmt: skip
    p.set_defaults(answers="single-piece", datastore=None)
    return p


def at_least(found: BestVote, cands: list[Candidates], fewer: np.ndarray, n_features: int) -> BestVote:
    """``found``, or the vote over fewer features (padded with zero weights) where that scores more: a vote over
    fewer features is one over more, so a solver stopped by its time limit never reports less for more."""
    padded = np.pad(fewer, (0, n_features - len(fewer)))
    p1 = macro_p1(cands, fewer)  # the same vote, scored over its own features: no rounding of the padded product
    return found if found.p1 >= p1 else BestVote(p1, found.upper_bound, False, padded)


def score_setting(cands: dict[str, list[Candidates]], time_limit: float) -> dict[str, Any]:
    """Per split: the default vote, the share of facts whose gold is a candidate, the best linear vote over the
    general features and over all of them (`best_vote`); and, when there is a dev split, the vote fitted on it,
    scored on each split."""
    general, every = len(FEATURES), len(ALL_FEATURES)
    fitted = fit_likelihood(cands["dev"], general) if "dev" in cands else None
    out: dict[str, Any] = {"fitted_on_dev": None}
    if fitted is not None:
        out["fitted_on_dev"] = dict(zip(FEATURES, np.round(fitted, 3).tolist(), strict=True))
    for split, cs in cands.items():
        best = {"general": best_vote(cs, general, time_limit=time_limit)}
        best["all"] = at_least(best_vote(cs, every, time_limit=time_limit), cs, best["general"].weights, every)
        out[split] = {
            "facts": len(cs), "default": macro_p1(cs),
            "gold_among_candidates": round(100.0 * float(np.mean([c.fact.gold in c.words for c in cs])), 1),
            **{f"best_{name}": b.p1 for name, b in best.items()},
            **{f"upper_bound_{name}": b.upper_bound for name, b in best.items()},
            **{f"proven_{name}": b.optimal for name, b in best.items()},
            "fitted_on_dev": macro_p1(cs, fitted) if fitted is not None else None,
        }  # fmt: skip
    return out


def split_candidates(pipeline: Any, facts: list[Fact], splits: list[str], *, with_subject: bool, top: int
                     ) -> dict[str, list[Candidates]]:  # fmt: skip
    """Each split's questions asked as the service asks them (its k, lambda and temperature), as candidates."""
    from bertknn.service.results import Query

    defaults = Query(text="[MASK] .")
    stopwords = load_stopwords()
    vocab = [pipeline.token(i) for i in range(pipeline.encoder.vocab_size)]
    kw = {"k": defaults.k, "lam": defaults.lambda_, "top": top, "temperature_of": pipeline.assembler.auto_temperature.of,
          "vocab": vocab, "non_words": pipeline.encoder.words.vocab.non_words, "stopwords": stopwords}  # fmt: skip
    return {
        split: [candidates(ask(pipeline, f, with_subject=with_subject, stopwords=stopwords), **kw) for f in facts
                if f.split == split]
        for split in splits
    }  # fmt: skip


def print_row(split: str, setting: str, x: dict[str, Any]) -> None:
    fitted = "" if x["fitted_on_dev"] is None else f"  fitted on dev {x['fitted_on_dev']:5.1f}"
    best = ", ".join(f"{name} {x[f'best_{name}']:5.1f}" + ("" if x[f"proven_{name}"] else
                     f" (at most {x[f'upper_bound_{name}']:5.1f})") for name in ("general", "all"))  # fmt: skip
    print(f"{split:7s} {setting:16s} facts {x['facts']:4d}  default {x['default']:5.1f}  gold among candidates "
          f"{x['gold_among_candidates']:5.1f}  best linear vote: {best}{fitted}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.candidates < 1 or args.others < 0 or not args.time_limit > 0:
        p.error("--candidates must be at least 1, --others at least 0, --time-limit above 0")
    pipeline, facts, sizes = open_benchmark(args)
    splits = ["heldout"] if args.probe == "heldout" else ["dev", "test"]
    result: dict[str, Any] = {"model": Path(args.model).name, "machine": machine(), "probe": args.probe,
                              "corpus": sizes, "features": list(FEATURES), "benchmark_only": list(BENCHMARK_ONLY),
                              "candidates": args.candidates, "time_limit_s": args.time_limit,
                              "settings": {}}  # fmt: skip
    for setting in ("with_subject", "without_subject"):
        cands = split_candidates(pipeline, facts, splits, with_subject=setting == "with_subject", top=args.candidates)
        result["settings"][setting] = r = score_setting(cands, args.time_limit)
        for split in splits:
            print_row(split, setting, r[split])
    name = "vote_bound" + ("-heldout" if args.probe == "heldout" else "")
    print(f"wrote {write_result(result_name(name, args.model), result)}")
    pipeline.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
