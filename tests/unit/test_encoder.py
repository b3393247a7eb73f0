"""The [MASK] embedding: the layer index, the query path and windowing, against the model computed directly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForMaskedLM

from bertknn.builder.targets import TargetSelector, load_stopwords, masked_ids
from bertknn.core.backend import CompiledBackend
from bertknn.core.encoder import MaskedLMEncoder
from bertknn.core.errors import ModelLoadError, QueryError
from bertknn.core.inputs import MaskedInput
from bertknn.core.runtime import resolve_device


@pytest.fixture(scope="module")
def encoder(tiny_model_dir: Path) -> MaskedLMEncoder:
    return MaskedLMEncoder.load(str(tiny_model_dir), device="cpu", dtype="float32", max_seq_len=32)


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir: Path) -> torch.nn.Module:
    """The same weights loaded independently, used as the plain Hugging Face forward."""
    return AutoModelForMaskedLM.from_pretrained(str(tiny_model_dir)).eval()


def direct(model: torch.nn.Module, item: MaskedInput, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """hidden_states[layer] and log-softmax(logits) at the mask, one unpadded sequence, no encoder code."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([item.input_ids]), output_hidden_states=True)
    return (
        out.hidden_states[layer][0, item.mask_pos].numpy(),
        torch.log_softmax(out.logits[0, item.mask_pos], dim=-1).numpy(),
    )


@pytest.mark.parametrize("layer", [-2, -1, 0, 1])
def test_embedding_is_hidden_state_of_the_layer_at_the_mask(
    tiny_model_dir: Path, reference_model: torch.nn.Module, layer: int
) -> None:
    enc = MaskedLMEncoder.load(str(tiny_model_dir), layer=layer, device="cpu", dtype="float32")
    items = [
        enc.query_input("zorblat was born in [MASK] ."),
        enc.query_input("[MASK] is a large city with a famous bridge near the sea ."),  # longer: padding in batch
        enc.query_input("the bridge of plonk is [MASK]"),
    ]
    out = enc.encode(items, with_mlm=True)
    assert out.embeddings.shape == (3, 32)
    assert out.mlm_log_probs is not None
    for i, item in enumerate(items):
        want_emb, want_logp = direct(reference_model, item, layer)
        np.testing.assert_allclose(out.embeddings[i], want_emb, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(out.mlm_log_probs[i].numpy(), want_logp, rtol=1e-5, atol=1e-5)
    # Different layers give different vectors: the index really selects a layer.
    other = MaskedLMEncoder.load(str(tiny_model_dir), layer=0 if layer != 0 else -1, device="cpu")
    assert not np.allclose(other.encode(items).embeddings, out.embeddings)


def test_default_layer_is_second_to_last(tiny_model_dir: Path, encoder: MaskedLMEncoder) -> None:
    assert encoder.num_layers == 2
    assert encoder.layer == 1  # hidden_states has 3 entries (embeddings + 2 layers); -2 is index 1
    assert MaskedLMEncoder.load(str(tiny_model_dir), layer=-2, device="cpu").layer == 1
    assert MaskedLMEncoder.load(str(tiny_model_dir), layer=-3, device="cpu").layer == 0


@pytest.mark.parametrize("layer", [3, -4, 100])
def test_layer_out_of_range_is_refused(tiny_model_dir: Path, layer: int) -> None:
    with pytest.raises(ModelLoadError, match=r"layer .* out of range.*hidden_states\[0\.\.2\]"):
        MaskedLMEncoder.load(str(tiny_model_dir), layer=layer, device="cpu")


def test_max_seq_len_beyond_the_model_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="max_seq_len=1000"):
        MaskedLMEncoder.load(str(tiny_model_dir), device="cpu", max_seq_len=1000)


def test_unloadable_model_names_it(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no-such-model"):
        MaskedLMEncoder.load(str(tmp_path / "no-such-model"), device="cpu")


def test_a_directory_without_a_model_says_what_a_model_directory_holds(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "notes.txt").write_text("not a model")  # e.g. the parent of the model's directory
    with pytest.raises(ModelLoadError, match=r"not a Hugging Face model directory: it has no config\.json"):
        MaskedLMEncoder.load(str(tmp_path), device="cpu")
    MaskedLMEncoder.load(str(tiny_model_dir), device="cpu")  # the same check passes a real one


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given when CUDA is absent")
def test_cuda_without_a_gpu_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="--device cpu"):
        resolve_device("cuda")


