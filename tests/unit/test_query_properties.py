"""Property-based tests of the query normaliser and request model: a clear error or a valid input, nothing else."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from transformers import AutoTokenizer

from bertknn.core.context_tokenizer import ContextTokenizer
from bertknn.service.api.schemas import PredictRequest
from tests.conftest import SHARED_DATA

TOKENIZER = SHARED_DATA / "tokenizer" / "bert-base-uncased"

mask_spellings = st.sampled_from(["[MASK]", "[mask]", "[Mask]", "[ MASK ]", "[MA\u200bSK]", "MASK", "[MASK"])
weird_text = st.text(
    alphabet=st.characters(codec="utf-8", categories=["L", "M", "N", "P", "S", "Z", "Cc", "Cf"]), max_size=80
)


@pytest.fixture(scope="module")
def ctx() -> ContextTokenizer:
    return ContextTokenizer(AutoTokenizer.from_pretrained(TOKENIZER), max_seq_len=32)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n_words=st.integers(1, 400), where=st.floats(0, 1), word=st.sampled_from(["paris", "supercalifragilistic", "é" * 50]))
def test_long_texts_are_windowed_around_the_mask(ctx, n_words, where, word):
    words = [word] * n_words
    words.insert(int(where * n_words), "[mask]")
    inp = ctx.query_input(" ".join(words))
    assert len(inp.input_ids) <= 32 and inp.input_ids[inp.mask_pos] == ctx.mask_id


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(
    payload=st.fixed_dictionaries(
        {"text": st.one_of(json_values, st.text(max_size=50))},
        optional={k: json_values for k in ("subject", "top_k", "retriever", "num_articles", "k", "temperature", "lambda")},
    )
)
def test_request_model_accepts_or_says_which_field(payload):
    try:
        req = PredictRequest.model_validate(payload)
    except ValidationError as exc:
        for err in exc.errors():
            assert err["loc"] and err["msg"]
        return
    assert isinstance(req.text, str) and 1 <= len(req.text) <= 2000
    if req.lambda_ is not None:
        assert 0 <= req.lambda_ <= 1
