"""The forward module exported to ONNX and run in ONNX Runtime on the CPU (docs/decisions/onnx-runtime-on-cpu.md),
used only once its outputs matched the eager forward's."""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

# (input_ids, attention_mask, rows, mask_pos as host int64 arrays) -> ([MASK] embeddings float32, log p_MLM at [MASK])
FastForward = Callable[..., tuple[np.ndarray, torch.Tensor | None]]
NAMES = ["input_ids", "attention_mask", "rows", "mask_pos"]


def build_onnx(core: torch.nn.Module, example: tuple[torch.Tensor, ...]) -> FastForward:
    """``core`` (`bertknn.core.heads.MaskCore` or a cut of it) exported from a padded ``example`` batch and loaded
    in an ONNX Runtime session with the threads this process gave torch."""
    import onnxruntime as ort

    outputs = ["embedding", "log_probs"] if getattr(core, "head", None) is not None else ["embedding"]
    with tempfile.TemporaryDirectory(prefix="bertknn-onnx-") as tmp, warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        path = Path(tmp) / "mask_core.onnx"
        torch.onnx.export(
            core, example, path, input_names=NAMES, output_names=outputs,
            # rows/mask_pos: the positions read, which may be more than the sequences (`log_probs_at`)
            dynamic_axes={"input_ids": {0: "batch", 1: "width"}, "attention_mask": {0: "batch", 1: "width"},
                          "rows": {0: "reads"}, "mask_pos": {0: "reads"}},
            dynamo=False, opset_version=17,
        )  # fmt: skip
        model_bytes = path.read_bytes()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = torch.get_num_threads()  # the thread setting the process chose for torch
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])

    def run(*arrays: np.ndarray) -> tuple[np.ndarray, torch.Tensor | None]:
        out = session.run(None, dict(zip(NAMES, arrays, strict=True)))
        return out[0], torch.from_numpy(out[1]) if len(out) > 1 else None

    return run


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