@pytest.mark.parametrize("spelling", ["[MASK]", "[mask]", "[ MASK ]", "[ Mask]", "[\tmask  ]", "<mask>", "< MASK >"])
def test_query_mask_spellings_become_the_mask_token(encoder: MaskedLMEncoder, spelling: str) -> None:
    assert encoder.query_input(f"zorblat was born in {spelling} .") == encoder.query_input("zorblat was born in [MASK] .")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("zorblat was born in quimby .", "exactly one"),
        ("[MASK] was born in [mask] .", "exactly one"),
        ("  [MASK] ", "nothing but"),
    ],
)
def test_queries_without_exactly_one_mask_are_refused(encoder: MaskedLMEncoder, text: str, message: str) -> None:
    with pytest.raises(QueryError, match=message):
        encoder.query_input(text)


@pytest.mark.parametrize("mask_pos", [0, 1, 15, 150, 298, 299])
def test_long_contexts_are_windowed_around_the_mask(encoder: MaskedLMEncoder, mask_pos: int) -> None:
    ids = list(range(100, 400))  # 300 ids, max_seq_len 32
    ids[mask_pos] = encoder.inputs.mask_id
    item = encoder.masked_input(ids, mask_pos)
    tok = encoder.tokenizer
    assert len(item.input_ids) == 32
    assert item.input_ids[0] == tok.cls_token_id and item.input_ids[-1] == tok.sep_token_id
    assert item.input_ids[item.mask_pos] == encoder.inputs.mask_id
    body = list(item.input_ids[1:-1])
    start = ids.index(body[0]) if body[0] != encoder.inputs.mask_id else mask_pos
    assert body == ids[start : start + 30]  # one contiguous window of the original ids
    assert start <= mask_pos < start + 30


def test_long_query_is_windowed_by_the_same_function(encoder: MaskedLMEncoder) -> None:
    text = "quimby is a small town near the sea . " * 20 + "zorblat was born in [MASK] ."
    item = encoder.query_input(text)
    assert len(item.input_ids) == 32
    assert item.input_ids[item.mask_pos] == encoder.inputs.mask_id
    assert encoder.encode([item]).embeddings.shape == (1, 32)


def test_query_and_datastore_context_share_one_input_and_one_embedding(encoder: MaskedLMEncoder) -> None:
    """A datastore context (sentence with its target masked) and the same cloze query embed identically."""
    selector = TargetSelector(encoder.tokenizer, load_stopwords())
    (sentence,) = selector.select(["Zorblat was born in quimby."])
    target = next(t for t in sentence.targets if sentence.text[t.char_start : t.char_end] == "quimby")
    context = encoder.masked_input(*masked_ids(sentence, target, encoder.inputs.mask_id))
    query = encoder.query_input("Zorblat was born in [MASK].")
    assert context == query
    a, b = encoder.encode([context]).embeddings, encoder.encode([query]).embeddings
    np.testing.assert_array_equal(a, b)


def test_query_tokenisation_is_the_tokenizers_whatever_state_the_builder_left(encoder: MaskedLMEncoder) -> None:
    ctx = encoder.inputs
    want = encoder.tokenizer("zorblat was born in [MASK].", add_special_tokens=False)["input_ids"]
    assert ctx.words.query_ids("zorblat was born in [MASK].")[0] == want and ctx.mask_id in want
    # the builder's target selection tokenises with split_special_tokens: "[MASK]" as text
    encoder.tokenizer("a [MASK] b", add_special_tokens=False, split_special_tokens=True)
    assert ctx.words.query_ids("zorblat was born in [MASK].")[0] == want


def test_encode_of_nothing_is_empty(encoder: MaskedLMEncoder) -> None:
    out = encoder.encode([])
    assert out.embeddings.shape == (0, 32)


def test_tiny_model_tokenises_its_corpus_words(encoder: MaskedLMEncoder) -> None:
    """Guards the fixture: a tokenizer that maps everything to [UNK] would make every test here vacuous."""
    ids = encoder.tokenizer("Zorblat was born in quimby.", add_special_tokens=False)["input_ids"]
    assert encoder.tokenizer.unk_token_id not in ids
    assert encoder.tokenizer.convert_ids_to_tokens(ids) == ["zorblat", "was", "born", "in", "quimby", "."]


# ---- the ONNX Runtime backend: the same numbers as the eager forward -------------------------------


