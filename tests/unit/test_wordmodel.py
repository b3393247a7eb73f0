"""The word model: on bert-base-uncased's real tokenizer it gives exactly BERT's rules; on byte-level BPE and
SentencePiece tokenizers (trained here) it reads words, labels and the masked sequence off the tokenizer."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from transformers import PreTrainedTokenizerBase

from bertknn.core.text import is_punctuation
from bertknn.core.wordmodel import MERGED_LOG_PROB, WordModel, lowercases
from tests.conftest import SHARED_DATA
from tests.support.families import train_tokenizer


@pytest.fixture(scope="module")
def texts() -> list[str]:
    leads = [json.loads(line)["text"] for line in (SHARED_DATA / "wiki" / "vital_articles.jsonl").open()][:300]
    return ["Paris is the capital of France. He was born in Paris."] * 50 + leads


@pytest.fixture(scope="module")
def japanese_sentencepiece(texts: list[str]) -> WordModel:
    """An XLM-R-style Unigram tokenizer that has seen some Japanese: it starts Japanese words without "▁"."""
    japanese = ["東京は日本の首都である。", "日本の人口は約一億二千万人である。", "富士山は日本で最も高い山である。"]
    return WordModel(train_tokenizer("xlm-roberta", texts + japanese * 40, vocab_size=2000))


def test_on_bert_base_uncased_the_non_words_are_berts(bert_tokenizer: PreTrainedTokenizerBase) -> None:
    """Specials, ``##`` pieces, punctuation and ``[unusedN]``: the rule the service had, over all 30,522 ids."""
    words = WordModel(bert_tokenizer)
    vocab = bert_tokenizer.convert_ids_to_tokens(list(range(len(bert_tokenizer))))
    unused = re.compile(r"\[unused\d+\]")
    old = np.array([i in bert_tokenizer.all_special_ids or t.startswith("##") or is_punctuation(t)
                    or bool(unused.fullmatch(t)) for i, t in enumerate(vocab)])  # fmt: skip
    np.testing.assert_array_equal(words.vocab.non_words, old)
    assert words.lowercase and not len(words.vocab.merges[0])  # uncased; nothing to merge in WordPiece
    assert words.vocab.texts[bert_tokenizer.convert_tokens_to_ids("paris")] == "paris"


def test_on_bert_base_uncased_words_are_the_tokenizers_word_ids(bert_tokenizer: PreTrainedTokenizerBase) -> None:
    words = WordModel(bert_tokenizer)
    text = "Kierkegaard's 1°C (Copenhagen) -- u.s. state, ½ of it!"
    tok = words.tokenize([text])[0]
    got = [text[w.start : w.end] for w in words.words(tok)]
    enc = bert_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    groups: dict[int, list[int]] = {}
    for i, w in enumerate(enc.word_ids()):
        if w is not None:
            groups.setdefault(w, []).append(i)
    off = enc["offset_mapping"]
    want = [text[off[g[0]][0] : off[g[-1]][1]] for g in groups.values()]
    assert got == [w for w in want if not is_punctuation(w)]


def test_unspaced_words_are_icu_s_words_of_the_tokens(bert_tokenizer: PreTrainedTokenizerBase) -> None:
    """BERT's tokenizer cuts Japanese into one token per character; adjacent ones join where ICU's word breaker
    puts no boundary (東 + 京 -> 東京), and an unknown character ([UNK]: 首) is no word."""
    words = WordModel(bert_tokenizer)
    text = "東京は日本の首都である。 Tokyo is big"
    tok = words.tokenize([text])[0]
    got = [(text[w.start : w.end], w.num_tokens) for w in words.words(tok)]
    assert got == [("東京", 2), ("は", 1), ("日本", 2), ("の", 1), ("都", 1), ("で", 1), ("ある", 2),
                   ("Tokyo", 1), ("is", 1), ("big", 1)]  # fmt: skip


