"""Entity links: extraction (wikitext, JSON lines, WikiExtractor anchors), anchors as targets, entity voting, and
the weighting of relation following, on hand-made inputs whose answers are known."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
from transformers import PreTrainedTokenizerBase

from bertknn.builder.corpus import html_anchor_links, read_jsonl
from bertknn.builder.site import ENGLISH, Site
from bertknn.builder.targets import MAX_ANCHOR_PIECES, TargetSelector, load_stopwords, masked_ids
from bertknn.builder.wikitext import link_target, wikitext_links, wikitext_to_text
from bertknn.core.errors import CorpusError, InvalidRequest
from bertknn.core.format.table import EntityRef
from bertknn.core.languages import rules_for
from bertknn.service.entities import MAX_NAME_PIECES, EntityAnswerer, entity_of_words, surface_form
from bertknn.service.follow import Hop, HopEntity, check_template, combine, fill, fill_hop, paths, to_fill
from bertknn.service.interpolate import knn_distribution
from bertknn.service.results import Answer, Prediction, Query
from bertknn.service.retrieval.knn import Neighbours

# ---- extraction ---------------------------------------------------------------------------------------------------

WIKITEXT = (
    "{{Infobox person|birth_place=[[Rome]]}}\n"
    "'''[[Galileo Galilei|Galileo]]''' was born in [[Pisa]], in the [[Duchy of Florence|Duchy  of Florence]]."
    "<ref>{{cite book|publisher=[[Oxford University Press]]}}</ref> "
    "He taught at the [[University of Padua#History|university]] and saw [[moon]]s. "
    "See [[#Later life]] and [[:Category:Astronomers|astronomers]] or [[wikt:telescope|telescopes]].\n"
    "[[File:Galileo.jpg|thumb|A portrait by [[Justus Sustermans]]]]\n"
    "== References ==\n* [[Stillman Drake]]\n"
)


def test_wikitext_links_piped_multiword_and_dropped_ones() -> None:
    text, links = wikitext_links(WIKITEXT)
    assert text == wikitext_to_text(WIKITEXT)  # the text is the one the builder always made
    got = [(text[ln.start : ln.end], ln.target) for ln in links]
    assert got == [
        ("Galileo", "Galileo Galilei"),  # inside bold markup, piped
        ("Pisa", "Pisa"),
        ("Duchy of Florence", "Duchy of Florence"),  # an anchor of several words; its double space collapsed
        ("university", "University of Padua"),  # the section of the target dropped
        ("moons", "Moon"),  # the link trail "s" is part of the link's text, as MediaWiki shows it; target upper-cased
    ]
    # dropped with what holds them: the infobox, the reference, the file caption, the back matter; and links
    # that name no article: a section of this page, another namespace, another wiki
    for gone in ("Rome", "Oxford University Press", "Justus Sustermans", "Stillman Drake", "Astronomers", "Telescope"):
        assert gone not in {ln.target for ln in links}


def test_a_link_takes_the_letters_of_its_language_s_link_trail() -> None:
    """MediaWiki's $linkTrail: letters right after ]] show as part of the link ([[bus]]es is one link, "buses"),
    English's a-z unless the language has its own (German adds äöüß; Japanese text after a link is no trail; Chinese
    has none at all)."""
    cases = [
        (ENGLISH, "[[bus]]es, [[Ulm]]'s [[Paris|the city ]]x [[Rome]]2 [[Köln]]ö.", ["buses", "Ulm", "the city", "Rome", "Köln"]),
        (Site(rules_for("de")), "[[Köln]]ö und [[Bus]]ses.", ["Kölnö", "Busses"]),
        (Site(rules_for("ja")), "[[東京]]都", ["東京"]),
        # each language's own letters (MessagesXx.php): a Ukrainian case ending, a Polish one, none in Chinese
        (Site(rules_for("uk")), "у [[Київ]]і, [[Париж|Парижем]]. [[Рим]]Ґ «[[Динамо (Київ)|Динамо]]»", ["Київі", "Парижем", "Рим", "Динамо"]),
        (Site(rules_for("ru")), "в [[Москва|Москв]]е и [[Київ]]і", ["Москве", "Київ"]),
        (Site(rules_for("pl")), "w [[Kraków|Krakow]]ie i [[Łódź]]ą", ["Krakowie", "Łódźą"]),
        (Site(rules_for("pt")), "[[Lisboa]]ã e [[Porto]]ñ", ["Lisboaã", "Porto"]),
        (Site(rules_for("zh")), "[[北京]]市 [[Linux]]es", ["北京", "Linux"]),
        (Site(rules_for("az")), "[[Bakı]]ya və [[Şəki]]də", ["Bakıya", "Şəkidə"]),
    ]
    for site, wikitext, anchors in cases:
        text, links = wikitext_links(wikitext, site)
        assert [text[ln.start : ln.end] for ln in links] == anchors


def test_link_targets_are_normalised_titles() -> None:
    assert link_target("new_york_City") == "New york City"
    assert link_target("Star Wars: Episode IV") == "Star Wars: Episode IV"
    assert link_target("Paris#History") == "Paris"
    assert link_target(":Paris") == link_target(" Paris ") == "Paris"  # [[:Paris]] is a link to the article
    for none in ("#Life", ":Category:Films", "de:Albert Einstein", "wikt:word", "File:X.jpg"):
        assert link_target(none) == ""


def test_wikiextractor_anchors_become_links() -> None:
    text, links = html_anchor_links(
        'Born in <a href="Pisa">Pisa</a>, he taught at the <a href="University%20of%20Padua">university of '
        'Padua</a> &amp; <a href="">nothing</a> <a href="Rome">  </a>.'
    )
    assert text == "Born in Pisa, he taught at the university of Padua &amp; nothing   ."
    assert [(text[ln.start : ln.end], ln.target) for ln in links] == [
        ("Pisa", "Pisa"),
        ("university of Padua", "University of Padua"),
    ]


def test_jsonl_links_are_read_and_checked(tmp_path: Path) -> None:
    text = "Galileo was born in Pisa."
    good = {"title": "Galileo", "text": text, "links": [{"start": 20, "end": 24, "target": "pisa"}]}
    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps(good) + "\n")
    (art,) = read_jsonl(path)
    assert [(text[ln.start : ln.end], ln.target) for ln in art.links] == [("Pisa", "Pisa")]
    anchors = {"title": "G", "text": 'Born in <a href="Pisa">Pisa</a>.'}
    path.write_text(json.dumps(anchors) + "\n")
    (art,) = read_jsonl(path)
    assert art.text == "Born in Pisa." and art.links[0].target == "Pisa"
    for bad, says in (
        ({"start": 20, "end": 99, "target": "Pisa"}, "outside the text's 25 characters"),
        ({"start": 24, "end": 20, "target": "Pisa"}, "outside the text"),
        ({"start": "20", "end": 24, "target": "Pisa"}, '"start": int'),
        ({"start": 20, "end": 24}, '"target": "Title"'),
    ):
        path.write_text("\n" + json.dumps({**good, "links": [bad]}) + "\n")
        with pytest.raises(CorpusError, match=rf"a\.jsonl:2: links\[0\].*{says}"):
            list(read_jsonl(path))
    path.write_text(json.dumps({**good, "links": {"start": 1}}) + "\n")
    with pytest.raises(CorpusError, match='"links" must be a list'):
        list(read_jsonl(path))


# ---- anchors as targets (the real bert-base-uncased tokenizer) -----------------------------------------------------


@pytest.fixture(scope="module")
def selector(bert_tokenizer: PreTrainedTokenizerBase) -> TargetSelector:
    return TargetSelector(bert_tokenizer, load_stopwords())


def test_an_anchor_of_several_words_is_one_target_masked_once(
    selector: TargetSelector, bert_tokenizer: PreTrainedTokenizerBase
) -> None:
    text = "Kepler lived in the Duchy of Württemberg and in Prague."
    a = text.index("Duchy of Württemberg")
    p = text.index("Prague")
    links = [(a, a + len("Duchy of Württemberg"), 7), (p, p + len("Prague"), 3)]
    (s,) = selector.select([text], [links])
    by_span = {(t.char_start, t.char_end): t for t in s.targets}
    anchor = by_span[(links[0][0], links[0][1])]
    assert anchor.entity == 7 and anchor.token_id == -1  # no word label: an entity's row only
    assert anchor.num_pieces == len(bert_tokenizer.tokenize("Duchy of Württemberg")) == 3
    ids, pos = masked_ids(s, anchor, bert_tokenizer.mask_token_id)
    assert ids.count(bert_tokenizer.mask_token_id) == 1 and ids[pos] == bert_tokenizer.mask_token_id
    assert len(ids) == len(s.ids) - anchor.num_pieces + 1
    assert bert_tokenizer.decode(ids) == "kepler lived in the [MASK] and in prague."
    # the one-word anchor labels the word target that was there, no second row
    assert by_span[(p, p + 6)].entity == 3 and by_span[(p, p + 6)].token_id == bert_tokenizer.convert_tokens_to_ids("prague")
    assert sum(1 for t in s.targets if (t.char_start, t.char_end) == (p, p + 6)) == 1
    # the words inside the anchor stay word targets
    assert {"Duchy"} <= {text[t.char_start : t.char_end] for t in s.targets if t.entity < 0}


def test_an_anchor_of_the_most_pieces_is_a_target_and_one_of_more_is_not(
    selector: TargetSelector, bert_tokenizer: PreTrainedTokenizerBase
) -> None:
    longest, too_long = "Qwxzvbnmlk Zyxwvbqrst Paris Rome", "Qwxzvbnmlk Zyxwvbqrst Paris Rome Oslo"
    assert [len(bert_tokenizer.tokenize(a)) for a in (longest, too_long)] == [MAX_ANCHOR_PIECES, MAX_ANCHOR_PIECES + 1]
    for name, entity, kept in ((longest, 5, True), (too_long, 6, False)):
        text = f"They named it {name} in the end."
        a = text.index(name)
        (s,) = selector.select([text], [[(a, a + len(name), entity)]])
        anchors = [t for t in s.targets if t.entity == entity]
        assert [(t.char_start, t.char_end, t.num_pieces) for t in anchors] == (
            [(a, a + len(name), MAX_ANCHOR_PIECES)] if kept else [])  # fmt: skip


def test_anchors_that_cut_a_token_or_hold_only_stopwords_are_left_out(selector: TargetSelector) -> None:
    text = "The Parisian said that the city was big."
    links = [(4, 9, 0), (text.index("the city"), text.index("the city") + 3, 1)]  # "Paris" of "Parisian"; "the"
    (s,) = selector.select([text], [links])
    assert all(t.entity < 0 for t in s.targets)
    (plain,) = selector.select([text])
    assert s.targets == plain.targets


# ---- entity voting -------------------------------------------------------------------------------------------------


class _Linked:
    """A stand-in datastore: row -> entity (None: no link), titles -> entities."""

    linked = True

    def __init__(self, rows: dict[int, EntityRef | None]):
        self.rows = rows
        self.has_entities = True  # (`EntityLinks.has_entities`: the manifest counts some linked entity)
        self.links = self  # the look-ups of `Datastore.links`

    def entity_indexes(self, rows: list[int]) -> list[tuple[int, int] | None]:
        return [None if self.rows[r] is None else (0, r) for r in rows]

    def entities_of(self, where: list[tuple[int, int]]) -> list[EntityRef]:
        refs = [self.rows[local] for _, local in where]
        assert None not in refs
        return refs  # type: ignore[return-value]

    def entity(self, title: str) -> EntityRef | None:
        return {"Pisa": EntityRef("Pisa", 9)}.get(title)

    def entities_named(self, titles: list[str]) -> list[EntityRef | None]:
        return [self.entity(t) for t in titles]

    class articles:  # noqa: N801 - the datastore's article table: no folded titles here
        @staticmethod
        def first_folded(keys: list[str]) -> dict[str, str]:
            return {}


def test_neighbours_vote_for_their_entity_whatever_the_surface() -> None:
    city, country = EntityRef("New Quellport", 5), EntityRef("Kingdom of Zembla", 2)
    ds = _Linked({10: city, 11: country, 12: city, 13: city})
    nbrs = Neighbours(np.array([1.0, 2.0, 3.0, 7.0], np.float32), np.array([10, 11, 12, 13]), np.zeros(4, np.int32))
    answerer = EntityAnswerer.__new__(EntityAnswerer)
    answerer.datastore = ds  # type: ignore[assignment]
    entities, labels = answerer.candidates(nbrs)
    assert [e.title for e in entities] == ["New Quellport", "Kingdom of Zembla"] and labels.tolist() == [0, 1, 0, 0]
    p = knn_distribution(nbrs.distances, labels, len(entities), 2.0)
    w = np.exp(-np.array([1.0, 2.0, 3.0, 7.0]) / 2.0)
    assert p.tolist() == pytest.approx([(w[0] + w[2] + w[3]) / w.sum(), w[1] / w.sum()], rel=1e-6)


def test_a_word_answer_names_the_entity_its_neighbours_link_to() -> None:
    ds = _Linked({0: EntityRef("Pisa", 9), 1: None, 2: EntityRef("Pisa (film)", 1), 3: EntityRef("Pisa (film)", 1)})
    nbrs = Neighbours(np.array([0.0, 1.0, 5.0, 6.0], np.float32), np.arange(4), np.zeros(4, np.int32))
    words = ["pisa", "pisa", "pisa", "pisa"]
    # weights exp(-d/1): 1 for Pisa against e^-5 + e^-6 for the film: the nearer link wins, not the count
    (ref,) = entity_of_words(ds, nbrs, ["pisa"], words, 1.0)  # type: ignore[arg-type]
    assert ref == EntityRef("Pisa", 9)
    (ref,) = entity_of_words(ds, nbrs, ["pisa"], words, 100.0)  # type: ignore[arg-type]
    assert ref == EntityRef("Pisa (film)", 1)  # at a high temperature the two film links outweigh the one
    (ref,) = entity_of_words(ds, Neighbours(nbrs.distances[1:2], np.array([1]), np.zeros(1, np.int32)), ["pisa"], ["pisa"], 1.0)  # type: ignore[arg-type]
    assert ref == EntityRef("Pisa", 9)  # no neighbour links: the entity titled like the word


def test_links_that_name_no_entity_are_not_looked_up() -> None:
    """A datastore built with links over a corpus that had none: no entity to find, so no look-up per answer."""
    ds = _Linked({0: None})
    ds.has_entities = False
    ds.entity_indexes = ds.entities_named = None  # type: ignore[assignment]  # (a look-up would fail here)
    nbrs = Neighbours(np.array([0.0], np.float32), np.arange(1), np.zeros(1, np.int32))
    assert entity_of_words(ds, nbrs, ["pisa", "rome"], ["pisa"], 1.0) == [None, None]  # type: ignore[arg-type]


def test_surface_forms() -> None:
    assert surface_form("Paris (mythology)", True) == "paris"
    assert surface_form("Kingdom of Zembla", False) == "Kingdom of Zembla"
    assert surface_form("(Untitled)", True) == "(untitled)"


# ---- relation following ------------------------------------------------------------------------------------------


def test_follow_weights_each_hop_by_its_entity_and_sums() -> None:
    # hop 1 from X: A 0.6, B 0.3. Hop 2: from A -> U 0.5, V 0.5; from B -> V 0.9, W 0.1
    ctx = []
    hop2 = combine(
        [("A", 0.6), ("B", 0.3)],
        [[("U", 0.5, ctx), ("V", 0.5, ctx)], [("V", 0.9, ctx), ("W", 0.1, ctx)]],
    )
    got = {e.title: (e.prob, e.via) for e in hop2}
    # V: 0.6 * 0.5 via A plus 0.3 * 0.9 via B; A gave more (0.30 > 0.27), so the path goes through A
    assert got["V"][0] == pytest.approx(0.6 * 0.5 + 0.3 * 0.9) and got["V"][1] == "A"
    assert got["U"] == (pytest.approx(0.3), "A") and got["W"] == (pytest.approx(0.03), "B")
    assert [e.title for e in hop2] == ["V", "U", "W"]
    hop1 = Hop("[X] r1 [Y] .", [HopEntity("A", 0.6, [], None), HopEntity("B", 0.3, [], None)])
    (first, *_) = paths("X", [hop1, Hop("[X] r2 [Y] .", hop2)], 2)
    assert first.title == "V" and [s.title for s in first.path] == ["X", "A", "V"]
    assert [s.prob for s in first.path] == [1.0, 0.6, pytest.approx(0.57)]


def _entity_answer(lam: float, preds: list[tuple[str, float, int]]) -> Answer:
    """An entity answer before its names were filled: (title, p_kNN, pieces); p = lam p_kNN (+ p_MLM for one
    piece, here 0)."""
    return Answer(
        [Prediction(t, -1, lam * knn, 0.0, knn, [], pieces) for t, knn, pieces in preds], [], [], [], lam, {}, {}
    )


def test_a_hop_fills_only_the_names_it_hands_on_in_one_pass() -> None:
    # parent A (weight 0.8), parent B (0.2); names of one piece and of more than MAX_NAME_PIECES are never filled
    a = _entity_answer(0.5, [("Uno", 0.4, 1), ("Big Place", 0.3, 2), ("Far Away Land", 0.2, 3), ("Small Town", 0.1, 2)])
    b = _entity_answer(0.5, [("New Harbour", 0.9, 2), ("Long" * 3, 0.1, MAX_NAME_PIECES + 1)])
    parents = [("A", 0.8), ("B", 0.2)]
    # weight x p before the fill: A's Big Place 0.12, Far Away Land 0.08, Small Town 0.04; B's New Harbour 0.09
    assert to_fill(parents, [a, b], 3) == [(0, 1), (1, 0), (0, 2)]
    asked: list[list[tuple[str, list[str]]]] = []

    async def fill_names(requests: list[tuple[str, list[str]]]) -> list[list[float]]:
        asked.append(requests)
        return [[0.6 if t == "Far Away Land" else 0.0 for t in titles] for _, titles in requests]

    queries = [Query(text="a r [MASK] ."), Query(text="b r [MASK] .")]
    got = asyncio.run(fill_hop(queries, [a, b], [(0, 1), (1, 0), (0, 2)], fill_names))
    assert asked == [[("a r [MASK] .", ["Big Place", "Far Away Land"]), ("b r [MASK] .", ["New Harbour"])]]  # one call
    first = got[0].predictions
    assert [p.token for p in first] == ["Far Away Land", "Uno", "Big Place", "Small Town"]  # ranked again
    assert first[0].prob == pytest.approx(0.5 * 0.2 + 0.5 * 0.6) and first[0].p_mlm == 0.6
    assert got[1].predictions[0].prob == pytest.approx(0.45)  # filled: p_MLM 0, p = lam p_kNN as before
    assert to_fill(parents, [a, b], 0) == []


def test_templates_need_one_x_and_one_y() -> None:
    check_template("[X] was born in [Y] .", 0)
    assert fill("[X] was born in [Y] .", "Paris (mythology)", True) == "paris was born in [MASK] ."
    for bad in ("[X] was born in [MASK] .", "[X] and [X] in [Y] .", "born in [Y] .", "[X] [Y] [mask]"):
        with pytest.raises(InvalidRequest, match="relations.3"):
            check_template(bad, 3)


def test_prepared_rows_keep_each_anchor_s_span_through_splitting_and_masking(bert_tokenizer) -> None:
    from bertknn.builder.corpus import Article
    from bertknn.builder.prepare import ShardPreparer
    from bertknn.builder.wikitext import Link
    from tests.conftest import BERT_TOKENIZER

    text = ("Dante Alighieri was born in Florence in 1265. He wrote the Divine Comedy in exile. "
            "He died in Ravenna, in the Papal States, in 1321.")  # fmt: skip
    anchors = [("Florence", "Florence"), ("Divine Comedy", "Divine Comedy"), ("Ravenna", "Ravenna"),
               ("Papal States", "Papal States"), ("exile. He", "Exile")]  # the last crosses a sentence end  # fmt: skip
    links = tuple(Link(text.index(a), text.index(a) + len(a), t) for a, t in anchors)
    prep = ShardPreparer(str(BERT_TOKENIZER), 64, load_stopwords(), 10, "single-piece", links=True)
    shard = prep.prepare(0, [Article("1", "Dante Alighieri", text, "x.jsonl", links=links)])
    assert shard.entity_labels is not None and shard.entities is not None
    found = {}
    for row in np.flatnonzero(shard.entity_labels >= 0).tolist():
        a, b = shard.spans[row].tolist()
        sentence = shard.sentences[shard.sentence_ids[row]]
        found[sentence[a:b]] = shard.entities[shard.entity_labels[row]]
        masked = shard.inputs[row]
        assert masked.input_ids.count(bert_tokenizer.mask_token_id) == 1
        if shard.labels[row] < 0:  # an anchor row: its words are gone, one [MASK] in their place
            assert bert_tokenizer.decode(masked.input_ids).count(sentence[a:b].lower()) == 0
    assert found == {"Florence": "Florence", "Divine Comedy": "Divine Comedy", "Ravenna": "Ravenna",
                     "Papal States": "Papal States"}  # fmt: skip
    assert "Exile" not in shard.entities  # an anchor across two sentences is in neither


def test_a_prediction_with_its_entity_keeps_every_other_field() -> None:
    from dataclasses import fields, replace

    from bertknn.service.results import Context, EntityRef, Prediction

    # every field set away from its default, so that a field with_entity forgot shows up as a difference
    given = {"token": "pisa", "token_id": 7, "prob": 0.5, "p_mlm": 0.25, "p_knn": 0.75,
             "contexts": [Context("Pisa", "**pisa** is a city", 1.5, 1)], "pieces": 2,
             "entity": EntityRef("Pisa (town)", 3)}  # fmt: skip
    assert set(given) == {f.name for f in fields(Prediction)}
    p = Prediction(**given)  # type: ignore[arg-type]
    ref = EntityRef("Pisa", 40)
    assert p.with_entity(ref) == replace(p, entity=ref)
    assert p.with_entity(None) == replace(p, entity=None)


def test_a_link_s_span_is_its_shown_text_whatever_spaces_or_colon_it_has() -> None:
    text, links = wikitext_links("He saw [[Paris| Paris]] and [[:Berlin]], not [[:Category:Cities]].")
    assert text == "He saw  Paris and Berlin, not Category:Cities."
    assert [(text[ln.start : ln.end], ln.target) for ln in links] == [("Paris", "Paris"), ("Berlin", "Berlin")]
