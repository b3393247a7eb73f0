"""Where the work runs: the device and dtype decided once, and the CPUs this process may use."""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path
from typing import Literal

import torch

from bertknn.core.errors import ModelLoadError

logger = logging.getLogger(__name__)

DeviceName = Literal["auto", "cpu", "cuda"]
DtypeName = Literal["auto", "float32", "float16", "bfloat16"]


def resolve_device(device: DeviceName | str) -> torch.device:
    """Decide the device once; log when `auto` falls back to the CPU."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        logger.info("device=auto: no CUDA device visible, using the CPU")
        return torch.device("cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device=cuda was asked for but torch sees no CUDA device; use --device cpu or auto")
    return torch.device(device)


def resolve_dtype(dtype: DtypeName | str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]



def cpu_quota_threads() -> int:
    """CPUs this process may use (cgroup quota or affinity), for torch thread settings."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            return max(1, int(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return len(os.sched_getaffinity(0))


_LIBC: ctypes.CDLL | None | bool = False  # False: not looked up yet; None: no glibc


def return_free_memory() -> None:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``; a no-op elsewhere).

    PyTorch's CPU forward over batches of changing shapes leaves freed buffers in glibc's heap, which keeps them:
    a build's RSS then grows with the number of batches, not with what it holds (docs/decisions/malloc-trim.md)."""
    global _LIBC
    if _LIBC is False:
        try:
            libc = ctypes.CDLL("libc.so.6")
            _LIBC = libc if hasattr(libc, "malloc_trim") else None
        except OSError:
            _LIBC = None
    if _LIBC:
        _LIBC.malloc_trim(0)  # type: ignore[union-attr]
