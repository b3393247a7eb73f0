"""Title normalisation and folding, and the documented rule for titles that fold alike."""

from __future__ import annotations

import unicodedata

import pytest

from bertknn.core.titles import fold_title, normalize_title, pick_among_folded

NFC = "Émile Zola"
NFD = unicodedata.normalize("NFD", NFC)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("albert_einstein", "Albert einstein"),
        ("  Albert   Einstein \n", "Albert Einstein"),
        ("Albert__Einstein", "Albert Einstein"),
        ("iPhone", "IPhone"),  # Wikipedia's first-letter capitalisation
        ("émile zola", "Émile zola"),
        ("", ""),
        ("   ", ""),
    ],
)
def test_normalize_title(raw: str, expected: str) -> None:
    assert normalize_title(raw) == expected


def test_nfd_input_normalises_to_the_nfc_title() -> None:
    assert NFD != NFC
    assert normalize_title(NFD) == NFC
    assert normalize_title(unicodedata.normalize("NFD", "cafe\u0301")) == "Café"


def test_normalize_is_idempotent() -> None:
    for t in ("albert_einstein", NFD, " x  y ", "Ōtaru Harbour 🚢"):
        assert normalize_title(normalize_title(t)) == normalize_title(t)


@pytest.mark.parametrize(
    "variant", ["Émile Zola", "emile zola", "EMILE ZOLA", "émile_zola", NFD, "  Emile   Zola "]
)
def test_fold_ignores_case_accents_underscores_and_spaces(variant: str) -> None:
    assert fold_title(variant) == "emile zola"


def test_fold_casefolds_and_decomposes_compatibility_characters() -> None:
    assert fold_title("Straße") == "strasse"
    assert fold_title("ﬁsh") == "fish"  # NFKD: the ligature becomes two letters
    assert fold_title("Dax") != fold_title("Dux")


def test_pick_prefers_the_exact_normalised_title() -> None:
    cands = [("Däx", 50), ("Dax", 1), ("DAX", 9)]
    assert pick_among_folded("dax", cands) == "Dax"  # normalises to "Dax"
    assert pick_among_folded("DAX", cands) == "DAX"
    assert pick_among_folded("däx", cands) == "Däx"


def test_pick_then_prefers_same_accents_ignoring_case() -> None:
    cands = [("Däx", 1), ("DAx", 9), ("Dax", 2)]
    assert pick_among_folded("DÄX", cands) == "Däx"
    # "dAX" normalises to "DAX", no such title; two equal "dax" ignoring case: the one with more contexts
    assert pick_among_folded("dAX", cands) == "DAx"


def test_pick_then_most_contexts_then_smallest_title() -> None:
    assert pick_among_folded("dáx", [("Däx", 3), ("Dax", 7), ("Dàx", 7)]) == "Dax"  # 7 ties: "Dax" < "Dàx"
    assert pick_among_folded("dáx", [("Dàx", 7), ("Däx", 3), ("Dax", 7)]) == "Dax"  # whatever the order given
    assert pick_among_folded("dáx", [("Däx", 8), ("Dax", 7)]) == "Däx"


def test_pick_accepts_nfd_queries_and_returns_none_without_candidates() -> None:
    assert pick_among_folded(NFD, [("Emile Zola", 100), (NFC, 1)]) == NFC
    assert pick_among_folded("anything", []) is None
