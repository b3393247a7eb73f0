"""LAMA probe reading and query construction: templates, pair dedup, Google-RE raters, wordpieces, SQuAD, splits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer, BertTokenizer, PreTrainedTokenizerBase

from bertknn.core.errors import LamaError
from bertknn.evaluation.lama import (
    GOOGLE_RE,
    MASK,
    SQUAD,
    TREX,
    Fact,
    ObjectVocabulary,
    Relation,
    build_queries,
    cloze_sentence,
    discover_relations,
    fill_template,
    google_re_accepted,
    is_uncased,
    load_probe,
    read_facts,
    select_relations,
    split_of,
)
from tests.conftest import SHARED_DATA

WORDS = [
    "zorblat",
    "was",
    "born",
    "in",
    "quimby",
    "plonk",
    "river",
    "paris",
    "new",
    "york",
    "1941",
    "(",
    ")",
    ".",
]


def make_tokenizer(directory: Path, *, lower: bool = True) -> PreTrainedTokenizerBase:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "##s", "Paris"]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizer(vocab=str(directory / "vocab.txt"), do_lower_case=lower)
    assert len(tokenizer) == len(vocab), "the tokenizer did not load the vocabulary"
    return tokenizer


@pytest.fixture
def uncased(tmp_path: Path) -> ObjectVocabulary:
    return ObjectVocabulary(make_tokenizer(tmp_path / "uncased"))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


P19 = Relation("P19", TREX, Path("P19.jsonl"), "[X] was born in [Y] .", "place of birth")


# ---- templates and sentences ------------------------------------------------------------------------------


def test_template_fills_subject_and_mask_and_lowercases_everything_but_the_mask():
    assert (
        fill_template("[X] was born in [Y] .", "Allan Peiper", lowercase=True)
        == "allan peiper was born in [MASK] ."
    )
    assert (
        fill_template("[X] was born in [Y] .", "Allan Peiper", lowercase=False)
        == "Allan Peiper was born in [MASK] ."
    )
    # [Y] before [X], and a template whose mask would be lowercased if the whole string were
    assert (
        fill_template("[Y] participated in the [X] .", "Tour", lowercase=True)
        == "[MASK] participated in the tour ."
    )
    assert (
        fill_template("The capital of [X] is [Y] .", "France", lowercase=True)
        == "the capital of france is [MASK] ."
    )
    assert "[mask]" not in fill_template("[X] (born [Y]).", "MASKED Man", lowercase=True)


@pytest.mark.parametrize("template", ["[X] was born .", "[X] and [Y] and [Y]", "was born in [Y]"])
def test_a_template_without_exactly_one_x_and_y_is_refused(template):
    with pytest.raises(LamaError, match="exactly once"):
        fill_template(template, "Zorblat", lowercase=True)


def test_squad_sentence_keeps_its_own_mask_in_any_spelling_and_refuses_two():
    s = "Newton played as [MASK] during Super Bowl 50."
    assert cloze_sentence(s, lowercase=True) == "newton played as [MASK] during super bowl 50."
    assert cloze_sentence("The [ mask ] color was used.", lowercase=False) == f"The {MASK} color was used."
    assert cloze_sentence("[MASK] beat [MASK].", lowercase=True) is None
    assert cloze_sentence("no mask here", lowercase=True) is None
    assert cloze_sentence(" [MASK] ", lowercase=True) is None


# ---- Google-RE raters -------------------------------------------------------------------------------------


def _j(*verdicts: str) -> list[dict]:
    return [{"rater": str(i), "judgment": v} for i, v in enumerate(verdicts)]


@pytest.mark.parametrize(
    ("verdicts", "kept"),
    [
        (("yes", "yes", "yes", "no", "no"), True),
        (("yes", "yes", "no", "no"), False),  # a tie is not a majority
        (("yes", "skip", "skip", "skip"), True),  # skips do not count either way
        (("no", "skip", "yes", "no"), False),
        ((), False),
    ],
)
def test_google_re_keeps_a_fact_only_when_yes_outnumbers_no(verdicts, kept):
    assert google_re_accepted(_j(*verdicts)) is kept


def test_google_re_file_uses_lama_template_and_drops_rejected_facts(tmp_path, uncased):
    write_jsonl(
        tmp_path / "lama" / "Google_RE" / "date_of_birth_test.jsonl",
        [
            {"sub_label": "Zorblat", "obj_label": "1941", "uuid": "a", "judgments": _j("yes", "yes", "no")},
            {"sub_label": "Plonk", "obj_label": "1941", "uuid": "b", "judgments": _j("no", "no", "yes")},
        ],
    )
    (rel,) = discover_relations(tmp_path / "lama")
    assert (rel.id, rel.dataset, rel.template) == ("date_of_birth", GOOGLE_RE, "[X] (born [Y]).")
    queries, stats = build_queries(rel, read_facts(rel), uncased)
    assert [q.text for q in queries] == ["zorblat (born [MASK])."]
    assert queries[0].subject == "Zorblat" and queries[0].obj == "1941"
    assert stats.rejected_by_raters == 1 and stats.kept == 1


# ---- dedup, wordpieces, vocabulary ------------------------------------------------------------------------


def test_one_query_per_unique_subject_object_pair(uncased):
    facts = [
        Fact("1", "Zorblat", "quimby"),
        Fact("2", "Zorblat", "quimby"),  # same pair, other uuid
        Fact("3", "zorblat", "Quimby"),  # the same pair once lowercased for an uncased model
        Fact("4", "Zorblat", "plonk"),  # same subject, another object: a second query
        Fact("5", "Plonk", "quimby"),
    ]
    queries, stats = build_queries(P19, facts, uncased)
    assert [(q.uid, q.text, q.obj) for q in queries] == [
        ("1", "zorblat was born in [MASK] .", "quimby"),
        ("4", "zorblat was born in [MASK] .", "plonk"),
        ("5", "plonk was born in [MASK] .", "quimby"),
    ]
    assert stats.duplicate == 2 and stats.read == 5 and stats.kept == 3


def test_only_single_wordpiece_objects_are_kept_and_the_gold_id_is_that_piece(tmp_path, uncased):
    facts = [
        Fact("1", "Zorblat", "Quimby"),  # uncased: quimby, one piece
        Fact("2", "Zorblat", "rivers"),  # river + ##s: two pieces
        Fact("3", "Zorblat", "New York"),  # two words
        Fact("4", "Zorblat", "Atlantis"),  # not in the vocabulary: [UNK]
        Fact("5", "Zorblat", ""),
        Fact("6", "", "quimby"),  # no subject
    ]
    queries, stats = build_queries(P19, facts, uncased)
    assert [q.obj for q in queries] == ["quimby"]
    assert queries[0].obj_id == uncased.tokenizer.convert_tokens_to_ids("quimby")
    assert stats.not_single_wordpiece == 4 and stats.no_subject == 1


def test_a_cased_model_keeps_case_in_queries_and_objects(tmp_path):
    cased = ObjectVocabulary(make_tokenizer(tmp_path / "cased", lower=False))
    assert not cased.lowercase
    queries, _ = build_queries(P19, [Fact("1", "Zorblat", "Paris"), Fact("2", "Zorblat", "paris")], cased)
    assert [(q.text, q.obj) for q in queries] == [
        ("Zorblat was born in [MASK] .", "Paris"),
        ("Zorblat was born in [MASK] .", "paris"),
    ]


def test_restricted_vocabulary_drops_objects_outside_it_and_lists_sorted_ids(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    vocab = ObjectVocabulary(tok, frozenset({"plonk", "quimby", "not-in-model"}))
    queries, stats = build_queries(
        P19, [Fact("1", "Zorblat", "quimby"), Fact("2", "Zorblat", "paris")], vocab
    )
    assert [q.obj for q in queries] == ["quimby"] and stats.not_in_vocab == 1
    ids = vocab.allowed_ids()
    assert ids is not None and list(ids) == sorted(tok.convert_tokens_to_ids(["plonk", "quimby"]))
    assert ObjectVocabulary(tok).allowed_ids() is None


def test_limit_keeps_the_first_n_unique_facts_and_the_split_is_deterministic(uncased):
    facts = [Fact(f"uuid-{i}", f"Subject {i}", "quimby") for i in range(200)]
    first, stats = build_queries(P19, facts, uncased, limit=5)
    assert [q.uid for q in first] == [f"uuid-{i}" for i in range(5)] and stats.over_limit == 195
    dev, _ = build_queries(P19, facts, uncased, split="dev")
    test, _ = build_queries(P19, facts, uncased, split="test")
    assert {q.uid for q in dev}.isdisjoint({q.uid for q in test}) and len(dev) + len(test) == 200
    assert 20 <= len(dev) <= 60  # about 20 %
    assert all(split_of(q.uid) == "dev" for q in dev) and split_of("uuid-0") == split_of("uuid-0")


# ---- directory layout -------------------------------------------------------------------------------------


def _layout(root: Path) -> Path:
    write_jsonl(
        root / "relations.jsonl",
        [
            {"relation": "P19", "template": "[X] was born in [Y] .", "label": "place of birth"},
            {"relation": "P36", "template": "The capital of [X] is [Y] .", "label": "capital"},
        ],
    )
    write_jsonl(root / "TREx" / "P19.jsonl", [{"sub_label": "Zorblat", "obj_label": "quimby", "uuid": "e1"}])
    write_jsonl(
        root / "TREx_facts_all41" / "P19.jsonl", [{"sub_label": "Plonk", "obj_label": "paris", "uuid": "f1"}]
    )
    write_jsonl(
        root / "TREx_facts_all41" / "P36.jsonl", [{"sub_label": "Plonk", "obj_label": "paris", "uuid": "f2"}]
    )
    write_jsonl(
        root / "Squad" / "test.jsonl",
        [
            {
                "masked_sentences": ["Zorblat was born in [MASK]."],
                "obj_label": "Quimby",
                "id": "s1",
                "sub_label": "Squad",
            },
            {
                "masked_sentences": ["[MASK] and [MASK]."],
                "obj_label": "quimby",
                "id": "s2",
                "sub_label": "Squad",
            },
        ],
    )
    return root


def test_discovery_prefers_evidence_files_and_fills_in_fact_only_relations(tmp_path):
    root = _layout(tmp_path / "lama")
    rels = discover_relations(root)
    assert [(r.id, r.dataset, r.path.parent.name) for r in rels] == [
        ("P19", TREX, "TREx"),
        ("P36", TREX, "TREx_facts_all41"),
        ("squad", SQUAD, "Squad"),
    ]
    assert [r.path.parent.name for r in discover_relations(root, trex="facts") if r.dataset == TREX] == [
        "TREx_facts_all41",
        "TREx_facts_all41",
    ]
    assert [r.id for r in discover_relations(root, trex="evidence") if r.dataset == TREX] == ["P19"]
    assert [r.id for r in select_relations(rels, ["p36", "squad"])] == ["P36", "squad"]
    assert [r.id for r in select_relations(rels, datasets=["SQuAD"])] == ["squad"]
    with pytest.raises(LamaError, match="P999 not found"):
        select_relations(rels, ["P999"])
    with pytest.raises(LamaError, match="unknown dataset"):
        select_relations(rels, datasets=["wikidata"])


def test_squad_queries_use_their_own_sentence_and_have_no_subject(tmp_path, uncased):
    root = _layout(tmp_path / "lama")
    probe = load_probe(select_relations(discover_relations(root), ["squad"]), uncased)
    assert [(q.text, q.subject, q.obj, q.dataset) for q in probe.queries] == [
        ("zorblat was born in [MASK].", None, "quimby", SQUAD)
    ]
    assert probe.stats["squad"].bad_mask == 1


def test_missing_templates_or_bad_files_say_what_to_fix(tmp_path):
    root = _layout(tmp_path / "lama")
    write_jsonl(root / "TREx" / "P999.jsonl", [{"sub_label": "a", "obj_label": "b"}])
    with pytest.raises(LamaError, match="P999 has no template"):
        discover_relations(root)
    (root / "TREx" / "P999.jsonl").unlink()
    (root / "relations.jsonl").unlink()
    with pytest.raises(LamaError, match="relation templates"):
        discover_relations(root)
    with pytest.raises(LamaError, match="no LAMA files"):
        discover_relations(tmp_path)
    bad = write_jsonl(tmp_path / "x" / "P19.jsonl", [])
    bad.write_text('{"sub_label": "a", "obj_label": "b"}\nnot json\n')
    with pytest.raises(LamaError, match=r"P19.jsonl:2: not valid JSON \(Expecting value at column 1\)$"):
        read_facts(Relation("P19", TREX, bad, "[X] [Y]"))


# ---- the real probe with the real bert-base-uncased tokenizer ---------------------------------------------


def test_real_lama_files_with_bert_base_uncased():
    tok = AutoTokenizer.from_pretrained(str(SHARED_DATA / "tokenizer" / "bert-base-uncased"))
    vocab = ObjectVocabulary(tok)
    assert is_uncased(tok) and vocab.lowercase
    rels = select_relations(discover_relations(SHARED_DATA / "lama"), ["place_of_birth", "P19", "squad"])
    probe = load_probe(rels, vocab)
    pob = probe.stats["place_of_birth"]
    assert pob.read == 2937 and pob.rejected_by_raters == 1  # the file has exactly one fact with yes <= no
    p19 = [q for q in probe.queries if q.relation == "P19"]
    assert len(p19) > 500 and all(q.text.endswith(" was born in [MASK] .") for q in p19)
    assert all("[mask]" not in q.text and q.text.count(MASK) == 1 for q in probe.queries)
    assert all(q.text.replace(MASK, "x") == q.text.replace(MASK, "x").lower() for q in probe.queries)
    assert len({(q.relation, q.text, q.obj_id) for q in probe.queries}) == len(probe.queries)
    assert all(tok.convert_ids_to_tokens(q.obj_id) == q.obj for q in probe.queries)
    squad = [q for q in probe.queries if q.dataset == SQUAD]
    assert squad and all(q.subject is None for q in squad)
