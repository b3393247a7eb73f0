"""The service's model made ready to serve: loaded for a datastore, its forward compiled where that pays, its
thread count set. The same in a full server process and in the split layout's model process."""

from __future__ import annotations

import logging

import torch

from bertknn.core import runtime
from bertknn.core.encoder import MaskedLMEncoder
from bertknn.core.format import read_manifest
from bertknn.core.model_ref import locate_model
from bertknn.core.onnx_cache import onnx_cache
from bertknn.core.vocab_cache import VocabCache
from bertknn.service.settings import ServiceSettings

logger = logging.getLogger(__name__)


def default_threads(workers: int = 1) -> int:
    """torch threads when none are set: the container's CPU quota less one, at least one, split between the
    server processes.

    The spare core serves the event loop, Lucene and the kNN pool; with every core in the model's OpenMP team,
    that work stalls the team at its barriers (docs/decisions/thread-counts.md).
    """
    return max(1, (runtime.cpu_quota_threads() - 1) // max(1, workers))


def prepare_forward(enc: MaskedLMEncoder, settings: ServiceSettings, *, max_rows: int) -> str:
    """The backend the service's forward runs (``model.backend``), and CUDA graphs over it on a GPU
    (``model.cuda_graphs``) for batches of up to ``max_rows``, its results waited for as ``model.cuda_wait``
    says; returns what is in use, for the log."""
    enc.wait.blocking = settings.model.cuda_wait == "block"
    asked = settings.model.backend
    backend = enc.set_backend(asked, onnx_cache=onnx_cache(asked, settings.model.onnx_cache, enc.device))
    if settings.model.cuda_graphs and enc.device.type == "cuda" and enc.compiled.fast is None:
        graphs = enc.eager.use_graphs(enc.query_input, enc.tokenizer.mask_token, max_rows=max_rows,
                                      max_width=enc.max_seq_len, name=enc.name)  # fmt: skip
        backend += " with CUDA graphs" if graphs else ""
    return backend


def load_model(settings: ServiceSettings, *, max_rows: int) -> MaskedLMEncoder:
    """The model of the datastore ``settings`` name (the manifest's, or ``model.name``), ready for batches of up
    to ``max_rows`` rows: the split layout's model process."""
    torch.set_num_threads(settings.model.threads or default_threads(1))
    man = read_manifest(settings.datastore)
    name = locate_model(man.model.name, man.model.path, settings.model.name)
    enc = MaskedLMEncoder.load(
        name, layer=man.layer, device=settings.model.device, dtype=settings.model.dtype,
        max_seq_len=man.max_seq_len, mlm_head="knn-only" if settings.model.knn_only else "required",
    )  # fmt: skip
    vocab_cache = VocabCache.from_setting(settings.model.vocab_cache)
    if vocab_cache is not None:
        enc.words.vocab = vocab_cache.words(enc.words)
    backend = prepare_forward(enc, settings, max_rows=max_rows)
    logger.info("model process: %s, backend %s, %d torch threads", name, backend, torch.get_num_threads())
    return enc
