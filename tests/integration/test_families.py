"""Any masked LM: each family's tiny random model, its tokenizer trained here with the published conventions
(tests/support/families.py), through the real builder, the service and the LAMA evaluation.

What must hold for every family: answers are plain words (``Quimby``, never ``ĠQuimby``, ``▁Quimby`` or
``##by``); a query whose text is a stored context's sentence finds that context first, with its word; no stopword
is a target; a word's occurrences share one label whichever form the tokenizer gave it at that place; entity
answers, ``/follow`` and the LAMA evaluation run.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from bertknn.builder.targets import load_stopwords
from bertknn.core.encoder import MaskedLMEncoder
from bertknn.core.errors import ModelLoadError
from bertknn.core.format import Datastore
from bertknn.evaluation.__main__ import main as evaluation_main
from bertknn.service.main import create_app
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import Query
from bertknn.service.settings import ServiceSettings
from tests.conftest import SHARED_DATA, build_tiny, write_jsonl
from tests.integration.test_entities import linked
from tests.support.families import FAMILIES, make_family_model
from tests.support.neighbours import assert_same_neighbours

# Cased made-up names, each written at a sentence's start (a bare form for byte-level BPE) and inside one.
ARTICLES = [
    linked("1", "Zorblat", "Zorblat was born in Quimby. Zorblat wrote many songs about rivers. He later moved to "
           "the city of Plonk.", [("Quimby", "Quimby"), ("Plonk", "Plonk")]),
    linked("2", "Quimby", "Quimby is a small town near the sea. Quimby is known for fishing and boats. Many poets "
           "live in Quimby. Quimby lies in Vostok.", [("Vostok", "Vostok")]),
    linked("3", "Frelle", "Frelle was born in Vostok. Frelle is a painter of mountains. She studied in Plonk.",
           [("Vostok", "Vostok"), ("Plonk", "Plonk")]),
    linked("4", "Plonk", "Plonk is a large city with a famous bridge. The bridge of Plonk is red. Plonk lies in "
           "Vostok.", [("Vostok", "Vostok")]),
    linked("5", "Vostok", "Vostok is a cold country in the north. Vostok has long winters and deep snow.", []),
]  # fmt: skip
ANSWERS = {"Quimby", "Plonk", "Vostok"}  # one token in every family's vocabulary (the subjects may be several)
# the families whose layers are BERT's: the builder runs the stored layer at the mask rows only (MaskRowCore)
MASK_ROW_FAMILIES = ("bert", "roberta", "xlm-roberta")
PLAIN_WORD = re.compile(r"^[^\W_](?:[\w'.-]*\w)?$")  # letters or digits, no marker, no space


def _training_text() -> list[str]:
    leads = [json.loads(line)["text"] for line in (SHARED_DATA / "wiki" / "vital_articles.jsonl").open()][:400]
    return [a["text"] for a in ARTICLES] * 40 + leads


@pytest.fixture(scope="module", params=FAMILIES)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path]:
    """(family, model directory, datastore): single-piece targets, entity links kept."""
    name = request.param
    root = tmp_path_factory.mktemp(f"family-{name}")
    model = make_family_model(root / "model", name, _training_text(), vocab_size=3000)
    corpus = write_jsonl(root / "corpus.jsonl", ARTICLES)
    ds = build_tiny(root / "ds", [corpus], model)
    return name, model, ds


@pytest.fixture(scope="module")
def client(family: tuple[str, Path, Path]):
    _, model, ds = family
    with TestClient(create_app(ServiceSettings(datastore=ds, model={"name": str(model), "device": "cpu"}))) as c:
        yield c


def _words_of(body: dict) -> list[str]:
    return [p["token"] for key in ("predictions", "mlm", "knn") for p in body[key]]


def _rows(ds: Path) -> list[tuple[str, str, int]]:
    """Every stored word context: (sentence, word as written, label)."""
    store = Datastore(ds)
    out = []
    for shard in store.shards:
        labels, spans, sids = shard.labels, shard.spans, shard.sentence_ids
        for label, (a, b), sid in zip(labels.tolist(), spans.tolist(), sids.tolist(), strict=True):
            if label >= 0:
                sentence = shard.sentence(sid)
                out.append((sentence, sentence[a:b], label))
    return out


def test_the_names_are_single_tokens_so_the_checks_below_bite(family: tuple[str, Path, Path]) -> None:
    _, model, _ = family
    enc = MaskedLMEncoder.load(str(model), device="cpu", max_seq_len=64)
    for name in ANSWERS:
        assert len(enc.words.pieces_of(name)) == 1, name


def test_a_word_keeps_one_label_in_every_form_and_no_stopword_is_a_target(family: tuple[str, Path, Path]) -> None:
    _, _, ds = family
    rows = _rows(ds)
    stop = load_stopwords()
    assert rows and not [w for _, w, _ in rows if w.lower() in stop]
    by_word: dict[str, set[int]] = {}
    for _, word, label in rows:
        by_word.setdefault(word, set()).add(label)
    for name in ANSWERS:
        assert len(by_word[name]) == 1, (name, by_word[name])  # "Quimby is ..." and "... in Quimby." alike


def test_a_stored_context_comes_back_first_with_its_word(family: tuple[str, Path, Path], client: TestClient) -> None:
    """The query is a stored sentence with its word masked: its nearest neighbour is that very context (distance
    0) and the kNN's answer at k=1 is its word, as the datastore shows it."""
    rows = [r for r in _rows(family[2]) if r[1] in ANSWERS]
    assert len(rows) >= 8
    uncased = family[0] in ("bert", "distilbert")
    for sentence, word, _ in rows[:8]:
        at = sentence.index(word)
        text = f"{sentence[:at]}[MASK]{sentence[at + len(word):]}"
        title = next(a["title"] for a in ARTICLES if sentence in a["text"])
        ask = {"text": text, "subject": title, "lambda": 1.0, "top_k": 10, "contexts_per_answer": 8}
        r = client.post("/predict", json={**ask, "k": 1})
        assert r.status_code == 200, r.text
        assert r.json()["knn"][0]["token"] == (word.lower() if uncased else word), (text, r.json()["knn"])
        body = client.post("/predict", json={**ask, "k": 8}).json()
        nearest = next(c for p in body["predictions"] for c in p["contexts"] if c["rank"] == 1)
        assert nearest["sentence"] == f"{sentence[:at]}**{word}**{sentence[at + len(word):]}"
        assert nearest["distance"] == pytest.approx(0.0, abs=1e-3)


