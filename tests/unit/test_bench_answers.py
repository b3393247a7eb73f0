"""Two trees' answers compared (`bench.answers`): a difference from a tie at the ranker's boundary is told apart
from one made from the same articles."""

from __future__ import annotations

from bench.answers import Said, compare, tie_at_boundary


def said(top: str, prob: float, *articles: tuple[str, float | None]) -> Said:
    return Said(((top, prob), ("other", 0.01)), tuple(articles))


def test_a_tie_at_the_last_score_broken_another_way_is_a_tie() -> None:
    ours = said("rome", 0.5, ("Rome", 9.0), ("Animal", 5.9), ("Charles Aznavour", 5.9))
    theirs = said("rome", 0.4, ("Rome", 9.0), ("Animal", 5.9), ("Helsinki", 5.9))
    assert tie_at_boundary(ours, theirs)
    # the tied articles in another order
    assert tie_at_boundary(ours, said("rome", 0.5, ("Rome", 9.0), ("Charles Aznavour", 5.9), ("Animal", 5.9)))
    # every slot tied
    assert tie_at_boundary(said("a", 1, ("A", 2.0), ("B", 2.0)), said("a", 1, ("C", 2.0), ("D", 2.0)))


def test_other_articles_above_the_boundary_or_other_scores_are_not_a_tie() -> None:
    ours = said("rome", 0.5, ("Rome", 9.0), ("Animal", 7.0), ("Paris", 5.9))
    assert not tie_at_boundary(ours, said("rome", 0.5, ("Rome", 9.0), ("Helsinki", 7.0), ("Paris", 5.9)))
    assert not tie_at_boundary(ours, said("rome", 0.5, ("Rome", 9.0), ("Animal", 7.0), ("Helsinki", 5.8)))
    assert not tie_at_boundary(ours, said("rome", 0.5, ("Rome", 9.0), ("Animal", 7.0)))
    # a tie above the boundary: the same articles there, whatever their order
    tied = said("a", 1, ("A", 3.0), ("B", 3.0), ("C", 1.0))
    assert not tie_at_boundary(tied, said("a", 1, ("A", 3.0), ("D", 3.0), ("C", 1.0)))
    assert not tie_at_boundary(said("a", 1, ("Subject", None)), said("a", 1, ("Other", None), ("X", 1.0)))
    # the subject's own article (no score) against a ranked one
    assert not tie_at_boundary(said("a", 1, ("Subject", None)), said("a", 1, ("Ranked", 2.0)))


def test_compare_reports_all_questions_and_those_with_the_same_articles() -> None:
    same = said("paris", 0.3, ("France", 4.0))
    ours = [same, said("rome", 0.5, ("Rome", 9.0), ("Animal", 5.9)), said("x", 0.2, ("A", 3.0), ("B", 2.0))]
    theirs = [
        said("paris", 0.3004, ("France", 4.0)),  # the same articles, a small difference
        said("helsinki", 0.4, ("Rome", 9.0), ("Helsinki", 5.9)),  # a tie broken another way
        said("x", 0.25, ("A", 3.0), ("C", 2.5)),  # other articles, no tie
    ]
    got = compare(ours, theirs)
    assert got["questions"] == 3
    assert got["same_top1"] == 2 / 3
    assert abs(got["max_prob_diff"] - 0.05) < 1e-9  # "x" at rank 1 in both
    assert got["other_articles"] == 2 and got["other_articles_by_tie"] == 1
    assert got["same_top1_same_articles"] == 1.0
    assert abs(got["max_prob_diff_same_articles"] - 0.0004) < 1e-9
