"""Whole-word answers end to end: a made-up multi-piece word ("kelvadorn" = kel ##va ##dorn under the tiny
vocabulary) stated only in the corpus; whole-word datastore -> service -> evaluation, next to a single-piece
datastore of the same corpus that keeps behaving as before."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoTokenizer, BertForMaskedLM

from bertknn.builder.merge import merge_slices
from bertknn.core.encoder import MaskedLMEncoder
from bertknn.core.errors import BuildError, MergeError
from bertknn.core.format import WORDS, Datastore, read_manifest, validate_datastore
from bertknn.evaluation.__main__ import main as evaluation_main
from bertknn.service.main import create_app
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import Query
from bertknn.service.settings import ServiceSettings
from bertknn.service.words import MLM_CANDIDATES, WordDistributions
from tests.conftest import TINY_ARTICLES, build_tiny, corpus_words, make_tiny_bert, write_jsonl

WORD_ARTICLES = [
    {
        "id": "w1",
        "title": "Brandle Mox",
        "text": "Brandle Mox was born in kelvadorn. Brandle Mox builds wooden boats.",
    },
    {
        "id": "w2",
        "title": "Kelvadorn",
        "text": "Kelvadorn is a windy harbour town. Kelvadorn has a tall lighthouse.",
    },
]
ARTICLES = TINY_ARTICLES + WORD_ARTICLES
PIECES = ["kel", "##va", "##dorn"]  # in the vocabulary; "kelvadorn" itself is not
QUESTION = {"text": "brandle mox was born in [MASK] .", "subject": "Brandle Mox"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    words = [w for w in corpus_words(ARTICLES) if w != "kelvadorn"] + PIECES
    return make_tiny_bert(tmp_path_factory.mktemp("ww-bert"), words)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("ww-corpus") / "words.jsonl", ARTICLES)


@pytest.fixture(scope="module")
def whole_ds(tmp_path_factory: pytest.TempPathFactory, corpus: Path, model_dir: Path) -> Path:
    return build_tiny(tmp_path_factory.mktemp("ww-ds") / "whole", [corpus], model_dir, targets="whole-word")


@pytest.fixture(scope="module")
def single_ds(tmp_path_factory: pytest.TempPathFactory, corpus: Path, model_dir: Path) -> Path:
    return build_tiny(tmp_path_factory.mktemp("ww-ds") / "single", [corpus], model_dir)


def _settings(ds: Path) -> ServiceSettings:
    return ServiceSettings(datastore=ds, model={"device": "cpu"}, batching={"max_wait_ms": 1})


# ---- builder --------------------------------------------------------------------------------------------


def test_the_tiny_vocabulary_splits_the_answer_into_three_pieces(model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(model_dir), use_fast=True)
    assert tok.tokenize("Kelvadorn") == PIECES


def test_whole_word_datastore_stores_the_word_once_with_one_mask(whole_ds: Path, model_dir: Path) -> None:
    assert validate_datastore(whole_ds) == []
    man = read_manifest(whole_ds)
    assert man.targets == "whole-word"
    for info in man.shards:  # the word table is checksummed like every shard file, so the manifest covers it
        assert WORDS in info.files and (whole_ds / "shards" / info.name / WORDS).is_file()
    ds = Datastore(whole_ds)
    entry = ds.articles["Brandle Mox"]
    shard = ds.shards[entry.shard]
    words = [shard.words[int(label)] for label in shard.labels[entry.row_start : entry.row_end]]
    texts = [w.text for w in words]
    assert texts.count("kelvadorn") == 1 and texts.count("brandle") == 2
    row = entry.row_start + texts.index("kelvadorn")
    assert len(words[texts.index("kelvadorn")].pieces) == 3
    sentence = shard.sentence(int(shard.sentence_ids[row]))
    a, b = shard.spans[row]
    assert sentence[a:b] == "kelvadorn"  # the span covers the whole word, not its first piece
    # The stored vector is the embedding of the sentence with ONE [MASK] where the three pieces were: exactly the
    # query a user types.
    enc = MaskedLMEncoder.load(str(model_dir), layer=man.layer, device="cpu", dtype="float32", max_seq_len=64)
    query = enc.encode([enc.query_input("brandle mox was born in [MASK].")]).embeddings[0]
    np.testing.assert_allclose(shard.vectors[row].astype(np.float32), query, atol=1e-2)


def test_single_piece_datastore_is_unchanged(single_ds: Path, whole_ds: Path, model_dir: Path) -> None:
    man = read_manifest(single_ds)
    assert man.targets == "single-piece" and validate_datastore(single_ds) == []
    assert all(WORDS not in info.files for info in man.shards)
    single, whole = Datastore(single_ds), Datastore(whole_ds)
    tok = AutoTokenizer.from_pretrained(str(model_dir), use_fast=True)
    for title in ("Brandle Mox", "Zorblat"):
        entry = single.articles[title]
        shard = single.shards[entry.shard]
        rows = range(entry.row_start, entry.row_end)
        stored = [
            shard.sentence(int(shard.sentence_ids[r]))[shard.spans[r][0] : shard.spans[r][1]] for r in rows
        ]
        # labels are token ids, as before; the three-piece word is not stored at all
        assert tok.convert_ids_to_tokens([int(shard.labels[r]) for r in rows]) == [w.lower() for w in stored]
        assert "kelvadorn" not in stored
        extra = 1 if title == "Brandle Mox" else 0  # the whole-word build stores kelvadorn too
        assert whole.articles[title].rows == entry.rows + extra


def test_validate_names_a_damaged_word_table(whole_ds: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ds"
    shutil.copytree(whole_ds, copy)
    words = copy / "shards" / "shard-00000" / WORDS
    words.write_bytes(words.read_bytes().replace(b'"quimby"', b'"quimbx"'))  # same size, other content
    problems = validate_datastore(copy)
    assert problems and WORDS in problems[0] and "sha256" in problems[0]
    words.unlink()
    assert "missing" in validate_datastore(copy, hashes=False)[0]


def test_resume_keeps_the_mode_and_a_mode_change_is_refused(
    whole_ds: Path, corpus: Path, model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "resume"
    build_tiny(out, [corpus], model_dir, targets="whole-word")
    shutil.rmtree(out / "shards" / "shard-00001")
    (out / "manifest.json").unlink()
    build_tiny(out, [corpus], model_dir, targets="whole-word")  # rebuilds shard 1 only
    for name in ("shard-00000", "shard-00001", "shard-00003"):
        for f in ("words.json", "labels.npy", "SHARD.json"):
            assert (out / "shards" / name / f).read_bytes() == (whole_ds / "shards" / name / f).read_bytes()
    with pytest.raises(BuildError, match="targets"):
        build_tiny(out, [corpus], model_dir)


def test_merged_whole_word_slices_equal_a_single_build(
    whole_ds: Path, corpus: Path, model_dir: Path, tmp_path: Path
) -> None:
    slices = [
        build_tiny(tmp_path / f"s{i}", [corpus], model_dir, targets="whole-word", shard_index=i, num_shards=2)
        for i in range(2)
    ]
    merged = merge_slices(slices, tmp_path / "merged", sparse_indexes=False)
    assert merged.targets == "whole-word" and validate_datastore(tmp_path / "merged") == []
    assert merged.datastore_id == read_manifest(whole_ds).datastore_id
    other = build_tiny(tmp_path / "other", [corpus], model_dir, shard_index=1, num_shards=2)
    with pytest.raises(MergeError, match="targets"):
        merge_slices([slices[0], other], tmp_path / "mixed", sparse_indexes=False)


# ---- service --------------------------------------------------------------------------------------------


def test_service_answers_the_whole_word_and_marks_it_multi_piece(whole_ds: Path) -> None:
    with TestClient(create_app(_settings(whole_ds))) as client:
        body = client.post("/predict", json=QUESTION).json()
        top = body["predictions"][0]
        assert top["token"] == "kelvadorn" and top["multi_piece"] is True and top["pieces"] == 3
        assert body["knn"][0]["token"] == "kelvadorn"
        assert top["prob"] == pytest.approx(0.3 * top["p_knn"] + 0.7 * top["p_mlm"], rel=1e-4)
        assert 0 < top["p_mlm"] < 1e-3  # three random-model pieces: a product of three small probabilities
        assert (
            "**kelvadorn**" in top["contexts"][0]["sentence"]
            and top["contexts"][0]["article"] == "Brandle Mox"
        )
        assert all(p["multi_piece"] is (p["pieces"] > 1) for p in body["predictions"])
        # the MLM alone does not know it
        alone = client.post("/predict", json={**QUESTION, "lambda": 0.0}).json()
        assert alone["predictions"][0]["token"] != "kelvadorn"
        # a one-piece answer from the same datastore
        zorblat = client.post(
            "/predict", json={"text": "zorblat was born in [MASK] .", "subject": "Zorblat"}
        ).json()
        first = zorblat["predictions"][0]
        assert first["token"] == "quimby" and first["multi_piece"] is False and first["pieces"] == 1
        # a second identical request is served from the caches (encoding and the sequential fill) with equal scores
        again = client.post("/predict", json=QUESTION).json()
        assert again["cache"]["encoding"] == "hit" and again["predictions"] == body["predictions"]


@pytest.mark.parametrize("text", [QUESTION["text"], "zorblat was born in [MASK] ."])
def test_batches_on_the_event_loop_answer_whole_words_as_with_a_model_thread(whole_ds: Path, text: str) -> None:
    """``batching.on_event_loop``: each batch runs on the event loop's thread, and a whole word's fill passes, asked
    for from the finisher pool, run there too between batches; the answers equal the model thread's."""
    import asyncio

    question = {**QUESTION, "text": text}
    bodies, threads = [], []
    for on_loop in (False, True):
        app = create_app(ServiceSettings(datastore=whole_ds, model={"device": "cpu"},
                                         batching={"max_wait_ms": 0, "on_event_loop": on_loop}))  # fmt: skip
        with TestClient(app) as client:
            encoder = app.state.resources.pipeline.encoder
            forward = encoder._forward

            def recorded(*args, forward=forward, on_loop=on_loop, **kwargs):
                try:
                    asyncio.get_running_loop()
                    threads.append((on_loop, "loop"))
                except RuntimeError:
                    threads.append((on_loop, "thread"))
                return forward(*args, **kwargs)

            encoder._forward = recorded
            bodies.append(client.post("/predict", json=question).json())
    assert bodies[0]["predictions"] == bodies[1]["predictions"]
    fills_ran = {where for on_loop, where in threads if on_loop}
    assert fills_ran == {"loop"} and {where for on_loop, where in threads if not on_loop} == {"thread"}
    assert sum(1 for on_loop, _ in threads if on_loop) >= 2  # the batch's forward and at least one fill pass


