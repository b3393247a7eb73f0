"""The model's forward in PyTorch: padded inputs on the model's device, the [MASK] rows' embedding and log p_MLM."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import cast

import numpy as np
import torch

from bertknn.core.graphs import Capture, GraphedForward, capturable, cuda_capture
from bertknn.core.heads import MaskCore
from bertknn.core.inputs import MaskedInput, padded_arrays
from bertknn.core.truncate import embedding_core, service_core

logger = logging.getLogger(__name__)


class EagerForward:
    """The eager forward of one loaded masked LM, two ways (`MaskCore`): with p_MLM (the service) and embeddings
    only (the builder), the one place it is written. `cut` swaps each for a cheaper one with the same outputs.

    ``head``: the family's LM head, applied at the mask's row only; None: the full forward's logits (a family
    without one head module)."""

    def __init__(self, model: torch.nn.Module, head: torch.nn.Module | None, layer: int, pad_id: int,
                 device: torch.device, dtype: torch.dtype):  # fmt: skip
        self.model, self.head, self.layer, self.pad_id, self.device, self.dtype = model, head, layer, pad_id, device, dtype
        self.base: torch.nn.Module = cast(torch.nn.Module, model.base_model)
        self.cores: dict[bool, torch.nn.Module] = {
            with_mlm: MaskCore(self.base, head if with_mlm else None, layer).eval() for with_mlm in (True, False)
        }
        self.cut = "none"  # how the embeddings-only forward is cut: none, layers, or mask rows
        self.truncated = self.last_layer_at_mask = False
        self.graphs: GraphedForward | None = None  # the p_MLM forward as CUDA graphs (`use_graphs`)

    def cut_forwards(self, query_input: Callable[[str], MaskedInput], mask: str, num_layers: int, name: str) -> None:
        """Swap each forward for a cheaper one with the same outputs on a padded batch of two questions
        (`bertknn.core.truncate`): the builder's runs no layer above the stored one, the service's runs its last
        layer at the [MASK] rows."""
        batch = self.tensors([query_input(t) for t in (f"{mask} x y .", f"a b c d e f {mask} g h i j k l .")])
        tol = 1e-4 if self.dtype == torch.float32 else 1e-2
        found = embedding_core(self.base, num_layers, self.layer, self.cores[False], batch, tol, name)
        if found is not None:
            self.cores[False], self.cut = found
            self.truncated = True
        core = service_core(self.base, num_layers, self.layer, self.head, self.cores[True], batch, tol)
        if core is not None:
            self.cores[True], self.last_layer_at_mask = core, True

    def use_graphs(self, query_input: Callable[[str], MaskedInput], mask: str, *, max_rows: int, max_width: int,
                   capture: Capture = cuda_capture, name: str = "model") -> bool:  # fmt: skip
        """Run the forward with p_MLM (the service's) as CUDA graphs from now on (`GraphedForward`), where it can be
        captured: False, and eager as before, where it cannot (`capturable`). ``capture``: see `GraphedForward`."""
        batch = self.tensors([query_input(t) for t in (f"{mask} x y .", f"a b c d e f {mask} g h i j k l .")])
        tol = 1e-4 if self.dtype == torch.float32 else 2e-2
        core = capturable(self.cores[True], batch, tol)
        if core is None:
            logger.warning("%s: its forward reads device values on the host, so no CUDA graph: eager", name)
            return False
        self.graphs = GraphedForward(core, pad_id=self.pad_id, device=self.device, max_rows=max_rows,
                                     max_width=max_width, tol=tol, capture=capture, name=name)  # fmt: skip
        t = time.perf_counter()
        # Every row bucket of short and medium questions (up to 16 and 32 tokens) captured now, before the service
        # is ready, not on the first requests of each batch size, in every process.
        warm = [query_input(f"{mask} x y ."), query_input(" ".join(["a"] * 20) + f" {mask} .")]
        with torch.inference_mode():
            for item in warm:
                for rows in self.graphs.row_buckets:
                    self.graphs(*self.tensors([item] * rows))
        used = sum(b.replay is not None for b in self.graphs.buckets.values())
        logger.info("%s: %d of %d CUDA graphs captured at start-up in %.1f s", name, used, len(self.graphs.buckets),
                    time.perf_counter() - t)  # fmt: skip
        return True

    def arrays(self, items: Sequence[MaskedInput]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return padded_arrays(items, self.pad_id)

    def to_device(self, arrays: Sequence[np.ndarray]) -> tuple[torch.Tensor, ...]:
        host = [torch.from_numpy(a) for a in arrays]
        if self.device.type != "cuda":
            return tuple(host)
        # pinned host memory makes the copies of the (large) ids and mask asynchronous
        return tuple((t.pin_memory() if t.dim() == 2 else t).to(self.device, non_blocking=True) for t in host)

    def tensors(self, items: Sequence[MaskedInput]) -> tuple[torch.Tensor, ...]:
        """`arrays` as tensors on the model's device."""
        return self.to_device(self.arrays(items))

    def run(self, items: Sequence[MaskedInput], with_mlm: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The [MASK] embeddings and log p_MLM, left on the model's device."""
        ids, attn, rows, mask_pos = self.tensors(items)
        if with_mlm and self.head is None:  # no single head module: the full model's logits, at the mask rows
            out = self.model(input_ids=ids, attention_mask=attn, output_hidden_states=True)
            emb, logits = out.hidden_states[self.layer][rows, mask_pos], out.logits[rows, mask_pos]
            return emb, torch.log_softmax(logits.float(), dim=-1)
        graphed = self.graphs(ids, attn, rows, mask_pos) if with_mlm and self.graphs is not None else None
        out = graphed or self.cores[with_mlm](ids, attn, rows, mask_pos)
        return out[0], out[1] if with_mlm else None

    def log_probs_at(self, ids: np.ndarray, attn: np.ndarray, rows: np.ndarray, pos: np.ndarray) -> torch.Tensor:
        """log p_MLM at (row, position) pairs of padded sequences, on the host."""
        if self.head is None:
            t_ids, t_attn, t_rows, t_pos = self.to_device([ids, attn, rows, pos])
            logits = self.model(input_ids=t_ids, attention_mask=t_attn).logits[t_rows, t_pos]
            return torch.log_softmax(logits.float(), dim=-1).cpu()
        log_p = self.cores[True](*self.to_device([ids, attn, rows, pos]))[1]
        assert log_p is not None
        return log_p.cpu()