def test_answers_are_plain_words_in_the_models_case(family: tuple[str, Path, Path], client: TestClient) -> None:
    name = family[0]
    r = client.post("/predict", json={"text": "Zorblat was born in [MASK].", "subject": "Zorblat", "top_k": 10})
    assert r.status_code == 200, r.text
    words = _words_of(r.json())
    assert words and all(PLAIN_WORD.match(w) for w in words), words
    cased = name not in ("bert", "distilbert")
    assert ("Quimby" if cased else "quimby") in [p["token"] for p in r.json()["knn"]]
    stop = load_stopwords()
    assert not [w for w in (p["token"] for p in r.json()["knn"]) if w.lower() in stop]


def test_the_models_own_mask_spelling_is_the_same_question(family: tuple[str, Path, Path], client: TestClient) -> None:
    """``[MASK]``, the model's own mask token (RoBERTa's ``<mask>``...), ``<mask>`` whatever the model and
    ``[MASK]`` in another case and spacing ask the same question. Where the model's own token is one of those two
    spellings the others are still different texts, so the comparison cannot pass by sending one request twice."""
    mask = MaskedLMEncoder.load(str(family[1]), device="cpu", max_seq_len=64).tokenizer.mask_token
    ask = {"subject": "Zorblat", "top_k": 3}
    texts = [f"Zorblat was born in {m}." for m in dict.fromkeys(["[MASK]", mask, "<mask>", "[mask]", "[ Mask ]"])]
    assert len(texts) == (4 if mask in ("[MASK]", "<mask>") else 5)
    answers = [client.post("/predict", json={"text": t, **ask}).json() for t in texts]
    assert all(a["predictions"] == answers[0]["predictions"] for a in answers[1:])
    assert answers[0]["predictions"] and all(a["cache"]["encoding"] == "hit" for a in answers[1:])  # one input