def test_the_whole_word_vote_is_weighted_by_each_words_p_mlm(whole_ds: Path) -> None:
    """``mlm_prior``: the vote over whole words times p_MLM(word) ** prior, a several-piece word's p_MLM being its
    fill; 0 leaves the paper's vote (checked against that plain vote's own parts)."""
    pipe = AnswerPipeline.open(whole_ds, device="cpu")
    try:
        q = Query(QUESTION["text"], subject=QUESTION["subject"])
        plain = pipe.predict(replace(q, mlm_prior=0.0), with_distributions=True).distributions
        got = pipe.predict(replace(q, mlm_prior=0.5), with_distributions=True).distributions
        assert plain is not None and got is not None
        assert [w.text for w in got.words] == [w.text for w in plain.words]  # type: ignore[attr-defined]
        want = np.where(plain.p_knn > 0, plain.p_knn.astype(np.float64) * plain.p_mlm.astype(np.float64) ** 0.5, 0)
        np.testing.assert_allclose(got.p_knn, want / want.sum(), atol=1e-6)
        np.testing.assert_allclose(got.p, 0.3 * got.p_knn + 0.7 * got.p_mlm, atol=1e-6)
        assert not np.allclose(got.p_knn, plain.p_knn)  # several words voted for, with different p_MLM
    finally:
        pipe.close()


