"""The codec during a build: trained once on the first contexts embedded (or taken from ``--codec-from``), stored in
the output directory before any shard of codes is written (a resumed build reuses it), and applied to every part.
``add`` codes its new shards with the datastore's codec; ``merge`` requires the slices to share one."""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import numpy as np

from bertknn.core.errors import BuildError, DatastoreError
from bertknn.core.format import CODEC_FILE, CodecInfo, atomic_write_bytes, atomic_write_json, read_manifest
from bertknn.core.format.codec import CodecSpec, encode, read_codec, train_codec
from bertknn.core.hashing import sha256_file

logger = logging.getLogger("bertknn.builder")

CODEC_INFO = "codec.json"  # beside codec.faiss in a build's directory or a `train-codec` output


@dataclass
class Coder:
    """Turns a part's float16 vectors into what its shard stores: codes of the trained codec."""

    spec: CodecSpec
    dim: int
    codec: faiss.Index | None = None
    info: CodecInfo | None = None
    train_seconds: float = field(default=0.0)

    @property
    def ready(self) -> bool:
        return self.codec is not None

    def min_train(self) -> int:
        return self.spec.min_train(self.dim)

    def train(self, vectors: np.ndarray, out: Path) -> CodecInfo:
        """Train on ``vectors`` (a seeded sample of them), then store the codec in ``out`` (atomically, the
        description last)."""
        t = time.perf_counter()
        try:
            self.codec = train_codec(self.spec, vectors)
        except ValueError as exc:
            raise BuildError(str(exc)) from exc
        self.train_seconds = time.perf_counter() - t
        data = faiss.serialize_index(self.codec).tobytes()
        atomic_write_bytes(out / CODEC_FILE, data)
        self.info = CodecInfo(
            name=self.spec.name,
            sha256=sha256_file(out / CODEC_FILE),
            code_bytes=self.codec.sa_code_size(),
            factory=self.spec.factory(self.dim),
            rotation=self.spec.rotation if self.spec.name == "pq" else "none",
            coded_dim=self.spec.coded_dim(self.dim),
            trained_on=min(len(vectors), self.spec.train_contexts),
            seed=self.spec.seed,
        )
        atomic_write_json(out / CODEC_INFO, self.info.model_dump())
        logger.info(
            "codec %s (%s, %d-byte codes) trained on %d contexts in %.1f s",
            self.info.name, self.info.factory, self.info.code_bytes, self.info.trained_on, self.train_seconds,
        )  # fmt: skip
        return self.info

    def encode(self, vectors: np.ndarray) -> np.ndarray:
        assert self.codec is not None, "train the codec first"
        return encode(self.codec, vectors)


def load_codec_dir(path: Path) -> tuple[faiss.Index, CodecInfo]:
    """The trained codec in ``path``: a `train-codec` output or build directory (codec.json + codec.faiss), or a
    finished datastore (its manifest's codec)."""
    path = Path(path)
    try:
        if (path / CODEC_INFO).is_file():
            info = CodecInfo.model_validate_json((path / CODEC_INFO).read_bytes())
        else:
            manifest = read_manifest(path)
            if manifest.codec is None:
                raise BuildError(f"{path}: its datastore stores fp16 vectors, it has no codec to take")
            info = manifest.codec
        if sha256_file(path / info.file) != info.sha256:
            raise BuildError(f"{path / info.file}: sha256 differs from its description (corrupted or replaced)")
        return read_codec(path / info.file, info.code_bytes), info
    except (OSError, ValueError, DatastoreError) as exc:
        raise BuildError(f"{path}: no trained codec there ({exc}); give a `train-codec` output or a datastore") from exc


def open_coder(out: Path, spec: CodecSpec, dim: int, codec_from: Path | None = None) -> Coder | None:
    """The build's coder (None for fp16): the codec already in ``out`` (resume), else ``codec_from``'s (copied
    into ``out``), else an untrained one (trained on the first contexts embedded)."""
    if codec_from is not None:
        codec, info = load_codec_dir(codec_from)
        if codec.d != dim:
            raise BuildError(f"{codec_from}: the codec codes {codec.d}-dimensional vectors, the model makes {dim}")
        if not (out / CODEC_INFO).is_file():
            shutil.copyfile(Path(codec_from) / info.file, out / f".{CODEC_FILE}.tmp")
            (out / f".{CODEC_FILE}.tmp").replace(out / CODEC_FILE)
            atomic_write_json(out / CODEC_INFO, info.model_dump())
        return Coder(spec, dim, codec, info)
    if not spec.trained:
        return None
    try:
        spec.check(dim)
    except ValueError as exc:
        raise BuildError(str(exc)) from exc
    if (out / CODEC_INFO).is_file():
        codec, info = load_codec_dir(out)
        logger.info("codec %s from the build being resumed (%s)", info.name, out / CODEC_FILE)
        return Coder(spec, dim, codec, info)
    return Coder(spec, dim)
