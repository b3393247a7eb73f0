"""Compact codes for the stored vectors: the codec (a trained FAISS quantizer), encoding, and search over codes.

A datastore stores each context's [MASK] embedding either as it is, in float16 (``fp16``, ``vectors.npy``; no codec),
or as the code of a codec trained once on a sample of its own vectors (``codes.npy``, uint8 [rows, code bytes]):

- ``int8``: FAISS's scalar quantizer ``QT_8bit``, one byte per dimension (a per-dimension range, trained);
- ``pq``: FAISS's product quantizer, ``code_bytes`` sub-quantizers of 8 bits, after a rotation: ``opq`` (learned
  and orthogonal, so distances keep their scale), ``pca`` (to ``pca_dim`` dimensions) or ``none``.

The trained codec is FAISS's own serialisation in ``codec.faiss`` beside the manifest, which records it
(`CodecInfo`). The restricted kNN searches the retrieved articles' codes directly: the query stays float32 and
FAISS's asymmetric distance kernels (ADC) compare it with the codes, reading only those rows.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import faiss
import numpy as np

from bertknn.core.errors import DatastoreError
from bertknn.core.runtime import cpu_quota_threads, faiss_threads

CodecName = Literal["fp16", "int8", "pq"]
Rotation = Literal["opq", "pca", "none"]
CODEC_NAMES: tuple[str, ...] = get_args(CodecName)
READABLE_CODECS = ("int8", "pq")  # what a manifest's `codec.name` may say (fp16 has no codec)
PQ_BITS = 8  # bits per sub-quantizer: 256 centroids each, one byte of code
# auto code size: at least this many dimensions per sub-quantizer (docs/decisions/codecs-and-temperature.md)
AUTO_DIMS_PER_BYTE = 12


@dataclass(frozen=True)
class CodecSpec:
    """What to train: the codec, its code size and rotation, the training sample's size and seed."""

    name: CodecName = "fp16"
    code_bytes: int = 0  # pq: sub-quantizers, one byte each; 0: auto (`pq_bytes`)
    rotation: Rotation = "none"
    pca_dim: int | None = None  # pca: dimensions kept (default: half the model's)
    train_contexts: int = 65536
    seed: int = 0

    @property
    def trained(self) -> bool:
        """Whether this codec is trained (fp16 stores the vectors themselves)."""
        return self.name != "fp16"

    def coded_dim(self, dim: int) -> int:
        """The dimensions the codes quantize: ``dim``, or the PCA's output."""
        if self.name == "pq" and self.rotation == "pca":
            return self.pca_dim or dim // 2
        return dim

    def pq_bytes(self, dim: int) -> int:
        """pq's bytes per code: ``code_bytes``, or for 0 (auto) the most sub-quantizers that each still quantize at
        least ``AUTO_DIMS_PER_BYTE`` dimensions (384 -> 32, 768 -> 64, 1024 -> 64)."""
        if self.code_bytes:
            return self.code_bytes
        coded = self.coded_dim(dim)
        fits = [m for m in _divisors(coded) if coded // m >= AUTO_DIMS_PER_BYTE]
        return max(fits) if fits else 1

    def code_size(self, dim: int) -> int:
        """Bytes per stored code."""
        if self.name == "int8":
            return dim
        if self.name == "pq":
            return self.pq_bytes(dim)
        return 2 * dim

    def factory(self, dim: int) -> str:
        """The FAISS ``index_factory`` string of this codec for vectors of ``dim`` dimensions."""
        if self.name == "int8":
            return "SQ8"
        if self.name != "pq":
            raise ValueError(f"{self.name} has no codec to train")
        m = self.pq_bytes(dim)
        prefix = {"opq": f"OPQ{m},", "pca": f"PCAR{self.coded_dim(dim)},", "none": ""}[self.rotation]
        return f"{prefix}PQ{m}x{PQ_BITS}"

    def min_train(self, dim: int) -> int:
        """The fewest vectors this codec can be trained on: each 8-bit sub-quantizer needs a vector per centroid,
        and a rotation needs at least as many vectors as dimensions; a scalar quantizer needs two."""
        if self.name == "pq":
            return max(1 << PQ_BITS, dim if self.rotation != "none" else 0)
        return 2 if self.name == "int8" else 0

    def check(self, dim: int) -> None:
        """Raise ValueError (one line, what to change) when this codec cannot code vectors of ``dim`` dimensions."""
        if self.name != "pq":
            return
        coded = self.coded_dim(dim)
        if self.rotation == "pca" and not 0 < coded <= dim:
            raise ValueError(f"--pca-dim {coded} must be between 1 and the model's {dim} dimensions")
        m = self.pq_bytes(dim)
        if not 0 < m <= coded or coded % m:
            raise ValueError(
                f"--code-bytes {m} must divide the {coded} coded dimensions "
                f"(e.g. {', '.join(str(m) for m in _divisors(coded) if 8 <= m <= 256)})"
            )


def _divisors(n: int) -> list[int]:
    return [m for m in range(1, n + 1) if n % m == 0]


def train_codec(spec: CodecSpec, vectors: np.ndarray) -> faiss.Index:
    """Train ``spec``'s codec on (a seeded sample of at most ``train_contexts`` of) ``vectors``; deterministic."""
    dim = vectors.shape[1]
    spec.check(dim)
    if len(vectors) < spec.min_train(dim):
        raise ValueError(
            f"codec {spec.name} needs at least {spec.min_train(dim)} vectors to train, got {len(vectors)}"
        )
    rng = np.random.default_rng(spec.seed)
    if len(vectors) > spec.train_contexts:
        pick = np.sort(rng.choice(len(vectors), spec.train_contexts, replace=False))
        vectors = vectors[pick]
    sample = np.ascontiguousarray(vectors, dtype=np.float32)
    index = faiss.index_factory(dim, spec.factory(dim), faiss.METRIC_L2)
    inner = _coded(index)
    if isinstance(inner, faiss.IndexPQ):
        inner.pq.cp.seed = spec.seed + 1234
    # Training uses every core: the service's searches set FAISS to one thread per process, which would
    # otherwise leave a rotation's training (OPQ: 50 rounds of k-means and SVD) on one core.
    with faiss_threads(cpu_quota_threads()):
        index.train(sample)
    return index


def _coded(index: faiss.Index) -> Any:
    """The index that holds the codes (inside a rotation's ``IndexPreTransform``)."""
    if isinstance(index, faiss.IndexPreTransform):
        return faiss.downcast_index(index.index)
    return index


def encode(codec: faiss.Index, vectors: np.ndarray) -> np.ndarray:
    """uint8 codes [n, code bytes] of float vectors."""
    if len(vectors) == 0:
        return np.zeros((0, codec.sa_code_size()), np.uint8)
    return codec.sa_encode(np.ascontiguousarray(vectors, dtype=np.float32))


def decode(codec: faiss.Index, codes: np.ndarray) -> np.ndarray:
    """float32 vectors [n, dim] the codes stand for (in the model's space, a PCA's inverse applied)."""
    if len(codes) == 0:
        return np.zeros((0, codec.d), np.float32)
    return codec.sa_decode(np.ascontiguousarray(codes, dtype=np.uint8))


def code_index(codec: faiss.Index, codes: np.ndarray) -> faiss.Index:
    """A searchable index over given codes (a copy of the trained codec holding them): its ``search`` computes
    squared L2 from a float32 query to each code with FAISS's asymmetric kernels."""
    index = faiss.clone_index(codec)
    inner = _coded(index)
    faiss.copy_array_to_vector(np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1), inner.codes)
    inner.ntotal = len(codes)
    index.ntotal = len(codes)
    return index


