"""``recode``: a compact copy of an fp16 datastore, without running the model again.

The codec is trained on a seeded sample of the source's own vectors (spread over all its rows), every shard's
``vectors.npy`` becomes ``codes.npy``, and everything else is taken as it is (hard links where the file system
allows, else copies): labels, sentences, references, the article table, redirects and the sparse indexes. The
distance scale is measured again (codes change distances); a whole-datastore IVF-PQ index is not carried over
(``bert-knn ivfpq DST`` builds one). The source is left untouched.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

import numpy as np

from bertknn.builder.coding import Coder
from bertknn.builder.ivfpq import gather_rows
from bertknn.builder.writer import link_or_copy, write_shard_files
from bertknn.core.calibration import measure_distance_scale
from bertknn.core.errors import BuildError
from bertknn.core.format import (
    ARTICLE_TABLE,
    MANIFEST,
    REDIRECTS,
    SHARDS_DIR,
    VECTORS,
    Datastore,
    Manifest,
    read_manifest,
    validate_datastore,
    write_manifest,
)
from bertknn.core.format.codec import CodecSpec

logger = logging.getLogger("bertknn.builder")


def _link_tree(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst, copy_function=lambda s, d: link_or_copy(Path(s), Path(d)))


def recode_datastore(src: Path, out: Path, spec: CodecSpec) -> dict:
    """Write ``out``: ``src`` (an fp16 datastore) with its vectors replaced by ``spec``'s codes. Returns a summary."""
    t0 = time.perf_counter()
    src, out = Path(src), Path(out)
    manifest = _recodable(src, out, spec)
    ds = Datastore(src, manifest)
    dim, total = manifest.model.hidden_size, ds.total_rows
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(spec.seed)
    sample = np.sort(rng.choice(total, size=min(total, spec.train_contexts), replace=False))
    coder = Coder(spec, dim)
    info = coder.train(gather_rows(ds, sample), out)
    new = manifest.model_copy(deep=True)
    new.codec = info
    new.shards = []
    for pos, shard in enumerate(ds.shards):
        codes = coder.encode(np.asarray(shard.vectors, dtype=np.float32))
        new.shards.append(write_shard_files(out / SHARDS_DIR / shard.info.name, shard.dir, shard.info, codes))
        ds.shards[pos].release()
    ds.close()
    _link_the_rest(src, out, manifest, new)
    new.distance_scale = measure_distance_scale(out, new)
    new.datastore_id = new.compute_id()
    problems = validate_datastore(out, hashes=False, manifest=new)
    if problems:
        raise BuildError(f"the recoded datastore failed validation: {problems[0]}")
    write_manifest(out, new)
    vec_bytes = sum(s.files[VECTORS].bytes for s in manifest.shards)
    code_bytes = sum(s.files["codes.npy"].bytes for s in new.shards)
    summary = {
        "datastore": str(out), "id": new.datastore_id, "codec": info.factory, "code_bytes": info.code_bytes,
        "contexts": total, "vectors_bytes": vec_bytes, "codes_bytes": code_bytes,
        "temperature_auto": new.distance_scale.model_dump() if new.distance_scale else None,
        "train_s": round(coder.train_seconds, 2), "seconds": round(time.perf_counter() - t0, 2),
    }  # fmt: skip
    logger.info("recode finished: %s", summary)
    assert (out / MANIFEST).is_file()
    return summary


def _recodable(src: Path, out: Path, spec: CodecSpec) -> Manifest:
    """``src``'s manifest, if ``src`` can be recoded with ``spec`` into ``out``; else BuildError saying why."""
    if not spec.trained:
        raise BuildError("recode makes a compact copy: give --codec int8 or --codec pq")
    manifest = read_manifest(src)
    if manifest.codec is not None:
        raise BuildError(f"{src} already stores codes ({manifest.codec.name}); recode an fp16 datastore")
    if manifest.updates:
        raise BuildError(f"{src} was updated by `add` (version {manifest.version}); recode a build or a merge")
    if out.exists() and any(out.iterdir()):
        raise BuildError(f"{out}: not empty; recode into a new directory")
    problems = validate_datastore(src, hashes=False)
    if problems:
        raise BuildError(f"{src} failed validation, so nothing was recoded: {problems[0]}")
    dim = manifest.model.hidden_size
    try:
        spec.check(dim)
    except ValueError as exc:
        raise BuildError(str(exc)) from exc
    total = sum(s.rows for s in manifest.shards)
    if total < spec.min_train(dim):
        raise BuildError(
            f"codec {spec.name} needs at least {spec.min_train(dim)} contexts to train ({spec.factory(dim)}), "
            f"{src} has {total}"
        )
    return manifest


def _link_the_rest(src: Path, out: Path, manifest: Manifest, new: Manifest) -> None:
    """What the codes do not change, linked (else copied) from ``src``: redirects, article table, BM25 and TF-IDF
    indexes (the IVF-PQ index is not: it was trained on the vectors)."""
    for name in (REDIRECTS, manifest.article_table or ARTICLE_TABLE):
        if (src / name).is_file():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            link_or_copy(src / name, out / name)
    new.indexes = {}
    for name, rel in manifest.indexes.items():
        if name in ("bm25", "tfidf"):
            _link_tree(src / rel, out / rel)
            new.indexes[name] = rel
