"""Exported ONNX graphs kept on disk (`bertknn.core.onnx_cache`): loaded by the next encoder of the same weights and
code instead of exported again, never used for other weights, replaced when damaged or wrong."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bertknn.core.encoder import MaskedLMEncoder
from bertknn.core.onnx_cache import OnnxCache, graph_key, onnx_cache
from tests.conftest import TINY_ARTICLES, corpus_words, make_tiny_bert

QUESTIONS = ("zorblat was born in [MASK] .", "[MASK] is a large city near the sea .")


@pytest.fixture
def exports(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The paths `torch.onnx.export` wrote in this test (it still exports)."""
    real, written = torch.onnx.export, []

    def counted(module: object, args: object, path: Path, **kwargs: object) -> object:
        written.append(Path(path))
        return real(module, args, path, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.onnx, "export", counted)
    return written


def load(model_dir: Path) -> MaskedLMEncoder:
    return MaskedLMEncoder.load(str(model_dir), device="cpu", dtype="float32", max_seq_len=32)


def outputs(enc: MaskedLMEncoder) -> tuple[np.ndarray, np.ndarray]:
    out = enc.encode([enc.query_input(q) for q in QUESTIONS], with_mlm=True)
    assert out.mlm_log_probs is not None
    return out.embeddings, out.mlm_log_probs.numpy()