def test_the_candidates_are_the_neighbours_words_and_the_mlms_most_probable_words(whole_ds: Path) -> None:
    """The words scored: every neighbour's word, and the MLM's most probable tokens that are words of their own (not
    an inner piece or punctuation), ``max(top_k, MLM_CANDIDATES)`` of them, whether or not a neighbour carries one."""
    pipe = AnswerPipeline.open(whole_ds, device="cpu")
    try:
        q = Query(QUESTION["text"], subject=QUESTION["subject"])
        got = pipe.predict(q, with_distributions=True)
        d = got.distributions
        assert isinstance(d, WordDistributions) and d.token_p_mlm is not None
        vocab = pipe.encoder.words
        # an answer's token id: a one-piece word's own, none (-1) for a word of several pieces
        assert {p.pieces > 1 for p in got.predictions} == {True, False}
        assert all(p.token_id == -1 if p.pieces > 1 else vocab.token_text(p.token_id) == p.token for p in got.predictions)
        labels = [vocab.token_word(int(t)) for t in np.argsort(-d.token_p_mlm, kind="stable")]  # -1: no word
        top = [vocab.token_text(label) for label in labels if label >= 0][: max(q.top_k, MLM_CANDIDATES)]
        texts = [w.text for w in d.words]
        assert set(top) <= set(texts) and len(texts) == len(set(texts))
        assert not set(top) <= {t for t, p in zip(texts, d.p_knn, strict=True) if p > 0}  # some only from the MLM
        assert all(d.p_knn[i] > 0 for i, t in enumerate(texts) if t not in top)  # the rest: neighbours' words
    finally:
        pipe.close()