class CodeSearcher:
    """Searches codes of one trained codec from any thread, with FAISS's kernels and no copy of the codec per query:
    each thread clones the codec once and swaps each search's codes into its clone (a search runs start to finish
    in one thread, so nothing else touches that clone meanwhile)."""

    def __init__(self, codec: faiss.Index):
        self.codec = codec
        self._local = threading.local()

    def search(self, codes: np.ndarray, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Squared L2 from one float32 query to each code, the ``k`` nearest (distances [1, k], rows [1, k])."""
        index = getattr(self._local, "index", None)
        if index is None:
            index = self._local.index = faiss.clone_index(self.codec)
        inner = _coded(index)
        faiss.copy_array_to_vector(np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1), inner.codes)
        inner.ntotal = index.ntotal = len(codes)
        try:
            return index.search(np.ascontiguousarray(query.reshape(1, -1), dtype=np.float32), k)
        finally:
            inner.ntotal = index.ntotal = 0  # the codes stay until the next search overwrites them


def fp16_index(xb16: np.ndarray) -> faiss.Index:
    """A searchable index over float16 rows, without converting them: their bytes become the codes of a FAISS
    ``QT_fp16`` scalar quantizer (a lossless float16 code) whose kernel reads float16 directly, with neighbours
    identical to an exact float32 search (docs/decisions/fp16-scalar-quantizer-search.md)."""
    n, dim = xb16.shape

    def fill(out: np.ndarray) -> None:
        out[...] = xb16

    return fp16_index_filled(n, dim, fill)


def fp16_index_filled(n: int, dim: int, fill: Callable[[np.ndarray], None]) -> faiss.Index:
    """`fp16_index` over ``n`` rows that ``fill`` writes straight into the index's codes (a float16 [n, dim] view
    of them): rows gathered from several places (articles, memory-mapped shards) are copied once, not first into
    an array of their own and then again into the index."""
    index = faiss.IndexScalarQuantizer(dim, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_L2)
    size = n * dim * 2
    index.codes.resize(size)
    if size:
        fill(faiss.rev_swig_ptr(index.codes.data(), size).view(np.float16).reshape(n, dim))
    index.ntotal = n
    return index


def rows_index(payload: np.ndarray, codec: faiss.Index | None) -> faiss.Index:
    """A searchable index over stored rows: float16 vectors (no codec), or codes of ``codec``; squared L2."""
    return fp16_index(payload) if codec is None else code_index(codec, payload)


def write_codec(path: Path, codec: faiss.Index) -> bytes:
    """FAISS's serialisation of the codec (the bytes written, for a checksum)."""
    data = faiss.serialize_index(codec).tobytes()
    Path(path).write_bytes(data)
    return data


def read_codec(path: Path, code_bytes: int) -> faiss.Index:
    """The trained codec stored at ``path``; DatastoreError in one line when it cannot be read or does not make
    codes of ``code_bytes`` bytes."""
    try:
        codec = faiss.deserialize_index(np.frombuffer(Path(path).read_bytes(), dtype=np.uint8))
    except (OSError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DatastoreError(f"{path}: the codec cannot be read ({first}); rebuild the datastore") from exc
    if not codec.is_trained or codec.sa_code_size() != code_bytes:
        raise DatastoreError(
            f"{path}: the codec makes {codec.sa_code_size()}-byte codes, the manifest says {code_bytes}; "
            "rebuild the datastore"
        )
    return codec