def test_the_next_encoder_of_the_same_model_loads_the_kept_graph(
    tiny_model_dir: Path, tmp_path: Path, exports: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    cache = OnnxCache(tmp_path / "onnx")
    cache.directory.mkdir()
    caplog.set_level(logging.INFO, logger="bertknn.core.backend")
    first = load(tiny_model_dir)
    assert first.set_backend("auto", onnx_cache=cache) == "onnx"
    assert len(exports) == 1 and "exported to" in caplog.text
    kept = sorted(cache.directory.glob("*.onnx"))
    assert len(kept) == 1

    second = load(tiny_model_dir)  # as a process started again would: a new encoder from the same files
    assert second.set_backend("auto", onnx_cache=cache) == "onnx"
    assert len(exports) == 1, "the kept graph was exported again"
    assert f"loaded from {kept[0]}" in caplog.text
    for got, want in zip(outputs(second), outputs(first), strict=True):
        np.testing.assert_array_equal(got, want)
    eager = load(tiny_model_dir)
    for got, want in zip(outputs(second), outputs(eager), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert second.set_backend("auto", with_mlm=False, onnx_cache=cache) == "onnx"
    assert len(exports) == 2 and len(list(cache.directory.glob("*.onnx"))) == 2  # the builder's forward: its own


def test_other_weights_never_load_another_models_graph(tmp_path: Path, exports: list[Path]) -> None:
    words = corpus_words(TINY_ARTICLES)
    a, b = (make_tiny_bert(tmp_path / name, words, seed=seed) for name, seed in (("a", 0), ("b", 1)))
    cache = OnnxCache(tmp_path / "onnx")
    cache.directory.mkdir()
    for model in (a, b, a, b):
        enc = load(model)
        assert enc.set_backend("onnx", onnx_cache=cache) == "onnx"
        for got, want in zip(outputs(enc), outputs(load(model)), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert len(exports) == 2 and len(list(cache.directory.glob("*.onnx"))) == 2


def test_a_damaged_or_wrong_kept_graph_is_exported_again(
    tmp_path: Path, exports: list[Path], caplog: pytest.LogCaptureFixture
) -> None:
    words = corpus_words(TINY_ARTICLES)
    a, b = (make_tiny_bert(tmp_path / name, words, seed=seed) for name, seed in (("a", 0), ("b", 1)))
    cache = OnnxCache(tmp_path / "onnx")
    cache.directory.mkdir()
    assert load(a).set_backend("onnx", onnx_cache=cache) == "onnx"
    (kept_a,) = cache.directory.glob("*.onnx")
    assert load(b).set_backend("onnx", onnx_cache=cache) == "onnx"
    (kept_b,) = set(cache.directory.glob("*.onnx")) - {kept_a}

    kept_a.write_bytes(kept_a.read_bytes()[:1000])  # a disk that filled up, a copy cut short
    enc = load(a)
    assert enc.set_backend("onnx", onnx_cache=cache) == "onnx"
    assert "kept ONNX graph" in caplog.text and len(exports) == 3
    for got, want in zip(outputs(enc), outputs(load(a)), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

    caplog.clear()
    shutil.copyfile(kept_b, kept_a)  # a graph that loads and runs, with another model's weights
    enc = load(a)
    assert enc.set_backend("onnx", onnx_cache=cache) == "onnx"
    assert "differs from the eager forward" in caplog.text and len(exports) == 4
    for got, want in zip(outputs(enc), outputs(load(a)), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_a_graph_that_still_differs_once_exported_again_leaves_eager_and_nothing_kept(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bertknn.core import backend

    cache = OnnxCache(tmp_path / "onnx")
    cache.directory.mkdir()

    def wrong(path: Path) -> object:
        return lambda *arrays: (np.zeros((len(arrays[2]), 32), np.float32), None)

    monkeypatch.setattr(backend, "load_onnx", wrong)
    enc = load(tiny_model_dir)
    assert enc.set_backend("onnx", onnx_cache=cache) == "eager"
    assert not list(cache.directory.glob("*.onnx"))


def test_processes_starting_together_export_once(tmp_path: Path) -> None:
    cache = OnnxCache(tmp_path)
    calls: list[Path] = []

    def slow_export(path: Path) -> None:
        calls.append(path)
        time.sleep(0.3)
        path.write_bytes(b"graph")

    got: list[tuple[Path, bool]] = []
    threads = [threading.Thread(target=lambda: got.append(cache.graph("k", slow_export))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert sorted(kept for _, kept in got) == [False, True, True]
    assert {path for path, _ in got} == {tmp_path / "k.onnx"} and (tmp_path / "k.onnx").read_bytes() == b"graph"
    assert not list(tmp_path.glob("*.tmp"))


def test_a_new_graph_makes_room_by_deleting_the_least_recently_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bertknn.core import onnx_cache as module

    monkeypatch.setattr(module, "KEEP", 3)
    cache = OnnxCache(tmp_path)

    def export(path: Path) -> None:
        path.write_bytes(b"graph")

    def used(key: str) -> None:
        time.sleep(0.02)  # each use at a later modification time than the one before
        cache.graph(key, export)

    for key in ("a", "b", "c"):
        used(key)
    used("a")  # used again: now the most recent
    used("d")  # a fourth graph: b, the least recently used, goes
    assert sorted(p.stem for p in tmp_path.glob("*.onnx")) == ["a", "c", "d"]
    used("e")
    assert sorted(p.stem for p in tmp_path.glob("*.onnx")) == ["a", "d", "e"]


def test_an_export_that_fails_leaves_nothing_kept(tmp_path: Path) -> None:
    cache = OnnxCache(tmp_path)

    def failing(path: Path) -> None:
        path.write_bytes(b"half a gra")
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        cache.graph("k", failing)
    assert not list(tmp_path.glob("*.onnx")) and not list(tmp_path.glob("*.tmp"))


def test_nothing_is_made_on_disk_where_nothing_is_exported(tmp_path: Path) -> None:
    """(The setting's directory itself: tests/unit/test_disk_cache.py.)"""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for backend, device in (("eager", cpu), ("auto", cuda)):  # nothing exported: nothing made on disk
        assert onnx_cache(backend, str(tmp_path / "unused"), device) is None and not (tmp_path / "unused").exists()
    for backend in ("auto", "onnx"):
        used = onnx_cache(backend, str(tmp_path / backend), cpu)
        assert used is not None and used.directory == tmp_path / backend


def test_the_key_follows_the_weights_the_module_and_its_settings(tiny_model_dir: Path) -> None:
    enc = load(tiny_model_dir)
    core = enc.eager.cores[True]
    key = graph_key(core, weights_sha256=enc.weights_sha256, export={"opset_version": 17})
    assert key == graph_key(load(tiny_model_dir).eager.cores[True], weights_sha256=enc.weights_sha256,
                            export={"opset_version": 17})  # fmt: skip
    assert key != graph_key(core, weights_sha256="0" * 64, export={"opset_version": 17})
    assert key != graph_key(core, weights_sha256=enc.weights_sha256, export={"opset_version": 18})
    assert key != graph_key(enc.eager.cores[False], weights_sha256=enc.weights_sha256, export={"opset_version": 17})
    other_layer = MaskedLMEncoder.load(str(tiny_model_dir), device="cpu", dtype="float32", max_seq_len=32, layer=0)
    assert key != graph_key(other_layer.eager.cores[True], weights_sha256=enc.weights_sha256,
                            export={"opset_version": 17})  # fmt: skip


def test_the_service_and_the_builder_keep_their_graphs_where_their_settings_say(
    tiny_datastore: Path, tiny_corpus: Path, tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from bertknn.service.main import open_pipeline
    from bertknn.service.settings import ServiceSettings
    from tests.conftest import build_tiny

    caplog.set_level(logging.INFO, logger="bertknn.core.backend")
    settings = ServiceSettings(datastore=tiny_datastore, model={"device": "cpu", "onnx_cache": str(tmp_path / "svc")})
    for _ in range(2):  # a start, and the next one (a restart, a replaced worker, a reload)
        pipe = open_pipeline(settings)
        try:
            assert pipe.encoder.backend == "onnx"
        finally:
            pipe.close()
    (kept,) = (tmp_path / "svc").glob("*.onnx")
    assert f"exported to {kept}" in caplog.text and f"loaded from {kept}" in caplog.text

    build_tiny(tmp_path / "ds", [tiny_corpus], tiny_model_dir, onnx_cache=str(tmp_path / "builder"))
    (built,) = (tmp_path / "builder").glob("*.onnx")  # the builder's forward (embeddings only): a graph of its own
    assert built.name != kept.name
    off = ServiceSettings(datastore=tiny_datastore, model={"device": "cpu", "onnx_cache": "off"})
    caplog.clear()
    pipe = open_pipeline(off)
    pipe.close()
    assert pipe.encoder.backend == "onnx" and "ONNX graph" not in caplog.text