def test_without_icu_each_unspaced_token_stays_a_word(
    bert_tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ICU is optional: without its word breaker, unspaced text's one-character tokens are not joined."""
    import bertknn.core.wordmodel as wordmodel

    monkeypatch.setattr(wordmodel, "word_boundaries", lambda text: None)
    words = WordModel(bert_tokenizer)
    text = "東京は日本 Tokyo"
    tok = words.tokenize([text])[0]
    assert [text[w.start : w.end] for w in words.words(tok)] == ["東", "京", "は", "日", "本", "Tokyo"]


@pytest.mark.parametrize("family", ["roberta", "modernbert", "xlm-roberta", "deberta-v2"])
def test_query_and_context_give_the_same_ids_whatever_the_mask_does_with_its_space(
    family: str, texts: list[str]
) -> None:
    words = WordModel(train_tokenizer(family, texts, vocab_size=2000))
    sentence = "He was born in Paris, the capital of France."
    tok = words.tokenize([sentence])[0]
    for w in words.words(tok):
        # the context's ids with the word's tokens made one mask, built here rather than by `masked`
        want = ([*tok.ids[: w.first], words.mask_id, *tok.ids[w.last + 1 :]], w.first)
        assert words.masked(tok, w) == want
        query = f"{sentence[: w.start]}[MASK]{sentence[w.end :]}"
        assert words.query_ids(query) == want, query
        mask = words.tokenizer.mask_token
        assert words.query_ids(f"{sentence[: w.start]}{mask}{sentence[w.end :]}") == want


@pytest.mark.parametrize("family", ["roberta", "xlm-roberta"])
def test_a_bare_form_is_one_word_with_its_running_text_form(family: str, texts: list[str]) -> None:
    words = WordModel(train_tokenizer(family, texts, vocab_size=2000))
    assert not words.lowercase
    (paris,) = words.pieces_of("Paris")
    start = words.tokenize(["Paris is big."])[0]  # at a text's start: byte-level BPE's bare form
    bare = start.ids[words.words(start)[0].first]
    assert words.token_word(paris) == paris and words.token_text(paris) == "Paris"
    if family == "roberta":
        assert bare != paris and words.token_word(bare) == paris
    log_p = torch.log(torch.full((1, words.vocab_size), 1.0 / words.vocab_size))
    merged = words.vocab.merge_log_probs(log_p.clone())
    assert float(merged.exp().sum()) == pytest.approx(1.0, abs=1e-4)  # mass moved, none lost
    if family == "roberta":
        assert float(merged[0, paris].exp()) == pytest.approx(2.0 / words.vocab_size, rel=1e-4)
        assert float(merged[0, bare]) == MERGED_LOG_PROB
    assert all(words.vocab.non_words[i] for i in words.special_ids)


def test_uncased_is_the_normalisers_one_rule(texts: list[str], bert_tokenizer: PreTrainedTokenizerBase) -> None:
    assert lowercases(bert_tokenizer) and lowercases(train_tokenizer("bert", texts, vocab_size=500))
    assert not lowercases(train_tokenizer("roberta", texts, vocab_size=500))
    assert not lowercases(train_tokenizer("deberta-v2", texts, vocab_size=500))


def test_a_query_says_what_is_wrong(bert_tokenizer: PreTrainedTokenizerBase) -> None:
    from bertknn.core.errors import QueryError

    words = WordModel(bert_tokenizer)
    for text, message in [("no mask here", "exactly one"), ("[MASK] and [mask]", "exactly one"), (" [MASK] ", "nothing but")]:
        with pytest.raises(QueryError, match=message):
            words.query_ids(text)


def test_a_key_is_nfc_and_the_models_case(texts: list[str], bert_tokenizer: PreTrainedTokenizerBase) -> None:
    """Titles and answers that differ in Unicode form are one word; an uncased model's key is lower-case, a cased
    model's keeps the case; what is shown is the key."""
    uncased, cased = WordModel(bert_tokenizer), WordModel(train_tokenizer("roberta", texts, vocab_size=500))
    decomposed = " Cafe\u0301 "  # e + combining acute
    assert uncased.key(decomposed) == uncased.shown(decomposed) == "caf\u00e9"
    assert cased.key(decomposed) == cased.shown(decomposed) == "Caf\u00e9"
    assert cased.key("Paris") != cased.key("paris")


def test_a_tokenizer_that_cannot_mark_words_is_refused() -> None:
    """Word alignment needs the Rust tokenizer's offsets and word ids, and a masked LM a mask token."""
    from types import SimpleNamespace

    with pytest.raises(ValueError, match="fast"):
        WordModel(SimpleNamespace(is_fast=False, mask_token_id=103))
    with pytest.raises(ValueError, match="mask token"):
        WordModel(SimpleNamespace(is_fast=True, mask_token_id=None))


def test_offsets_lose_their_spaces_and_a_lone_space_token_its_character() -> None:
    from bertknn.core.wordmodel import _space_tokens_empty, _trim

    text = "  ab  c"
    assert _trim(text, 0, 6) == (2, 4) and _trim(text, 4, 6) == (6, 6) and _trim(text, 6, 7) == (6, 7)
    # SentencePiece's lone "▁" at a text's start reported over the first character, beside that character's token
    assert _space_tokens_empty([(0, 1), (0, 3), (4, 5)]) == ((0, 0), (0, 3), (4, 5))
    assert _space_tokens_empty([(0, 0), (0, 3), (3, 3), (3, 4)]) == ((0, 0), (0, 3), (3, 3), (3, 4))
    assert _space_tokens_empty([(0, 3), (0, 3)]) == ((0, 0), (0, 3))


def test_a_mask_between_unspaced_words_drops_the_spaces_around_it(
    japanese_sentencepiece: WordModel, bert_tokenizer: PreTrainedTokenizerBase
) -> None:
    """Unspaced text has no spaces: "は [MASK] で" is "は[MASK]で". The mask stands where a Han word would (WordPiece
    breaks on both sides of a Han character), so the question's ids are those of the stored context whose masked
    word is 東京: the kana after it keep their word-initial token (a kana stand-in would glue them to itself)."""
    words = WordModel(bert_tokenizer)
    ids, at = words.query_ids("日本の首都は [MASK] である。")
    assert (ids, at) == words.query_ids("日本の首都は[MASK]である。")
    assert ids.count(words.mask_id) == 1 and ids[at] == words.mask_id
    tok = words.tokenize(["日本の首都は東京である。"])[0]
    (w,) = [w for w in words.words(tok) if tok.text[w.start : w.end] == "東京"]
    assert (ids, at) == words.masked(tok, w)
    # SentencePiece would make a space a token of its own
    words = japanese_sentencepiece
    assert words.query_ids("東京は [MASK] の首都") == words.query_ids("東京は[MASK]の首都")


def test_a_mask_glued_to_its_neighbours_masks_the_word_it_makes(texts: list[str]) -> None:
    """WordPiece glues every stand-in to letters on both sides ("thesomethings" is one word): no stand-in keeps
    apart, and the whole word the first one makes is masked, the text around it kept."""
    words = WordModel(train_tokenizer("bert", texts, vocab_size=2000))
    (head,), (tail,) = words.tokenize(["He saw"]), words.tokenize(["here."])
    assert words.query_ids("He saw the[MASK]s here.") == ([*head.ids, words.mask_id, *tail.ids], len(head.ids))


def test_a_tokenizer_that_knows_no_stand_in_says_so() -> None:
    """A vocabulary with none of the plain words a query's mask is placed with (every one an unknown token)."""
    words = WordModel(train_tokenizer("bert", ["1 2 3 4 5 6 7 8 9 0 12 345 6789"] * 20, vocab_size=60))
    with pytest.raises(ValueError, match="knows none of the plain words"):
        words.query_ids("1 2 [MASK] 4")


def test_sentencepiece_s_unspaced_tokens_are_words_and_its_glued_punctuation_none(
    japanese_sentencepiece: WordModel,
) -> None:
    """SentencePiece starts a Japanese word without "▁" (``で``, ``日本の``): each such token is a word of its own
    (`words` splits unspaced text into them). A piece with punctuation glued to it (``▁(A``, ``s.``) is no answer."""
    from bertknn.core.text import is_word_break

    words = japanese_sentencepiece
    pieces = words.tokenizer.convert_ids_to_tokens(list(range(words.vocab_size)))
    ids = {p: i for i, p in enumerate(pieces)}
    for piece in ("で", "日本の", "東"):
        assert words.token_word(ids[piece]) == ids[piece] and words.token_text(ids[piece]) == piece
    glued = [i for i, p in enumerate(pieces) if (t := p.strip("▁")) and not is_word_break(t)
             and (is_word_break(t[0]) or is_word_break(t[-1]))]  # fmt: skip
    assert len(glued) >= 5 and all(words.vocab.non_words[i] for i in glued)
    assert not words.vocab.non_words[ids["▁the"]]


def test_model_rows_beyond_the_tokenizer_are_no_words(texts: list[str]) -> None:
    """A model may have more vocabulary rows than its tokenizer has tokens (DeBERTa-v2): they read as "" and are
    no answer; ids outside the rows are none either."""
    tok = train_tokenizer("bert", texts, vocab_size=500)
    words = WordModel(tok, vocab_size=len(tok) + 5)
    assert len(words.vocab.texts) == len(words.vocab.word_of) == words.vocab_size == len(tok) + 5
    assert words.vocab.texts[-5:] == [""] * 5 and words.vocab.non_words[-5:].all()
    assert words.token_text(tok.cls_token_id) == "[CLS]" and words.vocab.non_words[tok.cls_token_id]
    (the,) = words.pieces_of("the")
    assert words.token_word(the) == the and words.token_text(the) == "the"
    for outside in (-1, words.vocab_size):
        assert words.token_word(outside) == -1 and words.token_text(outside) == ""
    assert words.token_text(words.vocab_size - 1) == ""
