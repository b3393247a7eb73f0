"""Compact datastores: ``build --codec``, resume, ``train-codec`` + slices + ``merge``, ``add``, ``recode``,
``validate``, the service over codes, and ``temperature: auto``.

A tiny BERT with the real bert-base-uncased tokenizer (32 dimensions) over 60 vital articles: a few thousand
contexts, enough to train 8-byte product-quantizer codes (256 centroids each)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

from bertknn.builder.__main__ import main
from bertknn.builder.build import build
from bertknn.builder.coding import load_codec_dir, open_coder
from bertknn.builder.merge import merge_slices
from bertknn.builder.recode import recode_datastore
from bertknn.builder.settings import BuildSettings
from bertknn.core.calibration import STATISTIC, neighbour_scale, sample_neighbours
from bertknn.core.encoder import MaskedLMEncoder
from bertknn.core.errors import BuildError, DatastoreError, MergeError
from bertknn.core.format import (
    CODEC_FILE,
    CODES,
    MANIFEST,
    SHARDS_DIR,
    VECTORS,
    Datastore,
    UpdateInfo,
    read_manifest,
    validate_datastore,
    write_manifest,
)
from bertknn.core.format.codec import CodecSpec
from bertknn.service.main import create_app
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import Query
from bertknn.service.settings import ServiceSettings

REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data"
VITAL = SHARED_DATA / "wiki" / "vital_articles.jsonl"
BERT_TOKENIZER = SHARED_DATA / "tokenizer" / "bert-base-uncased"
PQ = {"codec": "pq", "code_bytes": 8, "codec_rotation": "none", "codec_train_contexts": 2000}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-bert-real-vocab")
    tokenizer = AutoTokenizer.from_pretrained(str(BERT_TOKENIZER), use_fast=True)
    cfg = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=37, max_position_embeddings=512)  # fmt: skip
    torch.manual_seed(0)
    BertForMaskedLM(cfg).eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def corpus(path: Path, start: int, stop: int) -> Path:
    with open(VITAL, encoding="utf-8") as f:
        path.write_text("".join(line for i, line in enumerate(f) if start <= i < stop), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def vital60(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return corpus(tmp_path_factory.mktemp("corpus") / "vital60.jsonl", 0, 60)


def settings(corpus: list[Path], model: Path, out: Path, **overrides: object) -> BuildSettings:
    values: dict[str, object] = dict(
        corpus=corpus, model=str(model), out=out, device="cpu", workers=0, threads=1, batch_size=64,
        articles_per_shard=8, contexts_per_shard=800, sparse_indexes=False,
    )  # fmt: skip
    values.update(overrides)
    return BuildSettings(**values)  # type: ignore[arg-type]


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def pq_store(tmp_path_factory: pytest.TempPathFactory, model_dir: Path, vital60: Path) -> Path:
    out = tmp_path_factory.mktemp("pq") / "ds"
    build(settings([vital60], model_dir, out, **PQ))
    return out


@pytest.fixture(scope="module")
def fp16_store(tmp_path_factory: pytest.TempPathFactory, model_dir: Path, vital60: Path) -> Path:
    out = tmp_path_factory.mktemp("fp16") / "ds"
    build(settings([vital60], model_dir, out, sparse_indexes=True))
    return out


def test_a_pq_build_stores_codes_and_records_its_codec(pq_store: Path, fp16_store: Path) -> None:
    assert validate_datastore(pq_store) == []
    m = read_manifest(pq_store)
    assert m.codec is not None and m.codec.name == "pq" and m.codec.code_bytes == 8
    assert m.codec.factory == "PQ8x8" and m.codec.trained_on == 2000
    assert (pq_store / CODEC_FILE).is_file()
    for info in m.shards:
        assert CODES in info.files and VECTORS not in info.files
        assert not (pq_store / SHARDS_DIR / info.name / VECTORS).exists()
    ref = read_manifest(fp16_store)
    assert m.counts == ref.counts
    # everything but the vectors is what the fp16 build stored
    for a, b in zip(m.shards, ref.shards, strict=True):
        assert {k: v for k, v in a.files.items() if k != CODES} == {k: v for k, v in b.files.items() if k != VECTORS}
    codes = sum(i.files[CODES].bytes for i in m.shards)
    vectors = sum(i.files[VECTORS].bytes for i in ref.shards)
    assert codes < vectors / 6  # 8 bytes per row against 64 (32 float16), plus the .npy headers


def test_the_codes_stand_for_the_vectors(pq_store: Path, fp16_store: Path) -> None:
    coded, exact = Datastore(pq_store), Datastore(fp16_store)
    decoded = np.concatenate([coded.float_rows(p, slice(None)) for p in range(len(coded.shards))])
    true = np.concatenate([exact.float_rows(p, slice(None)) for p in range(len(exact.shards))])
    err = ((decoded - true) ** 2).sum(axis=1).mean()
    spread = ((true - true.mean(axis=0)) ** 2).sum(axis=1).mean()
    assert err < 0.2 * spread, (err, spread)


def test_the_build_measures_its_distance_scale(pq_store: Path, fp16_store: Path) -> None:
    for root in (pq_store, fp16_store):
        scale = read_manifest(root).distance_scale
        assert scale is not None and scale.statistic == STATISTIC and scale.value > 0 and scale.sample > 100
        # the l of a query without neighbours: the factor at the sample's median neighbour scale
        ds = Datastore(root)
        try:
            drawn = sample_neighbours(ds, seed=scale.seed)
        finally:
            ds.close()
        median = float(np.median([s for s in map(neighbour_scale, drawn.distances) if s > 0]))
        assert len(drawn.rows) == scale.sample and scale.typical == pytest.approx(scale.value * median, rel=1e-9)


def test_the_statistics_sample_is_each_contexts_own_article_searched_exactly(fp16_store: Path) -> None:
    """`sample_neighbours` against a brute-force search: each sampled context's k nearest rows of its own article,
    itself left out, by squared L2 over the stored vectors, and which of them carry its word."""
    ds = Datastore(fp16_store)
    try:
        drawn = sample_neighbours(ds, sample=40, k=16, seed=3)
        assert len(drawn.rows) == len(set(drawn.rows)) == 40
        for g, dist, match in zip(drawn.rows, drawn.distances, drawn.matches, strict=True):
            pos, row = ds.locate(g)
            _, labels, ids = ds.article_rows([ds.table.title_at(pos, row)])
            others = ids[ids != g]
            local = others - ds.shard_offsets[pos]
            vectors = ds.float_rows(pos, local).astype(np.float64)
            own = ds.float_rows(pos, np.array([row])).astype(np.float64)[0]
            exact = ((vectors - own) ** 2).sum(axis=1)
            order = np.argsort(exact, kind="stable")[:16]
            np.testing.assert_allclose(dist, exact[order], rtol=1e-4, atol=1e-4)
            own_label = labels[ids == g][0]
            # ties may order two rows either way: compare the count of matches
            assert int(match.sum()) == int((labels[ids != g][order] == own_label).sum())
    finally:
        ds.close()


def test_too_few_contexts_for_the_codec_is_refused_before_any_forward_pass(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = corpus(tmp_path / "one.jsonl", 0, 1)
    calls = []
    real = MaskedLMEncoder.encode
    monkeypatch.setattr(MaskedLMEncoder, "encode", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    with pytest.raises(BuildError, match=r"codec pq needs at least 256 contexts to train \(PQ8x8\), this build has \d+"):
        build(settings([small], model_dir, tmp_path / "ds", **{**PQ, "codec_train_contexts": 100000}))
    assert calls == []
    with pytest.raises(BuildError, match="--code-bytes 12 must divide the 32 coded dimensions"):
        build(settings([small], model_dir, tmp_path / "ds2", codec="pq", code_bytes=12))


def test_an_interrupted_pq_build_resumes_to_the_same_bytes(tmp_path: Path, model_dir: Path, vital60: Path,
                                                            pq_store: Path) -> None:
    out = tmp_path / "ds"
    shutil.copytree(pq_store, out)
    # What a kill after some parts leaves: the codec, build.json and the first shards; no manifest.
    (out / MANIFEST).unlink()
    shards = sorted((out / SHARDS_DIR).iterdir())
    for d in shards[len(shards) // 2 :]:
        shutil.rmtree(d)
    for name in ("articles.sqlite", "redirects.json"):
        (out / name).unlink(missing_ok=True)
    build(settings([vital60], model_dir, out, **PQ))
    assert validate_datastore(out) == []
    assert tree_bytes(out / SHARDS_DIR) == tree_bytes(pq_store / SHARDS_DIR)
    assert (out / MANIFEST).read_bytes() == (pq_store / MANIFEST).read_bytes()
    # and a second build from nothing makes the same bytes too (seeded training)
    again = tmp_path / "again"
    build(settings([vital60], model_dir, again, **PQ))
    assert (again / MANIFEST).read_bytes() == (pq_store / MANIFEST).read_bytes()


def test_ctrl_c_while_the_codec_trains_stops_in_one_line_and_the_same_command_finishes(
    tmp_path: Path, model_dir: Path, vital60: Path, pq_store: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Ctrl-C while the first parts are embedded for the codec's training (nothing is written before it exists)."""
    from bertknn.builder.progress import BuildProgress

    real = BuildProgress.embedded

    def embedded(self: BuildProgress, rows: int) -> None:
        real(self, rows)
        if self.contexts >= 500:  # of the 2,000 the codec trains on
            raise KeyboardInterrupt

    out = tmp_path / "ds"
    argv = ["build", "--corpus", str(vital60), "--model", str(model_dir), "--out", str(out), "--device", "cpu",
            "--workers", "0", "--threads", "1", "--batch-size", "64", "--articles-per-shard", "8",
            "--contexts-per-shard", "800", "--no-sparse-indexes", "--codec", "pq", "--code-bytes", "8",
            "--codec-rotation", "none", "--codec-train-contexts", "2000"]  # fmt: skip
    monkeypatch.setattr(BuildProgress, "embedded", embedded)
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"stopped: {out} keeps 0 finished parts"), err[-2000:]
    monkeypatch.setattr(BuildProgress, "embedded", real)
    assert main(argv) == 0
    assert tree_bytes(out / SHARDS_DIR) == tree_bytes(pq_store / SHARDS_DIR)