def test_entity_answers_and_follow(family: tuple[str, Path, Path], client: TestClient) -> None:
    r = client.post("/predict", json={"text": "Zorblat was born in [MASK].", "subject": "Zorblat", "answer": "entity"})
    assert r.status_code == 200, r.text
    entities = [p["entity"]["title"] for p in r.json()["predictions"] if p["entity"]]
    assert "Quimby" in entities
    r = client.post("/follow", json={"subject": "Zorblat", "relations": ["[X] was born in [Y] .", "[X] lies in [Y] ."]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [h["relation"] for h in out["hops"]] == ["[X] was born in [Y] .", "[X] lies in [Y] ."]
    assert out["hops"][0]["entities"] and all(PLAIN_WORD.match(e["title"]) for h in out["hops"] for e in h["entities"])
    assert out["answers"] and out["answers"][0]["path"][0]["title"] == "Zorblat"


def test_the_split_layout_answers_as_the_model_in_the_serving_process(
    family: tuple[str, Path, Path], client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every family through the model process: tokenised in the API process from the model's directory, its
    forward passes and p_MLM entries (merged word forms, RoBERTa's ``Ġ``) made in the model process."""
    from tests.support.split import model_process_here

    _, model, ds = family
    settings = ServiceSettings(datastore=ds, model={"name": str(model), "device": "cpu"})
    asks = [{"text": "Zorblat was born in [MASK].", "subject": "Zorblat", "top_k": 5},
            {"text": "Quimby lies in [MASK].", "top_k": 5},
            {"text": "Zorblat was born in [MASK].", "subject": "Zorblat", "answer": "entity"}]  # fmt: skip
    with model_process_here(settings, tmp_path, monkeypatch), TestClient(create_app(settings)) as split:
        for body in asks:
            got, want = split.post("/predict", json=body).json(), client.post("/predict", json=body).json()
            assert [p["token"] for p in got["predictions"]] == [p["token"] for p in want["predictions"]], body
            for a, b in zip(got["predictions"], want["predictions"], strict=True):
                assert a["prob"] == pytest.approx(b["prob"], abs=1e-5) and a["entity"] == b["entity"]


def test_lama_runs_and_finds_the_stored_facts(family: tuple[str, Path, Path], tmp_path: Path) -> None:
    name, model, ds = family
    lama = tmp_path / "lama"
    (lama / "TREx").mkdir(parents=True)
    (lama / "relations.jsonl").write_text(json.dumps({"relation": "P19", "template": "[X] was born in [Y]."}) + "\n")
    facts = [("Zorblat", "Quimby"), ("Frelle", "Vostok"), ("Zorblat", "New Quimby")]
    (lama / "TREx" / "P19.jsonl").write_text("".join(
        json.dumps({"uuid": f"u{i}", "sub_label": s, "obj_label": o, "predicate_id": "P19", "evidences": []}) + "\n"
        for i, (s, o) in enumerate(facts)))  # fmt: skip
    out = tmp_path / "report.json"
    preds = tmp_path / "predictions.jsonl"
    # the template is the corpus's own sentence, so the nearest context is that sentence's (k=1: a random model's
    # other contexts lie close to it and would outvote it)
    rc = evaluation_main(["lama", "--data", str(lama), "--datastore", str(ds), "--model", str(model), "--out",
                          str(out), "--predictions", str(preds), "--device", "cpu", "--quiet", "--k", "1"])  # fmt: skip
    assert rc == 0
    rows = [json.loads(line) for line in preds.read_text().splitlines()]
    assert len(rows) == 2, rows  # "New Quimby" is two words: not a single-token fact
    report = json.loads(out.read_text())
    assert report["relations"]["P19"]["knn"]["p@1"] == pytest.approx(100.0), (name, rows)


def test_a_checkpoint_without_its_mlm_head_is_refused_in_one_line_or_served_knn_only(
    family: tuple[str, Path, Path], tmp_path: Path
) -> None:
    from safetensors.numpy import load_file, save_file

    _, model, ds = family
    headless = tmp_path / "headless"
    headless.mkdir()
    for f in model.iterdir():
        if f.name != "model.safetensors":
            (headless / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(model / "model.safetensors"))
    enc = MaskedLMEncoder.load(str(model), device="cpu", max_seq_len=64)
    prefix = f"{enc.model.base_model_prefix}."
    base = {k: v for k, v in tensors.items() if k.startswith(prefix) or "embeddings" in k}
    assert len(base) < len(tensors)
    save_file(base, str(headless / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="no MLM head") as err:
        MaskedLMEncoder.load(str(headless), device="cpu", max_seq_len=64)
    assert "\n" not in str(err.value)
    knn_only = MaskedLMEncoder.load(str(headless), device="cpu", max_seq_len=64, mlm_head="knn-only")
    out = knn_only.encode([knn_only.query_input("Zorblat was born in [MASK].")], with_mlm=True)
    assert out.mlm_log_probs is not None
    np.testing.assert_allclose(out.mlm_log_probs.exp().numpy(), 1.0 / knn_only.vocab_size, rtol=1e-5)


def test_onnx_runtime_runs_every_family_and_matches_eager(family: tuple[str, Path, Path]) -> None:
    enc = MaskedLMEncoder.load(str(family[1]), device="cpu", max_seq_len=64)
    queries = [enc.query_input("Zorblat was born in [MASK]."), enc.query_input("[MASK] is a small town near the sea.")]
    eager = enc.encode(queries, with_mlm=True)
    assert enc.set_backend("onnx") == "onnx"
    fast = enc.encode(queries, with_mlm=True)
    np.testing.assert_allclose(fast.embeddings, eager.embeddings, atol=1e-3)
    assert fast.mlm_log_probs is not None and eager.mlm_log_probs is not None
    np.testing.assert_allclose(fast.mlm_log_probs.numpy(), eager.mlm_log_probs.numpy(), atol=1e-3)


def test_every_family_s_exported_graph_is_kept_and_loaded_by_the_next_encoder(
    family: tuple[str, Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from bertknn.core.onnx_cache import OnnxCache

    caplog.set_level(logging.INFO, logger="bertknn.core.backend")
    cache = OnnxCache(tmp_path)
    outputs = []
    for _ in range(2):  # a start, and the next one
        enc = MaskedLMEncoder.load(str(family[1]), device="cpu", max_seq_len=64)
        assert enc.set_backend("onnx", onnx_cache=cache) == "onnx"
        out = enc.encode([enc.query_input("Zorblat was born in [MASK].")], with_mlm=True)
        assert out.mlm_log_probs is not None
        outputs.append((out.embeddings, out.mlm_log_probs.numpy()))
    (kept,) = tmp_path.glob("*.onnx")
    assert f"exported to {kept}" in caplog.text and f"loaded from {kept}" in caplog.text
    for got, want in zip(outputs[1], outputs[0], strict=True):
        np.testing.assert_array_equal(got, want)


def test_the_builder_s_forward_stops_at_the_stored_layer_with_the_same_vectors(family: tuple[str, Path, Path]) -> None:
    """The embeddings-only forward runs the model cut at ``layer``: the same rows as the full model's
    ``hidden_states[layer]`` (computed here with Hugging Face directly), eager and in ONNX Runtime."""
    from transformers import AutoModelForMaskedLM

    enc = MaskedLMEncoder.load(str(family[1]), device="cpu", max_seq_len=64, layer=1)
    assert enc.num_layers > 1 and enc.layer == 1
    assert enc.eager.truncated, f"{family[0]}: the cut model should be in use"
    core = enc.eager.cores[False]
    if family[0] in MASK_ROW_FAMILIES:  # BERT's layers: layer 1 runs at the mask rows, over the embeddings alone
        assert enc.eager.cut == "mask rows" and len(core.below.get_submodule(_layer_list(core.below))) == 0
    else:
        assert enc.eager.cut == "layers" and len(core.base.get_submodule(_layer_list(core.base))) == 1  # not all of them
        assert not enc.eager.last_layer_at_mask
    queries = [enc.query_input("Zorblat was born in [MASK]."), enc.query_input("[MASK] is a small town near the sea.")]
    got = enc.encode(queries).embeddings
    full = AutoModelForMaskedLM.from_pretrained(str(family[1])).eval()
    ids, attn, rows, pos = enc.eager.tensors(queries)
    with torch.no_grad():
        want = full.base_model(input_ids=ids, attention_mask=attn, output_hidden_states=True).hidden_states[1][rows, pos]
    np.testing.assert_allclose(got, want.numpy(), atol=1e-4)
    assert enc.set_backend("onnx", with_mlm=False) == "onnx"
    np.testing.assert_allclose(enc.encode(queries).embeddings, want.numpy(), atol=1e-3)


@pytest.mark.parametrize("name", MASK_ROW_FAMILIES)
def test_the_stored_layer_at_the_mask_rows_gives_every_layer_s_rows(name: str, tmp_path: Path) -> None:
    """`MaskRowCore` at every layer of a 3-layer model (the last one included), on a padded batch with masks at
    the first, a middle and the last word: Hugging Face's own ``hidden_states[layer]`` rows, eager and in ONNX
    Runtime, and the layer above the stored one never runs; the service's forward (its last layer at the mask
    rows) gives Hugging Face's rows and log p_MLM."""
    from transformers import AutoModelForMaskedLM

    model = make_family_model(tmp_path / "model", name, _training_text()[:300], vocab_size=600, layers=3)
    full = AutoModelForMaskedLM.from_pretrained(str(model)).eval()
    texts = ["[MASK] is a small town near the sea.", "Zorblat was born in [MASK].", "Frelle is a [MASK] of mountains."]
    for layer in (1, 2, 3):
        enc = MaskedLMEncoder.load(str(model), device="cpu", max_seq_len=64, layer=layer)
        assert enc.eager.cut == "mask rows"
        core = enc.eager.cores[False]
        assert len(core.below.get_submodule(_layer_list(core.below))) == layer - 1
        queries = [enc.query_input(t) for t in texts]
        ids, attn, rows, pos = enc.eager.tensors(queries)
        assert int(attn.sum(dim=1).min()) < attn.shape[1]  # padded
        with torch.no_grad():
            want = full.base_model(input_ids=ids, attention_mask=attn, output_hidden_states=True).hidden_states[layer]
        np.testing.assert_allclose(enc.encode(queries).embeddings, want[rows, pos].numpy(), atol=1e-5)
        assert enc.set_backend("onnx", with_mlm=False) == "onnx"
        np.testing.assert_allclose(enc.encode(queries).embeddings, want[rows, pos].numpy(), atol=1e-4)
        # the service's forward: the rows at ``layer`` and log p_MLM, the last layer at the mask rows only
        assert enc.eager.last_layer_at_mask == (layer < 3)  # the stored layer must lie below the last one
        if layer == 3:
            continue
        # the reference: the full forward (every layer at every position), p_MLM as the encoder reads it
        reference = MaskedLMEncoder.load(str(model), device="cpu", max_seq_len=64, layer=layer, truncate=False)
        want_p = reference.encode(queries, with_mlm=True).mlm_log_probs
        assert not reference.eager.last_layer_at_mask and want_p is not None
        for backend in ("eager", "onnx"):
            assert enc.set_backend(backend) == backend
            out = enc.encode(queries, with_mlm=True)
            assert out.mlm_log_probs is not None
            np.testing.assert_allclose(out.embeddings, want[rows, pos].numpy(), atol=1e-4)
            np.testing.assert_allclose(out.mlm_log_probs.numpy(), want_p.numpy(), atol=1e-4)


def _layer_list(base: torch.nn.Module) -> str:
    from bertknn.core.truncate import LAYER_LISTS

    for path in LAYER_LISTS:
        try:
            base.get_submodule(path)
            return path
        except AttributeError:
            continue
    raise AssertionError("no layer list")


def test_the_weighted_vote_and_article_weights_hold_for_every_family(family: tuple[str, Path, Path]) -> None:
    """Each family's vote: the weighted one is the plain one times p_MLM ** mlm_prior over the same words (bare
    forms' mass merged into their word's label, as the stored labels are), and without a subject the neighbours of
    lower-scored articles count less; answers stay plain words."""
    pipe = AnswerPipeline.open(family[2], device="cpu")
    try:
        asked = Query("Zorblat was born in [MASK].", subject="Zorblat", top_k=5)
        plain = pipe.predict(replace(asked, mlm_prior=0.0), with_distributions=True).distributions
        weighted = pipe.predict(replace(asked, mlm_prior=1.0), with_distributions=True)
        assert plain is not None and weighted.distributions is not None
        want = np.where(plain.p_knn > 0, plain.p_knn.astype(np.float64) * plain.p_mlm.astype(np.float64), 0.0)
        np.testing.assert_allclose(weighted.distributions.p_knn, want / want.sum(), atol=1e-6)
        assert all(PLAIN_WORD.match(p.token) for p in weighted.predictions)
        ranked = Query("Plonk is a large [MASK] with a famous bridge.", mlm_prior=0.0)
        flat = pipe.predict(replace(ranked, article_sharpness=0.0), with_distributions=True)
        sharp = pipe.predict(replace(ranked, article_sharpness=50.0), with_distributions=True)
        scores = [a.score or 0.0 for a in flat.articles]
        assert len(scores) > 1 and min(scores) < max(scores)  # BM25 ranked several articles, not equally
        assert flat.distributions is not None and sharp.distributions is not None
        assert not np.allclose(flat.distributions.p_knn, sharp.distributions.p_knn)
    finally:
        pipe.close()


def test_the_knn_on_the_device_over_kept_rows_gives_the_hosts_neighbours_and_answers(
    family: tuple[str, Path, Path], client: TestClient
) -> None:
    """``model.knn_device: model`` with the datastore's rows kept on the device (here the CPU's torch): every
    family's hidden states (ModernBERT's long vectors included) searched there give the host's FAISS neighbours,
    and a service started so, its questions voted there too (``model.vote_device``: the family's vocabulary and
    its non-words), answers as the host's does."""
    import torch

    from bertknn.service.device_search import vote_input
    from bertknn.service.device_vote import DeviceVote
    from bertknn.service.retrieval.device_knn import DeviceKnn
    from bertknn.service.retrieval.resident_rows import ResidentRows

    _, model, ds = family
    questions = [{"text": "Zorblat was born in [MASK].", "subject": "Zorblat", "top_k": 5},
                 {"text": "Plonk lies in [MASK].", "top_k": 5},
                 {"text": "Frelle studied in [MASK].", "subject": "Frelle", "answer": "entity", "top_k": 3}]  # fmt: skip
    pipe = AnswerPipeline.open(ds, model=str(model), device="cpu")
    try:
        queries = [Query(**q) for q in questions]  # type: ignore[arg-type]
        encs, _ = pipe.queries.encode([pipe.check_query(q) for q in queries])
        kept = ResidentRows("cpu", lambda nbytes: True)
        assert kept.advance(pipe.datastore) == pipe.datastore.total_rows
        searches = [pipe.neighbours_of.prepare_search(q, pipe.articles.retrieve(q)[0], read=False) for q in queries]
        items = [(e.embedding, s, 8) for e, s in zip(encs, searches, strict=True)]
        found = DeviceKnn("cpu", resident=kept).search(items, [pipe.datastore] * 3)
        for (e, s, k), got in zip(items, found, strict=True):
            assert_same_neighbours(got, s.search(e.astype(np.float32), k))  # (a tiny random ModernBERT has ties)
        # the word questions voted there too: the family's vocabulary and its non-words, the host's answers
        vote = DeviceVote(torch.device("cpu"), pipe.encoder.words.vocab.non_words)
        for q, enc, nbrs in zip(queries[:2], encs[:2], found[:2], strict=True):
            hits = pipe.articles.retrieve(q)[0]
            item = vote_input(pipe.assembler, q, enc, nbrs, hits)
            assert item is not None
            got_a, want_a = (pipe.assembler.answer(q, enc, hits, nbrs, voted=v) for v in (vote.vote([item])[0], None))
            assert [p.token for p in got_a.predictions] == [p.token for p in want_a.predictions], q
            np.testing.assert_allclose([p.prob for p in got_a.predictions], [p.prob for p in want_a.predictions], rtol=1e-6)
            assert [t.token for t in got_a.knn] == [t.token for t in want_a.knn]
    finally:
        pipe.close()
    settings = ServiceSettings(datastore=ds, model={"name": str(model), "device": "cpu", "knn_device": "model",
                                                    "knn_device_rows": "resident", "vote_device": "model"})  # fmt: skip
    with TestClient(create_app(settings)) as device:
        for q in questions:
            got, want = device.post("/predict", json=q).json(), client.post("/predict", json=q).json()
            assert [p["token"] for p in got["predictions"]] == [p["token"] for p in want["predictions"]], q
            np.testing.assert_allclose([p["prob"] for p in got["predictions"]],
                                       [p["prob"] for p in want["predictions"]], rtol=1e-4, atol=1e-6)  # fmt: skip
