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


@pytest.mark.parametrize("family", ["roberta", "modernbert", "xlm-roberta", "deberta-v2"])
def test_query_and_context_give_the_same_ids_whatever_the_mask_does_with_its_space(
    family: str, texts: list[str]
) -> None:
    words = WordModel(train_tokenizer(family, texts, vocab_size=2000))
    sentence = "He was born in Paris, the capital of France."
    tok = words.tokenize([sentence])[0]
    for w in words.words(tok):
        query = f"{sentence[: w.start]}[MASK]{sentence[w.end :]}"
        assert words.query_ids(query) == words.masked(tok, w), query
        mask = words.tokenizer.mask_token
        assert words.query_ids(f"{sentence[: w.start]}{mask}{sentence[w.end :]}") == words.masked(tok, w)


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