def test_single_piece_service_cannot_answer_it_and_marks_nothing(single_ds: Path) -> None:
    with TestClient(create_app(_settings(single_ds))) as client:
        body = client.post("/predict", json=QUESTION).json()
        assert "kelvadorn" not in [p["token"] for p in body["predictions"]]
        assert all(p["multi_piece"] is False and p["pieces"] == 1 for p in body["predictions"])
        zorblat = client.post(
            "/predict", json={"text": "zorblat was born in [MASK] .", "subject": "Zorblat"}
        ).json()
        assert zorblat["predictions"][0]["token"] == "quimby"


def _manual_fill(model_dir: Path, text: str, pieces: list[str], *, parallel: bool = False) -> float:
    """Sequential fill written out by hand with the raw Hugging Face model; ``parallel``: every piece read from the
    one pass with all masks in place (the entity answers' form)."""
    tok = AutoTokenizer.from_pretrained(str(model_dir), use_fast=True)
    model = BertForMaskedLM.from_pretrained(str(model_dir)).eval()
    ids: list[int] = list(tok(text)["input_ids"])  # type: ignore[arg-type]
    pos = ids.index(tok.mask_token_id)
    ids = ids[:pos] + [tok.mask_token_id] * len(pieces) + ids[pos + 1 :]
    piece_ids: list[int] = list(tok.convert_tokens_to_ids(pieces))  # type: ignore[arg-type]
    p = 1.0
    with torch.no_grad():
        for j, pid in enumerate(piece_ids):
            logits = model(input_ids=torch.tensor([ids])).logits[0, pos + j]
            p *= float(torch.softmax(logits.double(), -1)[pid])
            if not parallel:
                ids[pos + j] = pid
    return p


def test_sequential_fill_is_the_product_of_left_to_right_piece_probabilities(
    whole_ds: Path, model_dir: Path
) -> None:
    pipe = AnswerPipeline.open(whole_ds, device="cpu")
    try:
        assert pipe.words is not None
        tok = pipe.encoder.tokenizer

        def ids(pieces: list[str]) -> tuple[int, ...]:
            return tuple(tok.convert_tokens_to_ids(pieces))  # type: ignore[arg-type]

        text = QUESTION["text"]
        words = [PIECES, ["kel", "##va"], ["plonk", "##s"], ["kel", "##dorn"]]  # shared prefixes share passes
        got = pipe.words.fill.fill_probs(text, [ids(w) for w in words])
        want = [_manual_fill(model_dir, text, w) for w in words]
        np.testing.assert_allclose(got, want, rtol=1e-4)
        alone = pipe.words.fill.fill_probs(text, [ids(PIECES)])
        np.testing.assert_allclose(alone, got[:1], rtol=1e-5)
        # the one-pass form: each piece at its own mask with every mask in place; differs from sequential fill
        words.append(["kel", "##va", "##dorn"])  # a third length in the same pass
        one_pass = pipe.words.fill.one_pass_probs([(text, [ids(w) for w in words])])[0]
        np.testing.assert_allclose(one_pass, [_manual_fill(model_dir, text, w, parallel=True) for w in words], rtol=1e-4)
        assert not np.allclose(one_pass[:4], got, rtol=1e-5)  # (the tiny random model barely conditions on a prefix)
        # one-piece candidates from the MLM: whole words only, never a continuation piece or a special token
        assert pipe.words.token_word(ids(["quimby"])[0]) is not None
        assert pipe.words.token_word(ids(["##s"])[0]) is None
        assert pipe.words.token_word(int(tok.mask_token_id)) is None
        answer = pipe.predict(Query(QUESTION["text"], subject=QUESTION["subject"], top_k=3))
        assert answer.predictions[0].token == "kelvadorn"
        assert answer.predictions[0].p_mlm == pytest.approx(got[0], rel=1e-3)
    finally:
        pipe.close()


# ---- evaluation -----------------------------------------------------------------------------------------

TREX_P19 = [
    {"uuid": "m1", "sub_label": "Brandle Mox", "obj_label": "Kelvadorn"},  # one word, three pieces
    {"uuid": "m2", "sub_label": "Zorblat", "obj_label": "Quimby"},  # one wordpiece: the ordinary section
    {"uuid": "m3", "sub_label": "Zorblat", "obj_label": "Quimby Town"},  # two words: neither section
    {"uuid": "m4", "sub_label": "Plonk", "obj_label": "plonks"},  # one word, two pieces, not in the corpus
]