def test_slices_share_a_trained_codec_and_merge_to_the_single_build(
    tmp_path: Path, model_dir: Path, vital60: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    codec_dir = tmp_path / "codec"
    common = ["--corpus", str(vital60), "--model", str(model_dir), "--device", "cpu", "--workers", "0",
              "--threads", "1", "--articles-per-shard", "8", "--contexts-per-shard", "800", "--no-sparse-indexes",
              "--codec", "pq", "--code-bytes", "8", "--codec-rotation", "none", "--codec-train-contexts", "2000"]
    # a sliced build must not train a codec per slice
    assert main(["build", *common, "--out", str(tmp_path / "s0"), "--shard-index", "0", "--num-shards", "2"]) == 1
    assert "must share one codec" in capsys.readouterr().err
    assert main(["train-codec", *common, "--out", str(codec_dir)]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["factory"] == "PQ8x8" and (codec_dir / CODEC_FILE).is_file()
    slices = []
    for i in range(2):
        out = tmp_path / f"s{i}"
        argv = ["build", *common, "--out", str(out), "--shard-index", str(i), "--num-shards", "2",
                "--codec-from", str(codec_dir)]
        assert main(argv) == 0
        slices.append(out)
    merged = tmp_path / "merged"
    m = merge_slices(slices, merged, sparse_indexes=False)
    assert validate_datastore(merged) == []
    assert m.codec is not None and m.codec.sha256 == info["sha256"]
    single = tmp_path / "single"
    assert main(["build", *common, "--out", str(single), "--codec-from", str(codec_dir)]) == 0
    assert tree_bytes(merged / SHARDS_DIR) == tree_bytes(single / SHARDS_DIR)
    assert read_manifest(merged).datastore_id == read_manifest(single).datastore_id
    # slices with different codecs do not merge
    other = tmp_path / "other-codec"
    assert main(["train-codec", *common, "--codec-seed", "7", "--out", str(other)]) == 0
    odd = tmp_path / "odd"
    assert main(["build", *common, "--out", str(odd), "--shard-index", "1", "--num-shards", "2",
                 "--codec-from", str(other)]) == 0
    with pytest.raises(MergeError, match="codec"):
        merge_slices([slices[0], odd], tmp_path / "bad", sparse_indexes=False)


def test_add_codes_new_articles_with_the_datastores_codec(tmp_path: Path, model_dir: Path, pq_store: Path) -> None:
    ds = tmp_path / "ds"
    shutil.copytree(pq_store, ds)
    before = read_manifest(ds)
    new = corpus(tmp_path / "more.jsonl", 60, 64)
    assert main(["add", "--datastore", str(ds), "--corpus", str(new), "--device", "cpu", "--threads", "1"]) == 0
    after = read_manifest(ds)
    assert after.version == before.version + 1 and after.codec == before.codec
    added = [i for i in after.shards if i.name in after.updates[-1].shards]
    assert added and all(CODES in i.files for i in added)
    assert validate_datastore(ds) == []
    assert tree_bytes(ds / SHARDS_DIR / before.shards[0].name) == tree_bytes(pq_store / SHARDS_DIR / before.shards[0].name)


def test_recode_makes_a_compact_copy_that_answers(tmp_path: Path, fp16_store: Path) -> None:
    out = tmp_path / "int8"
    summary = recode_datastore(fp16_store, out, CodecSpec("int8"))
    assert summary["code_bytes"] == 32 and summary["codes_bytes"] < summary["vectors_bytes"]
    assert validate_datastore(out) == []
    src, dst = read_manifest(fp16_store), read_manifest(out)
    assert dst.codec is not None and dst.codec.name == "int8" and dst.counts == src.counts
    assert set(dst.indexes) == {"bm25", "tfidf"}
    # the references are shared, not copied
    name = src.shards[0].name
    assert (out / SHARDS_DIR / name / "labels.npy").stat().st_ino == (fp16_store / SHARDS_DIR / name / "labels.npy").stat().st_ino
    with pytest.raises(BuildError, match="already stores codes"):
        recode_datastore(out, tmp_path / "again", CodecSpec("pq", code_bytes=8))
    with pytest.raises(BuildError, match="not empty"):
        recode_datastore(fp16_store, out, CodecSpec("int8"))


def test_recode_refuses_an_fp16_codec_an_updated_and_a_damaged_datastore(tmp_path: Path, fp16_store: Path) -> None:
    with pytest.raises(BuildError, match="^recode makes a compact copy: give --codec int8 or --codec pq$"):
        recode_datastore(fp16_store, tmp_path / "a", CodecSpec("fp16"))
    updated = Path(shutil.copytree(fp16_store, tmp_path / "updated"))
    man = read_manifest(updated)
    write_manifest(updated, man.model_copy(update={"version": 2, "updates": [
        UpdateInfo(version=2, shards=[man.shards[-1].name], added=1, replaced=0, unchanged=0)]}))  # fmt: skip
    with pytest.raises(BuildError, match=f"^{updated} was updated by `add` \\(version 2\\); recode a build or a merge$"):
        recode_datastore(updated, tmp_path / "b", CodecSpec("int8"))
    damaged = Path(shutil.copytree(fp16_store, tmp_path / "damaged"))
    labels = damaged / SHARDS_DIR / man.shards[0].name / "labels.npy"
    labels.write_bytes(labels.read_bytes()[:-4])
    with pytest.raises(BuildError, match=f"^{damaged} failed validation, so nothing was recoded: {labels}: "):
        recode_datastore(damaged, tmp_path / "c", CodecSpec("int8"))
    assert not any((tmp_path / name).exists() for name in ("a", "b", "c"))


def test_codec_from_takes_only_an_intact_codec_of_the_models_width(
    tmp_path: Path, fp16_store: Path, pq_store: Path
) -> None:
    with pytest.raises(BuildError, match=f"^{fp16_store}: its datastore stores fp16 vectors, it has no codec to take$"):
        load_codec_dir(fp16_store)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(BuildError, match="no trained codec there .*; give a `train-codec` output or a datastore$"):
        load_codec_dir(tmp_path / "nothing")
    copy = Path(shutil.copytree(pq_store, tmp_path / "pq"))
    codec_file = copy / CODEC_FILE
    codec_file.write_bytes(codec_file.read_bytes()[:-1] + bytes([codec_file.read_bytes()[-1] ^ 1]))
    with pytest.raises(BuildError, match=f"^{codec_file}: sha256 differs from its description \\(corrupted or "
                       "replaced\\)$"):  # fmt: skip
        load_codec_dir(copy)
    (tmp_path / "out").mkdir()
    width = read_manifest(pq_store).model.hidden_size
    with pytest.raises(BuildError, match=f"the codec codes {width}-dimensional vectors, the model makes {width * 2}$"):
        open_coder(tmp_path / "out", CodecSpec("pq", code_bytes=8), width * 2, codec_from=pq_store)
    assert not any((tmp_path / "out").iterdir())


def test_validate_names_a_damaged_or_unknown_codec(tmp_path: Path, pq_store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ds = tmp_path / "ds"
    shutil.copytree(pq_store, ds)
    raw = bytearray((ds / CODEC_FILE).read_bytes())
    raw[-1] ^= 0xFF
    (ds / CODEC_FILE).write_bytes(bytes(raw))
    assert main(["validate", str(ds)]) == 1
    assert f"{ds / CODEC_FILE}: sha256 mismatch" in capsys.readouterr().err
    shutil.copyfile(pq_store / CODEC_FILE, ds / CODEC_FILE)
    manifest = json.loads((ds / MANIFEST).read_text())
    manifest["codec"]["name"] = "lattice9"
    (ds / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DatastoreError, match="codec 'lattice9', this version reads int8, pq") as err:
        Datastore(ds)
    assert "\n" not in str(err.value)


def test_the_service_searches_codes_and_applies_auto_temperature(pq_store: Path, fp16_store: Path,
                                                                 model_dir: Path) -> None:
    tmp = pq_store.parent / "with-indexes"
    if not tmp.exists():
        recode = recode_datastore(fp16_store, tmp, CodecSpec("pq", code_bytes=8, rotation="none", train_contexts=2000))
        assert recode["code_bytes"] == 8
    auto = read_manifest(tmp).distance_scale
    assert auto is not None
    title = next(iter(Datastore(tmp).articles))
    assert auto.statistic == STATISTIC and auto.typical is not None
    # the l auto stands for: the datastore's factor times the median distance of this query's own neighbours
    body = {"text": "the capital is [MASK] .", "subject": title, "top_k": 3}
    pipe = AnswerPipeline.open(tmp, device="cpu")
    try:
        query = Query(text=body["text"], subject=title, top_k=3)
        encs, _ = pipe.queries.encode([pipe.check_query(query)])
        nbrs = pipe.neighbours_of.neighbours(query, encs[0], pipe.articles.retrieve(query)[0])
        assert len(nbrs) > 2
        want = auto.value * float(np.median(nbrs.distances))
    finally:
        pipe.close()
    app = create_app(ServiceSettings(datastore=tmp, model={"device": "cpu"}, batching={"max_wait_ms": 1}))  # type: ignore[arg-type]
    with TestClient(app) as client:
        r = client.post("/predict", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["temperature_used"] == pytest.approx(want, rel=1e-4)
        assert r.json()["knn"], "no neighbours from the codes"
        r = client.post("/predict", json={**body, "temperature": 3.5})
        assert r.status_code == 200 and r.json()["temperature_used"] == 3.5
        r = client.post("/predict", json={**body, "temperature": "auto"})
        assert r.status_code == 200 and r.json()["temperature_used"] == pytest.approx(want, rel=1e-4)
        r = client.post("/predict", json={**body, "temperature": "hot"})
        assert r.status_code == 422 and "temperature" in r.text


def test_calibrate_records_the_scale_of_an_older_datastore(tmp_path: Path, fp16_store: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    ds = tmp_path / "ds"
    shutil.copytree(fp16_store, ds)
    want = read_manifest(fp16_store).distance_scale
    manifest = json.loads((ds / MANIFEST).read_text())
    del manifest["distance_scale"]  # as a datastore built before the measurement existed
    (ds / MANIFEST).write_text(json.dumps(manifest))
    assert read_manifest(ds).distance_scale is None
    assert main(["calibrate", str(ds)]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["before"] is None and read_manifest(ds).distance_scale == want
    assert read_manifest(ds).datastore_id == read_manifest(fp16_store).datastore_id
    assert validate_datastore(ds) == []
    assert main(["calibrate", str(tmp_path / "nowhere")]) == 1
    from bertknn.cli import main as bert_knn  # the one command reaches the builder's subcommands

    assert bert_knn(["calibrate", str(ds)]) == 0
    assert bert_knn(["recode", "--datastore", str(ds), "--out", str(tmp_path / "pq"), "--codec", "pq",
                     "--code-bytes", "8", "--codec-train-contexts", "2000"]) == 0
    assert read_manifest(tmp_path / "pq").codec is not None
