"""Article retrieval (BM25, TF-IDF, subject lookup) and kNN search (restricted to articles, or whole-datastore).

Names are imported on first use, so importing this package loads neither scikit-learn nor faiss.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "Retriever": "bertknn.service.retrieval.sparse",
    "Bm25Retriever": "bertknn.service.retrieval.sparse",
    "TfidfRetriever": "bertknn.service.retrieval.sparse",
    "strip_mask": "bertknn.service.retrieval.sparse",
    "SubjectResolver": "bertknn.service.retrieval.subject",
    "Resolution": "bertknn.service.retrieval.subject",
    "IvfPqKnn": "bertknn.service.retrieval.global_knn",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(module), name)
