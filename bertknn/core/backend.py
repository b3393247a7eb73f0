"""Which forward an encoder runs: the eager one, or ONNX Runtime's, used only once it matched the eager one."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from bertknn.core.eager import EagerForward
from bertknn.core.inputs import MaskedInput
from bertknn.core.onnx_cache import OnnxCache, graph_key
from bertknn.core.onnx_forward import (
    EXPORT,
    FastForward,
    build_onnx,
    check_fast,
    export_onnx,
    load_onnx,
    outputs_of,
)

logger = logging.getLogger(__name__)


class CompiledBackend:
    """The compiled forward of one encoder (`MaskedLMEncoder.set_backend`), built from its eager modules.

    ``fast``: the compiled forward in use, or None (eager); ``with_mlm``: the call it serves; ``name``: the
    backend in use (part of every cache key, through `MaskedLMEncoder.numerics`). ``weights_sha256``: the
    model's weights, part of the key of an exported graph kept on disk (`bertknn.core.onnx_cache`)."""

    def __init__(self, eager: EagerForward, query_input: Callable[[str], MaskedInput], mask: str, model_name: str,
                 weights_sha256: str):  # fmt: skip
        self.eager, self._query_input, self._mask, self._model = eager, query_input, mask, model_name
        self._weights = weights_sha256
        self.fast: FastForward | None = None
        self.name = "eager"
        self.with_mlm = True
        self._asked: tuple[str, bool] | None = None  # the `set` call that built ``fast``

    def set(self, backend: str, with_mlm: bool, cache: OnnxCache | None = None) -> str:
        """See `MaskedLMEncoder.set_backend`. Returns the backend in use."""
        if backend not in ("auto", "eager", "onnx"):
            raise ValueError(f"backend must be auto, eager or onnx, not {backend!r}")
        if self.fast is not None and self._asked == (backend, with_mlm):
            return self.name
        if backend == "auto":
            order = ["onnx"] if self.eager.device.type == "cpu" else []
        else:
            order = [] if backend == "eager" else [backend]
        self.fast, self.name, self.with_mlm, self._asked = None, "eager", with_mlm, None
        if order and with_mlm and self.eager.head is None:
            logger.warning("%s: no single LM head module; the eager backend stays in use", self._model)
            return self.name
        for want in order:
            try:
                fast = self._onnx(want, cache)
            except Exception as exc:  # noqa: BLE001 - any failure to build or match falls back
                logger.warning("%s: %s backend not used (%s)", self._model, want, exc)
                continue
            self.fast, self.name, self._asked = fast, want, (backend, with_mlm)
            break
        return self.name

    def _core_and_example(self) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
        mask = self._mask
        # padded (two lengths), so that the attention mask is part of the traced or exported graph
        example = [self._query_input(f"the {mask} ."), self._query_input(f"a b c d e f g h {mask} i j .")]
        return self.eager.cores[self.with_mlm], self.eager.tensors(example)

    def _onnx(self, want: str, cache: OnnxCache | None) -> FastForward:
        """The ONNX forward, matched against the eager one: kept in ``cache`` (`_cached_onnx`), or exported anew."""
        if self.eager.device.type != "cpu" or self.eager.dtype != torch.float32:
            raise RuntimeError("the onnx backend runs float32 on the CPU")
        if cache is not None:
            return self._cached_onnx(want, cache)
        fast = self._build_onnx()
        self._check_against_eager(fast, want)
        return fast

    def _build_onnx(self) -> FastForward:
        return build_onnx(*self._core_and_example())

    def _cached_onnx(self, want: str, cache: OnnxCache) -> FastForward:
        """The graph kept in ``cache``, exported there first where it is not. A kept graph that fails to load or to
        match the eager forward is deleted and exported again; a new one that fails is deleted (the error stands)."""
        core, example = self._core_and_example()
        key = graph_key(core, weights_sha256=self._weights, export={**EXPORT, "output_names": outputs_of(core)})
        for attempt in (1, 2):
            path, kept = cache.graph(key, lambda p: export_onnx(core, example, p))
            try:
                fast = load_onnx(path)
                self._check_against_eager(fast, want)
            except Exception as exc:
                cache.forget(key)
                if not kept or attempt == 2:
                    raise
                logger.warning("%s: the kept ONNX graph %s was not used (%s); exporting it again", self._model, path, exc)
                continue
            logger.info("%s: ONNX graph %s %s", self._model, "loaded from" if kept else "exported to", path)
            return fast
        raise AssertionError("unreachable")

    def _check_against_eager(self, fast: FastForward, name: str) -> None:
        mask = self._mask
        texts = (f"{mask} x y z w .", f"p q {mask} .", f"one two three four five {mask} six seven eight nine ten .")
        check = [self._query_input(t) for t in texts]
        tol = 1e-3 if self.eager.dtype == torch.float32 else 5e-2
        batches = [(self.eager.tensors(b), self.eager.arrays(b)) for b in (check[:1], check)]
        check_fast(fast, self._core_and_example()[0], batches, tol, name)
