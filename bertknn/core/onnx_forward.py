"""The forward module exported to ONNX and run in ONNX Runtime on the CPU (docs/decisions/onnx-runtime-on-cpu.md),
used only once its outputs matched the eager forward's."""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    import onnxruntime

# (input_ids, attention_mask, rows, mask_pos as host int64 arrays) -> ([MASK] embeddings float32, log p_MLM at [MASK])
FastForward = Callable[..., tuple[np.ndarray, torch.Tensor | None]]
NAMES = ["input_ids", "attention_mask", "rows", "mask_pos"]


# everything `torch.onnx.export` is given besides the module and the example (part of the cache key)
EXPORT: dict[str, object] = {
    "input_names": NAMES,
    # rows/mask_pos: the positions read, which may be more than the sequences (`log_probs_at`)
    "dynamic_axes": {"input_ids": {0: "batch", 1: "width"}, "attention_mask": {0: "batch", 1: "width"},
                     "rows": {0: "reads"}, "mask_pos": {0: "reads"}},
    "dynamo": False,
    "opset_version": 17,
}  # fmt: skip


def outputs_of(core: torch.nn.Module) -> list[str]:
    return ["embedding", "log_probs"] if getattr(core, "head", None) is not None else ["embedding"]


def export_onnx(core: torch.nn.Module, example: tuple[torch.Tensor, ...], path: Path) -> None:
    """``core`` (`bertknn.core.heads.MaskCore` or a cut of it) exported to ``path`` from a padded ``example``."""
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        torch.onnx.export(core, example, path, output_names=outputs_of(core), **EXPORT)  # type: ignore[arg-type]


def session_options() -> onnxruntime.SessionOptions:
    """ONNX Runtime's options for the forward: the threads this process gave torch, every graph optimisation,
    and the intra-op pool's threads asleep as soon as a run returns (`session.force_spinning_stop`): by default
    they spin for a while after each run, which keeps a core busy doing nothing between a service's batches, on
    the cores its event loop and other threads need (docs/decisions/onnx-spinning.md). Within a run they still
    spin between operators, which is where it saves time."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()  # the thread setting the process chose for torch
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.add_session_config_entry("session.force_spinning_stop", "1")
    return opts


def load_onnx(path: Path) -> FastForward:
    """The graph at ``path`` in an ONNX Runtime session with the threads this process gave torch. (Read from the
    path, not from bytes: the session then skips a copy of the whole model.)"""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), session_options(), providers=["CPUExecutionProvider"])

    def run(*arrays: np.ndarray) -> tuple[np.ndarray, torch.Tensor | None]:
        out = session.run(None, dict(zip(NAMES, arrays, strict=True)))
        return out[0], torch.from_numpy(out[1]) if len(out) > 1 else None

    return run


def build_onnx(core: torch.nn.Module, example: tuple[torch.Tensor, ...]) -> FastForward:
    """``core`` exported to a temporary file and loaded (`export_onnx`, `load_onnx`): no cache."""
    with tempfile.TemporaryDirectory(prefix="bertknn-onnx-") as tmp:
        path = Path(tmp) / "mask_core.onnx"
        export_onnx(core, example, path)
        return load_onnx(path)


@torch.inference_mode()
def check_fast(
    fast: FastForward,
    core: torch.nn.Module,
    batches: Sequence[tuple[tuple[torch.Tensor, ...], tuple[np.ndarray, ...]]],
    tol: float,
    name: str,
) -> None:
    """RuntimeError unless ``fast`` gives ``core``'s outputs within ``tol`` on every batch (as tensors, as arrays)."""
    for tensors, arrays in batches:
        want = core(*tensors)
        got_emb, got_lp = fast(*arrays)
        err = float(np.abs(want[0].float().cpu().numpy() - got_emb).max())
        if len(want) > 1:
            assert got_lp is not None
            err = max(err, float((want[1].cpu() - got_lp).abs().max()))
        if not err <= tol:
            raise RuntimeError(f"{name} differs from the eager forward by {err:.3g} (tolerance {tol})")
