"""The whole-datastore FAISS IVF-PQ index behind the ``none`` retriever (the paper's no-retrieval ablation).

The paper searches all of its datastore with IVF-PQ: 40960 inverted lists, 64-byte PQ codes, ``nprobe`` 64,
trained on a sample. :func:`plan_ivfpq` keeps those sizes for large datastores and scales them down for
small ones, by this rule (``n`` rows of dimension ``d``):

- ``nbits`` (bits per PQ sub-code) = 8, or ``floor(log2(n / 39))`` when ``n < 39 * 256``: the PQ's k-means
  needs about 39 training points per centroid (faiss warns below that).
- ``n < 39 * 16 = 624`` (``nbits`` would fall under 4): too few rows to train anything; an exact
  ``IndexFlatL2`` is written instead (it is also faster than IVF-PQ at that size).
- ``nlist = min(40960, floor(4 * sqrt(n)), n // 39)``: faiss's usual ``4 * sqrt(n)`` lists, the paper's
  40960 at most, and 39 training points per list at least.
- ``m`` (sub-quantizers) = the largest divisor of ``d`` not above 64, so codes are at most 64 bytes
  (``d = 768``: 64 x 8 bits = 64 bytes, the paper's size).
- training sample = ``min(n, 256 * nlist, 2_000_000)`` rows drawn uniformly without replacement (seed 0),
  and at least ``39 * 2**nbits``; 2,000,000 rows of ``d = 768`` are 6 GB of float32, enough for 40960 lists.
- ``nprobe`` = 64 (set by the reader, ``bertknn.service.retrieval.global_knn.IvfPqKnn``), at most ``nlist``.

Ids are global row ids (``Datastore.shard_offsets[shard position] + row``): rows are added shard by shard in
manifest order, so faiss's sequential ids are exactly those. The index is written with
``faiss.write_index`` (no pickle) to a temporary file and renamed to ``index/ivfpq.faiss``; the sidecar
``index/ivfpq.json`` records the plan and the shards' content id, so a re-run with the same shards keeps the
index and a reader can tell a stale index from a current one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import faiss
import numpy as np
from tqdm import tqdm

from bertknn.core.errors import DatastoreError
from bertknn.core.format import (
    IVFPQ_FILE,
    PAPER_CODE_BYTES,
    PAPER_NLIST,
    PAPER_NPROBE,
    Datastore,
    Manifest,
    atomic_write_json,
    ivfpq_meta_path,
    naming_write_errors,
    read_ivfpq_meta,
    read_manifest,
    validate_datastore,
    write_manifest,
)

logger = logging.getLogger(__name__)

POINTS_PER_CENTROID = 39
MAX_TRAIN_ROWS = 2_000_000
_ADD_BATCH = 65536


@dataclass(frozen=True)
class IvfPqPlan:
    """The index to build for ``rows`` vectors of dimension ``dim``; see the module docstring for the rule."""

    kind: Literal["ivfpq", "flat"]
    rows: int
    dim: int
    nlist: int = 0
    m: int = 0
    nbits: int = 0
    train_rows: int = 0

    @property
    def code_bytes(self) -> int:
        return math.ceil(self.m * self.nbits / 8) if self.kind == "ivfpq" else 4 * self.dim


def plan_ivfpq(rows: int, dim: int) -> IvfPqPlan:
    """Scale the paper's IVF-PQ sizes to a datastore of ``rows`` vectors."""
    if rows < POINTS_PER_CENTROID * 16:
        return IvfPqPlan("flat", rows, dim)
    nbits = min(8, int(math.floor(math.log2(rows / POINTS_PER_CENTROID))))
    nlist = max(1, min(PAPER_NLIST, int(4 * math.sqrt(rows)), rows // POINTS_PER_CENTROID))
    m = max(x for x in range(1, min(PAPER_CODE_BYTES, dim) + 1) if dim % x == 0)
    train = min(rows, 256 * nlist, MAX_TRAIN_ROWS)
    train = max(train, min(rows, POINTS_PER_CENTROID * 2**nbits))
    return IvfPqPlan("ivfpq", rows, dim, nlist=nlist, m=m, nbits=nbits, train_rows=train)


def new_index(plan: IvfPqPlan) -> faiss.Index:
    """An empty (untrained) faiss index for the plan, squared-L2 metric."""
    if plan.kind == "flat":
        return faiss.IndexFlatL2(plan.dim)
    quantizer = faiss.IndexFlatL2(plan.dim)
    index = faiss.IndexIVFPQ(quantizer, plan.dim, plan.nlist, plan.m, plan.nbits)  # keeps a ref to quantizer
    index.nprobe = min(PAPER_NPROBE, plan.nlist)
    return index


def gather_rows(datastore: Datastore, global_rows: np.ndarray) -> np.ndarray:
    """float32 vectors of the given sorted global rows, read shard by shard from the memory maps."""
    out = np.empty((len(global_rows), datastore.manifest.model.hidden_size), dtype=np.float32)
    pos = np.searchsorted(datastore.shard_offsets, global_rows, side="right") - 1
    for p in np.unique(pos):
        sel = pos == p
        local = global_rows[sel] - datastore.shard_offsets[p]
        out[sel] = datastore.float_rows(int(p), local)
    return out


def on_gpus(index: faiss.Index, plan: IvfPqPlan) -> faiss.Index | None:
    """An IVF-PQ ``index`` cloned onto every GPU faiss sees, or None: faiss-cpu (no GPU support), no GPU, an
    exact index, or one the GPU build of faiss does not take (then the CPU builds it, as without a GPU)."""
    if plan.kind != "ivfpq" or not hasattr(faiss, "index_cpu_to_all_gpus") or faiss.get_num_gpus() < 1:
        return None
    try:
        options = faiss.GpuMultipleClonerOptions()
        options.useFloat16 = True  # PQ lookup tables in float16: what the GPU code needs for 64-byte codes
        return faiss.index_cpu_to_all_gpus(index, co=options)
    except Exception as exc:  # noqa: BLE001 - a faiss RuntimeError naming what the GPU index does not support
        logger.warning("IVF-PQ: faiss-gpu cannot take this index (%s); it is built on the CPU", exc)
        return None


def train_and_fill(datastore: Datastore, plan: IvfPqPlan, *, seed: int = 0) -> faiss.Index:
    """Train the planned index on a row sample, then add every row in global order: on the GPUs when faiss has
    them (`on_gpus`; the index comes back to the CPU to be written), else on the CPU."""
    cpu = new_index(plan)
    gpu = on_gpus(cpu, plan)
    index = gpu if gpu is not None else cpu
    logger.info("IVF-PQ built on %s", f"{faiss.get_num_gpus()} GPU(s)" if gpu is not None else "the CPU")
    if plan.kind == "ivfpq":
        rng = np.random.default_rng(seed)
        sample = np.sort(rng.choice(plan.rows, size=plan.train_rows, replace=False))
        t = time.perf_counter()
        index.train(gather_rows(datastore, sample))
        logger.info("IVF-PQ trained on %d rows in %.1f s", plan.train_rows, time.perf_counter() - t)
    with tqdm(total=plan.rows, desc="ivfpq add", unit="row", dynamic_ncols=True, disable=None) as bar:
        for pos, shard in enumerate(datastore.shards):
            for start in range(0, shard.info.rows, _ADD_BATCH):
                chunk = datastore.float_rows(pos, slice(start, start + _ADD_BATCH))
                index.add(chunk)  # sequential ids: shard by shard in manifest order = global row ids
                bar.update(len(chunk))
    if gpu is not None:
        index = faiss.index_gpu_to_cpu(gpu)
    if index.ntotal != datastore.total_rows:
        raise DatastoreError(f"IVF-PQ index holds {index.ntotal} rows, the datastore {datastore.total_rows}")
    return index


def _meta(manifest: Manifest, plan: IvfPqPlan) -> dict:
    return {"content_id": manifest.compute_id(), "plan": asdict(plan), "faiss": faiss.__version__}


def build_ivfpq(out: Path, manifest: Manifest, *, plan: IvfPqPlan | None = None) -> dict[str, str]:
    """Build ``index/ivfpq.faiss`` over every row of the datastore at ``out`` (kept if already current).

    Returns:
        ``{"ivfpq": "index/ivfpq.faiss"}`` (relative to ``out``) for ``Manifest.indexes``.
    """
    out = Path(out)
    datastore = Datastore(out, manifest)
    plan = plan or plan_ivfpq(datastore.total_rows, manifest.model.hidden_size)
    final = out / IVFPQ_FILE
    meta = _meta(manifest, plan)
    old = read_ivfpq_meta(out)
    if final.is_file() and old.get("content_id") == meta["content_id"] and old.get("plan") == meta["plan"]:
        logger.info("IVF-PQ index %s is current, kept", final)
        return {"ivfpq": IVFPQ_FILE}
    logger.info("IVF-PQ plan: %s (%d bytes per vector)", json.dumps(asdict(plan)), plan.code_bytes)
    t0 = time.perf_counter()
    index = train_and_fill(datastore, plan)
    _write_index(out, IVFPQ_FILE, index, meta, t0)
    return {"ivfpq": IVFPQ_FILE}


def _write_index(root: Path, rel: str, index: faiss.Index, meta: dict, t0: float) -> None:
    """The index file (temp file, fsync, rename), then its sidecar."""
    final = root / rel
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        # Through a Python file object, not faiss.write_index(index, path): a full disk then raises an OSError
        # with its errno (ENOSPC, EFBIG) that the CLI reports in one line, not a faiss RuntimeError.
        with naming_write_errors(tmp), open(tmp, "wb") as f:
            faiss.write_index(index, faiss.PyCallbackIOWriter(f.write))  # type: ignore[attr-defined]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    atomic_write_json(root / ivfpq_meta_path(rel), meta)
    logger.info(
        "IVF-PQ index written: %s",
        json.dumps({"path": str(final), "rows": int(index.ntotal), "bytes": final.stat().st_size,
                    "seconds": round(time.perf_counter() - t0, 2)}),
    )  # fmt: skip


def extend_ivfpq(root: Path, old: Manifest, new: Manifest, rel: str) -> dict[str, str]:
    """Write ``rel``: the old manifest's index plus the rows of the shards ``new`` appends (for ``add``).

    The coarse quantizer and PQ codebooks stay as trained (re-run ``bert-knn ivfpq`` to
    retrain after large updates); rows keep their global ids because new shards come last. Superseded rows stay
    in the index and are skipped at search time (``Datastore.superseded_rows``). The old index file is not
    touched, so the old manifest stays valid until the new one replaces it. An old index that does not match
    its manifest is rebuilt instead.
    """
    root = Path(root)
    t0 = time.perf_counter()
    old_rel = old.indexes.get("ivfpq", IVFPQ_FILE)
    old_meta = read_ivfpq_meta(root, old_rel)
    datastore = Datastore(root, new)
    old_rows = sum(s.rows for s in old.shards)
    index = None
    if old_meta.get("content_id") == old.compute_id() and (root / old_rel).is_file():
        try:
            index = faiss.read_index(str(root / old_rel))
        except RuntimeError as exc:
            logger.warning("IVF-PQ index %s unreadable (%s); rebuilding it", root / old_rel, exc)
    if index is None or index.ntotal != old_rows:
        plan = plan_ivfpq(datastore.total_rows, new.model.hidden_size)
        logger.info("IVF-PQ index of version %d is not current; rebuilding it for version %d", old.version, new.version)
        _write_index(root, rel, train_and_fill(datastore, plan), _meta(new, plan), t0)
        return {"ivfpq": rel}
    known = {s.name for s in old.shards}
    for pos, shard in enumerate(datastore.shards):
        if shard.info.name in known:
            continue
        assert index.ntotal == datastore.shard_offsets[pos], "appended shards must come last"
        for start in range(0, shard.info.rows, _ADD_BATCH):
            index.add(datastore.float_rows(pos, slice(start, start + _ADD_BATCH)))
    if index.ntotal != datastore.total_rows:
        raise DatastoreError(f"IVF-PQ index holds {index.ntotal} rows, the datastore {datastore.total_rows}")
    meta = {**old_meta, "content_id": new.compute_id(), "appended_rows": int(old_meta.get("appended_rows", 0)) + int(index.ntotal) - old_rows}
    _write_index(root, rel, index, meta, t0)
    return {"ivfpq": rel}


def add_ivfpq(root: Path) -> Manifest:
    """Build the IVF-PQ index into a finished datastore and list it in its manifest (``bert-knn ivfpq``).

    The manifest is rewritten atomically with the new index; its ``datastore_id`` does not change (the id
    covers the model and the shards, which this does not touch).
    """
    root = Path(root)
    manifest = read_manifest(root)
    if manifest.slice is not None:
        raise DatastoreError(
            f"{root} is slice {manifest.slice.index} of {manifest.slice.count}; merge the slices first "
            "(`bert-knn merge ... --ivfpq`)"
        )
    problems = validate_datastore(root, hashes=False)
    if problems:
        raise DatastoreError(f"{root} failed validation, so no index was built: {problems[0]}")
    manifest.indexes.update(build_ivfpq(root, manifest))
    write_manifest(root, manifest)
    return manifest
