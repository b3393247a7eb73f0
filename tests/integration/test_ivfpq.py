"""IVF-PQ sizing rule, and a real IVF-PQ index over shards written by the real shard writer."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bertknn.builder.ivfpq import MAX_TRAIN_ROWS, add_ivfpq, plan_ivfpq, read_ivfpq_meta
from bertknn.builder.writer import ShardData, write_shard, write_table
from bertknn.core.format import Datastore, Manifest, ModelInfo, write_manifest
from bertknn.service.retrieval.global_knn import IvfPqKnn

DIM = 32
ROWS_PER_SHARD = 2500
SHARDS = 2


@pytest.mark.parametrize(
    ("rows", "dim", "kind", "nlist", "m", "nbits"),
    [
        (0, 768, "flat", 0, 0, 0),
        (623, 768, "flat", 0, 0, 0),
        (624, 768, "ivfpq", 16, 64, 4),
        (5000, 32, "ivfpq", 128, 32, 7),
        (10_000, 768, "ivfpq", 256, 64, 8),
        (1_000_000, 768, "ivfpq", 4000, 64, 8),
        (1_000_000, 100, "ivfpq", 4000, 50, 8),
        (10**9, 768, "ivfpq", 40960, 64, 8),  # the paper's sizes
    ],
)
def test_plan_scales_the_paper_sizes(rows: int, dim: int, kind: str, nlist: int, m: int, nbits: int) -> None:
    plan = plan_ivfpq(rows, dim)
    assert (plan.kind, plan.nlist, plan.m, plan.nbits) == (kind, nlist, m, nbits)
    if kind == "ivfpq":
        assert plan.code_bytes <= 64
        assert dim % plan.m == 0
        assert plan.train_rows <= min(rows, max(256 * nlist, 39 * 2**nbits), MAX_TRAIN_ROWS)
        assert plan.train_rows >= min(rows, 39 * nlist)


def test_the_paper_plan_has_64_byte_codes() -> None:
    plan = plan_ivfpq(10**9, 768)
    assert plan.code_bytes == 64 and plan.train_rows == MAX_TRAIN_ROWS


@pytest.fixture(scope="module")
def synthetic_datastore(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """5000 clustered float16 vectors in two shards, written by the real shard writer, and a manifest."""
    root = tmp_path_factory.mktemp("ivf") / "ds"
    rng = np.random.default_rng(1338)
    centres = rng.standard_normal((50, DIM)) * 3
    infos = []
    for s in range(SHARDS):
        vectors = (
            centres[rng.integers(0, 50, ROWS_PER_SHARD)] + rng.standard_normal((ROWS_PER_SHARD, DIM))
        ).astype(np.float16)
        data = ShardData(
            vectors=vectors,
            labels=rng.integers(0, 100, ROWS_PER_SHARD).astype(np.int32),
            sentence_ids=np.zeros(ROWS_PER_SHARD, np.int32),
            spans=np.zeros((ROWS_PER_SHARD, 2), np.int32),
            sentences=["A synthetic sentence."],
            articles=[
                {
                    "title": f"Article {s}",
                    "id": str(s),
                    "source": "synthetic",
                    "row_start": 0,
                    "row_end": ROWS_PER_SHARD,
                    "sent_start": 0,
                    "sent_end": 1,
                }
            ],
        )
        infos.append(write_shard(root, s, data))
    manifest = Manifest(
        model=ModelInfo(
            name="synthetic",
            weights_sha256="0" * 64,
            architecture="none",
            num_layers=1,
            hidden_size=DIM,
            vocab_size=100,
        ),
        layer=1,
        max_seq_len=64,
        articles_per_shard=1,
        stopwords_sha256="0" * 64,
        shards=infos,
    )
    manifest.counts.articles = SHARDS
    manifest.counts.sentences = SHARDS
    manifest.counts.contexts = SHARDS * ROWS_PER_SHARD
    write_table(root, manifest, [])
    manifest.datastore_id = manifest.compute_id()
    write_manifest(root, manifest)
    add_ivfpq(root)
    return root


def test_a_real_ivfpq_index_is_built_and_listed(synthetic_datastore: Path) -> None:
    meta = read_ivfpq_meta(synthetic_datastore)
    assert meta["plan"]["kind"] == "ivfpq" and meta["plan"]["nlist"] == 128
    knn = IvfPqKnn(Datastore(synthetic_datastore))
    assert type(knn.index).__name__ == "IndexIVFPQ"
    assert knn.nlist == 128 and knn.nprobe == 64
    assert IvfPqKnn(Datastore(synthetic_datastore), nprobe=1000).nprobe == 128  # capped at nlist


def test_ivfpq_finds_stored_vectors_by_their_global_row(synthetic_datastore: Path) -> None:
    ds = Datastore(synthetic_datastore)
    knn = IvfPqKnn(ds)
    rng = np.random.default_rng(0)
    probes = rng.choice(ds.total_rows, 200, replace=False)
    first = in_top10 = 0
    for g in probes:
        pos, row = ds.locate(int(g))
        dist, rows = knn.search(np.asarray(ds.shards[pos].vectors[row], np.float32), 10)
        assert len(rows) == 10 and np.all(np.diff(dist) >= 0)
        first += int(rows[0] == g)
        in_top10 += int(g in rows)
    # PQ distances are estimates: the stored row itself must still come first for nearly every probe
    assert first >= 190 and in_top10 == 200
    # rows of the second shard carry their global id (shard offset + row)
    dist, rows = knn.search(np.asarray(ds.shards[1].vectors[7], np.float32), 1)
    assert rows[0] == ROWS_PER_SHARD + 7


def test_query_dimension_is_checked(synthetic_datastore: Path) -> None:
    knn = IvfPqKnn(Datastore(synthetic_datastore))
    with pytest.raises(ValueError, match="dimension"):
        knn.search(np.zeros(DIM + 1, np.float32), 3)


def test_the_index_is_trained_on_the_gpus_faiss_has_and_written_from_the_cpu(
    synthetic_datastore: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With faiss-gpu and a GPU (stood in for here: this machine has neither) training and adding go to the GPU
    clone and the index comes back to the CPU; a clone faiss-gpu refuses falls back to the CPU with a warning.
    Either way the same index as the CPU's (same seed, same sample)."""
    import logging

    import faiss

    import bertknn.builder.ivfpq as ivf

    ds = Datastore(synthetic_datastore)
    plan = plan_ivfpq(ds.total_rows, DIM)
    want = faiss.serialize_index(ivf.train_and_fill(ds, plan))  # faiss-cpu: no GPU path
    assert ivf.on_gpus(ivf.new_index(plan), plan) is None
    moves: list[str] = []
    monkeypatch.setattr(faiss, "get_num_gpus", lambda: 1)
    monkeypatch.setattr(faiss, "GpuMultipleClonerOptions", lambda: type("Options", (), {})(), raising=False)

    def to_gpu(index: faiss.Index, co: object = None) -> faiss.Index:
        moves.append("to gpu")
        assert co is not None and co.useFloat16  # type: ignore[attr-defined]
        return index  # the stand-in "GPU index" is the CPU one

    monkeypatch.setattr(faiss, "index_cpu_to_all_gpus", to_gpu, raising=False)
    monkeypatch.setattr(faiss, "index_gpu_to_cpu", lambda index: moves.append("to cpu") or index, raising=False)
    assert faiss.serialize_index(ivf.train_and_fill(ds, plan)).tobytes() == want.tobytes()
    assert moves == ["to gpu", "to cpu"]

    def refuse(index: faiss.Index, co: object = None) -> faiss.Index:
        raise RuntimeError("GPU index does not support this code size")

    monkeypatch.setattr(faiss, "index_cpu_to_all_gpus", refuse, raising=False)
    with caplog.at_level(logging.WARNING, logger="bertknn.builder.ivfpq"):
        assert faiss.serialize_index(ivf.train_and_fill(ds, plan)).tobytes() == want.tobytes()
    assert any("built on the CPU" in r.getMessage() for r in caplog.records)
    flat = plan_ivfpq(100, DIM)  # too few rows for IVF-PQ: an exact index, never cloned
    assert flat.kind == "flat" and ivf.on_gpus(ivf.new_index(flat), flat) is None