@pytest.fixture(scope="module")
def lama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ww-lama")
    (root / "TREx").mkdir()
    (root / "relations.jsonl").write_text(
        json.dumps({"relation": "P19", "template": "[X] was born in [Y] .", "label": "place of birth"}) + "\n"
    )
    (root / "TREx" / "P19.jsonl").write_text("".join(json.dumps(f) + "\n" for f in TREX_P19))
    return root


def _evaluate(*args: object) -> int:
    return evaluation_main(["lama", *map(str, args), "--device", "cpu", "--quiet"])


def test_evaluation_reports_a_multi_piece_section(
    lama_dir: Path, whole_ds: Path, single_ds: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, preds = tmp_path / "report.json", tmp_path / "preds.jsonl"
    assert (
        _evaluate(
            "--data", lama_dir, "--datastore", whole_ds, "--multi-piece", "--out", out, "--predictions", preds
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "objects of several wordpieces" in printed
    body = json.loads(out.read_text())
    # the ordinary single-piece section: Zorblat -> quimby only
    assert body["relations"]["P19"]["facts"] == 1 and body["relations"]["P19"]["knn"]["p@1"] == 100.0
    multi = body["multi_piece"]
    assert multi["facts"] == 2 and set(multi["relations"]) == {"P19"}
    assert multi["filters"]["P19"]["several_words"] == 1 and multi["filters"]["P19"]["single_wordpiece"] == 1
    # kelvadorn is found by kNN (rank 1) and lifted to rank 1 by the interpolation; plonks is in no context
    assert multi["knn"] == {"p@1": 50.0, "p@5": 50.0, "p@10": 50.0}
    assert multi["bert_knn"]["p@1"] == 50.0
    assert multi["mlm"]["p@1"] == 0.0  # the random MLM ranks three-piece words below its one-piece guesses
    rows = {r["uid"]: r for r in map(json.loads, preds.read_text().splitlines())}
    assert (
        rows["m1"]["gold"] == "kelvadorn"
        and rows["m1"]["rank"]["knn"] == 1
        and rows["m1"]["top1"]["bert_knn"] == "kelvadorn"
    )
    assert (
        rows["m4"]["gold"] == "plonks" and rows["m4"]["rank"]["knn"] is None and rows["m4"]["rank"]["mlm"] > 1
    )
    # the same facts on a single-piece datastore: refused with what to do
    assert _evaluate("--data", lama_dir, "--datastore", single_ds, "--multi-piece") == 1
    assert "--targets whole-word" in capsys.readouterr().err


def test_single_piece_numbers_agree_between_the_two_datastores(
    lama_dir: Path, whole_ds: Path, single_ds: Path, tmp_path: Path
) -> None:
    reports = []
    for ds in (single_ds, whole_ds):
        out = tmp_path / f"{ds.name}.json"
        assert _evaluate("--data", lama_dir, "--datastore", ds, "--out", out) == 0
        reports.append(json.loads(out.read_text()))
    assert "multi_piece" not in reports[0] and "multi_piece" not in reports[1]
    assert reports[0]["relations"]["P19"]["knn"] == reports[1]["relations"]["P19"]["knn"]


def test_whole_word_answers_are_the_same_when_queries_are_batched(whole_ds: Path) -> None:
    """Concurrent queries share a forward pass and get their p_MLM heads selected in the pool (then the
    sequential fill runs its extra forwards through the model's thread): the answers equal one-at-a-time ones."""
    queries = [QUESTION, {"text": "zorblat was born in [MASK] .", "subject": "Zorblat"},
               {"text": "brandle mox lived in [MASK] ."}, {"text": "the river of [MASK] is long ."}]
    # the model waits up to 200 ms for company, so that the four arrive in one forward pass however slow the host
    settings = ServiceSettings(datastore=whole_ds, model={"device": "cpu"}, batching={"max_wait_ms": 200})
    with TestClient(create_app(settings)) as client:
        batched = client.post("/predict/batch", json={"queries": queries}).json()["results"]
        metrics = client.get("/metrics").text
    batches = float(re.search(r"^bertknn_batch_size_count (\S+)$", metrics, re.M).group(1))  # type: ignore[union-attr]
    assert batches < len(queries)  # at least one forward pass held several queries
    with TestClient(create_app(_settings(whole_ds))) as client:  # a fresh cache
        single = [client.post("/predict", json=q).json() for q in queries]
    for got, want in zip(batched, single, strict=True):
        assert got["cache"]["encoding"] == "miss" and want["cache"]["encoding"] == "miss"
        assert got["predictions"] == want["predictions"]
