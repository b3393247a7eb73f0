"""Two services' answers to the same questions, compared: what a benchmark that serves two trees (or one tree with
other settings) reports beside its timings.

A difference has two possible sources. Either the answer was made differently from the same articles (what a
change to the serving path must not do), or the ranker returned other articles because scores tied at its
boundary (its N-th score shared by more articles than fit) and the two trees broke the tie differently. With a
small corpus and LAMA's short questions such ties are common: one query term found in several articles scores
them alike. So `compare` reports both: every question, and the questions whose articles were the same.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from bench.common import host_port, run_async
from bench.rawhttp import AsyncRawClient


@dataclass(frozen=True)
class Said:
    """One question's answer: its predictions (token, probability) and the articles it searched (title, score;
    None for the subject's own article)."""

    predictions: tuple[tuple[str, float], ...]
    articles: tuple[tuple[str, float | None], ...]

    @classmethod
    def of(cls, body: dict) -> Said:
        return cls(
            tuple((p["token"], p["prob"]) for p in body["predictions"]),
            tuple((a["title"], a["score"]) for a in body["articles"]),
        )


def answers(url: str, payloads: list[dict]) -> list[Said]:
    """Each question's answer, asked one at a time over one keep-alive connection."""

    async def run() -> list[Said]:
        conn = AsyncRawClient(*host_port(url))
        out = []
        try:
            for payload in payloads:
                status, body = await conn.post_json("/predict", payload)
                if status != 200:
                    raise RuntimeError(f"/predict answered {status}: {body[:200]!r}")
                out.append(Said.of(json.loads(body)))
        finally:
            await conn.close()
        return out

    return run_async(run())


def _same_score(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b))


def tie_at_boundary(ours: Said, theirs: Said) -> bool:
    """Whether two different article lists differ only in how a tie at the ranker's boundary was broken: the same
    scores in the same order, and the same articles at every score above the last one."""
    a, b = ours.articles, theirs.articles
    if len(a) != len(b) or not a or not all(_same_score(x[1], y[1]) for x, y in zip(a, b, strict=True)):
        return False
    last = a[-1][1]
    above = [i for i, (_, score) in enumerate(a) if not _same_score(score, last)]
    return {a[i][0] for i in above} == {b[i][0] for i in above}


def _agreement(pairs: list[tuple[Said, Said]]) -> tuple[float, float]:
    """(the share of questions with the same top-1, the largest difference of a prediction's probability where
    the tokens at a rank agree)."""
    same = sum(
        bool(a.predictions and b.predictions and a.predictions[0][0] == b.predictions[0][0]) for a, b in pairs
    )
    diffs = [abs(pa - pb) for a, b in pairs for (ta, pa), (tb, pb) in zip(a.predictions, b.predictions, strict=False)
             if ta == tb]  # fmt: skip
    return same / max(1, len(pairs)), max(diffs, default=0.0)


def compare(ours: list[Said], theirs: list[Said]) -> dict[str, float]:
    """Top-1 agreement and the largest difference of a probability, over all questions and over those whose
    articles were the same; how many questions searched other articles, and how many of those only because a
    tie at the ranker's boundary was broken another way (`tie_at_boundary`)."""
    pairs = list(zip(ours, theirs, strict=True))
    same_articles = [(a, b) for a, b in pairs if a.articles == b.articles]
    other = [(a, b) for a, b in pairs if a.articles != b.articles]
    top1, diff = _agreement(pairs)
    top1_same, diff_same = _agreement(same_articles)
    return {
        "questions": len(pairs),
        "same_top1": top1,
        "max_prob_diff": diff,
        "other_articles": len(other),
        "other_articles_by_tie": sum(tie_at_boundary(a, b) for a, b in other),
        "same_top1_same_articles": top1_same,
        "max_prob_diff_same_articles": diff_same,
    }


def in_words(c: dict[str, float]) -> str:
    """`compare`'s figures in words."""
    return (f"the same top-1 for {100 * c['same_top1']:.2f} % of {c['questions']} questions, probabilities within "
            f"{c['max_prob_diff']:.2g}; {c['other_articles']} searched other articles, {c['other_articles_by_tie']} of "
            f"them a tie at the ranker's boundary broken another way; with the same articles, the same top-1 for "
            f"{100 * c['same_top1_same_articles']:.2f} %, probabilities within {c['max_prob_diff_same_articles']:.2g}")