@pytest.mark.parametrize(("backend", "layer"), [("onnx", -2), ("onnx", 0), ("onnx", 1)])
def test_compiled_backends_match_the_reference_forward(
    tiny_model_dir: Path, reference_model: torch.nn.Module, backend: str, layer: int
) -> None:
    enc = MaskedLMEncoder.load(str(tiny_model_dir), layer=layer, device="cpu", dtype="float32", max_seq_len=32)
    assert enc.set_backend(backend) == backend and enc.backend == backend
    texts = [
        "zorblat was born in [MASK] .",
        "[MASK] is a large city with a famous bridge near the sea and a river that runs through it to the sea .",
        "the bridge of plonk is [MASK]",
        "[MASK] .",
    ]
    items = [enc.query_input(t) for t in texts]
    # batch sizes and widths other than the traced example's (2 sequences): padding must still be masked
    for batch in (items, items[:1], items[1:3], items[3:]):
        out = enc.encode(batch, with_mlm=True)
        assert out.mlm_log_probs is not None
        for i, item in enumerate(batch):
            want_emb, want_logp = direct(reference_model, item, enc.layer)
            np.testing.assert_allclose(out.embeddings[i], want_emb, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(out.mlm_log_probs[i].numpy(), want_logp, rtol=1e-4, atol=1e-4)
    # the embedding-only path (the builder's) never uses the compiled forward: no LM head there
    np.testing.assert_allclose(enc.encode(items).embeddings[0], direct(reference_model, items[0], enc.layer)[0],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["onnx"])
def test_embedding_only_backend_serves_the_builder_call(
    tiny_model_dir: Path, reference_model: torch.nn.Module, backend: str
) -> None:
    enc = MaskedLMEncoder.load(str(tiny_model_dir), device="cpu", dtype="float32", max_seq_len=32)
    assert enc.set_backend(backend, with_mlm=False) == backend
    items = [enc.query_input(t) for t in ("zorblat was born in [MASK] .", "[MASK] is a large city near the sea .")]
    fast = enc.encode(items)  # the builder's call: embeddings only, compiled
    assert fast.mlm_log_probs is None
    eager = enc.encode(items, with_mlm=True)  # the other call stays eager
    assert eager.mlm_log_probs is not None
    for i, item in enumerate(items):
        want_emb, want_logp = direct(reference_model, item, enc.layer)
        np.testing.assert_allclose(fast.embeddings[i], want_emb, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(eager.embeddings[i], want_emb, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(eager.mlm_log_probs[i].numpy(), want_logp, rtol=1e-5, atol=1e-5)


def test_backend_choice(tiny_model_dir: Path) -> None:
    enc = MaskedLMEncoder.load(str(tiny_model_dir), device="cpu", dtype="float32", max_seq_len=32)
    assert enc.backend == "eager"  # until asked
    assert enc.set_backend("auto") == "onnx"  # the CPU default
    assert enc.set_backend("eager") == "eager" and enc.compiled.fast is None
    with pytest.raises(ValueError, match="auto, eager or onnx"):
        enc.set_backend("torchscript")
    bf16 = MaskedLMEncoder.load(str(tiny_model_dir), device="cpu", dtype="bfloat16", max_seq_len=32)
    assert bf16.set_backend("auto") == "eager"  # onnx runs float32 only


def test_asking_again_for_the_backend_in_use_keeps_it(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    enc = MaskedLMEncoder.load(str(tiny_model_dir), device="cpu", dtype="float32", max_seq_len=32)
    builds: list[str] = []
    real = CompiledBackend._build_onnx

    def counted(self: CompiledBackend) -> object:
        builds.append("onnx")
        return real(self)

    monkeypatch.setattr(CompiledBackend, "_build_onnx", counted)
    assert enc.set_backend("onnx", with_mlm=False) == "onnx" and len(builds) == 1
    fast = enc.compiled.fast
    assert enc.set_backend("onnx", with_mlm=False) == "onnx" and len(builds) == 1 and enc.compiled.fast is fast
    assert enc.set_backend("onnx") == "onnx" and len(builds) == 2  # the other call: built for it
    assert enc.set_backend("eager") == "eager" and enc.compiled.fast is None
    assert enc.set_backend("onnx") == "onnx" and len(builds) == 3  # not kept once another backend was set


def test_an_export_that_fails_or_differs_leaves_the_eager_forward(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    enc = MaskedLMEncoder.load(str(tiny_model_dir), device="cpu", dtype="float32", max_seq_len=32)
    item = enc.query_input("zorblat was born in [MASK] .")
    want = enc.encode([item], with_mlm=True)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("cannot build this")

    monkeypatch.setattr(torch.onnx, "export", broken)
    assert enc.set_backend("onnx") == "eager"
    assert "onnx backend not used (cannot build this)" in caplog.text
    assert enc.set_backend("auto") == "eager"
    monkeypatch.undo()

    def wrong(self: CompiledBackend) -> object:
        return lambda *arrays: (np.zeros((len(arrays[2]), enc.hidden_size), np.float32),
                                torch.zeros(len(arrays[2]), enc.vocab_size))

    monkeypatch.setattr(CompiledBackend, "_build_onnx", wrong)
    assert enc.set_backend("onnx") == "eager"
    assert "onnx differs from the eager forward" in caplog.text
    got = enc.encode([item], with_mlm=True)
    np.testing.assert_array_equal(got.embeddings, want.embeddings)


def test_encode_with_mlm_top_matches_the_full_distribution(encoder: MaskedLMEncoder) -> None:
    from bertknn.core.topk import top_entries

    items = [encoder.query_input("zorblat was born in [MASK] ."), encoder.query_input("[MASK] is red .")]
    out = encoder.encode(items, with_mlm=True, mlm_top=7)
    assert out.mlm_top is not None and out.mlm_log_probs is not None
    values, ids = out.mlm_top
    assert values.shape == ids.shape == (2, 7)
    for i in range(2):
        want_values, want_ids = top_entries(out.mlm_log_probs[i].numpy(), 7)
        assert np.array_equal(ids[i], want_ids) and np.array_equal(values[i], want_values)
        assert (np.diff(values[i]) <= 0).all()
        assert ids[i][0] == int(out.mlm_log_probs[i].argmax())
    with pytest.raises(ValueError, match="mlm_top"):
        encoder.encode(items, with_mlm=False, mlm_top=3)


def test_cache_keys_carry_the_forwards_dtype_and_backend(encoder: MaskedLMEncoder) -> None:
    """A GPU replica (bf16) and a CPU one (float32, ONNX) sharing one Redis never serve each other's encodings."""
    from bertknn.service.cache import InMemoryCache
    from bertknn.service.encoding import QueryEncoder

    inp = encoder.query_input("zorblat was born in [MASK] .")
    queries = QueryEncoder(encoder, InMemoryCache(), key_prefix="t", mlm_top_entries=8)
    was = (encoder.dtype, encoder.compiled.name)
    try:
        encoder.compiled.name = "eager"
        eager_key = queries.key(inp)
        encoder.compiled.name = "onnx"
        onnx_key = queries.key(inp)
        encoder.dtype = torch.bfloat16
        bf16_key = queries.key(inp)
    finally:
        encoder.dtype, encoder.compiled.name = was
    assert len({eager_key, onnx_key, bf16_key}) == 3
    assert encoder.numerics == f"{str(was[0]).removeprefix('torch.')}/{was[1]}"


def test_heads_picked_where_the_forward_ran_equal_the_hosts(encoder: MaskedLMEncoder, monkeypatch: pytest.MonkeyPatch) -> None:
    """The top of p_MLM picked by torch.topk next to the forward (as on a GPU, where only the picked entries then
    cross to the host) is the same set as the host's `top_set` of the whole row, and makes the same encodings."""
    from bertknn.core.topk import top_set
    from bertknn.service.cache import InMemoryCache
    from bertknn.service.encoding import QueryEncoder

    items = [encoder.query_input(t) for t in ("zorblat was born in [MASK] .", "[MASK] is a city .", "the [MASK] sings")]
    emb_d, val_d, ids_d = encoder.encode_heads(items, 40)
    whole = encoder.encode(items, with_mlm=True)  # the host's selection, from the whole rows
    assert whole.mlm_log_probs is not None
    tops = [top_set(row, 40) for row in whole.mlm_log_probs.numpy()]
    emb_h, val_h, ids_h = whole.embeddings, np.stack([v for v, _ in tops]), np.stack([i for _, i in tops])
    np.testing.assert_allclose(emb_d, emb_h, rtol=1e-5, atol=1e-6)
    assert val_d.shape == val_h.shape == (3, 40)
    for row in range(3):
        assert set(ids_d[row].tolist()) == set(ids_h[row].tolist())
        np.testing.assert_allclose(np.sort(val_d[row]), np.sort(val_h[row]), rtol=1e-5, atol=1e-6)
    host = QueryEncoder(encoder, InMemoryCache(), key_prefix="h", mlm_top_entries=40).encode(items)[0]
    monkeypatch.setattr(MaskedLMEncoder, "heads_on_device", property(lambda self: True))
    device = QueryEncoder(encoder, InMemoryCache(), key_prefix="d", mlm_top_entries=40).encode(items)[0]
    for a, b in zip(host, device, strict=True):
        assert a.top_ids.tolist() == b.top_ids.tolist() and a.top_probs.tolist() == b.top_probs.tolist()


def test_encode_async_gives_the_embeddings_in_float16(encoder: MaskedLMEncoder) -> None:
    """The builder's call (on a CPU it embeds at once; on a GPU it queues the forward and the copy back)."""
    from bertknn.core.inputs import PackedInputs

    items = [encoder.query_input(t) for t in ("zorblat was born in [MASK] .", "the [MASK] sings")]
    result = encoder.encode_async(PackedInputs.of(items))
    rows = result()
    assert rows.dtype == np.float16 and rows.shape == (2, encoder.hidden_size)
    np.testing.assert_array_equal(rows, encoder.encode(items).embeddings.astype(np.float16))
