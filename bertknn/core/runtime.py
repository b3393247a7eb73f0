"""Where the work runs: the device and dtype decided once, and the CPUs this process may use."""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import torch

from bertknn.core.errors import ModelLoadError
from bertknn.core.libc import glibc

logger = logging.getLogger(__name__)

DeviceName = Literal["auto", "cpu", "cuda"]
DtypeName = Literal["auto", "float32", "float16", "bfloat16"]


# The oldest NVIDIA Linux driver that runs each CUDA major version's runtime (CUDA 12 and 13 through minor-version
# compatibility): NVIDIA's CUDA Toolkit release notes, table 3.
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
_PROC_VERSION = Path("/proc/driver/nvidia/version")
_DRIVER = re.compile(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+(?:\.\d+)+)")


def driver_version() -> str | None:
    """The NVIDIA kernel driver's version (from /proc, which a container with GPUs sees), or None: no driver."""
    try:
        found = _DRIVER.search(_PROC_VERSION.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return None
    return found.group(1) if found else None


def _as_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split(".") if x.isdigit())


def driver_problem(cuda: str | None = None, driver: str | None = None) -> str | None:
    """Why torch's CUDA build cannot run on this machine's driver, in one line; None when it can (or no CUDA)."""
    cuda = cuda if cuda is not None else torch.version.cuda
    if not cuda:
        return "this torch is a CPU-only build: install the CUDA build (the CUDA image) to use a GPU"
    driver = driver if driver is not None else driver_version()
    if driver is None:
        return "no NVIDIA driver is visible here: run with the GPU made visible (--gpus, or the NVIDIA device plugin)"
    need = MIN_DRIVER.get(int(cuda.split(".")[0]))
    if need is not None and _as_tuple(driver) < _as_tuple(need):
        return (
            f"the NVIDIA driver is {driver}, and this torch {torch.__version__} is built for CUDA {cuda}, which needs "
            f"driver {need} or newer: upgrade the driver, or use an image built for an older CUDA (docs/deployment.md, "
            f'"GPU drivers")'
        )
    return None


def resolve_device(device: DeviceName | str) -> torch.device:
    """Decide the device once; log when `auto` falls back to the CPU, saying why when a GPU is there but unusable."""
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        why = driver_problem() if driver_version() is not None else None
        if why:
            logger.warning("device=auto: a GPU is present but unusable (%s); using the CPU", why)
        else:
            logger.info("device=auto: no CUDA device visible, using the CPU")
        return torch.device("cpu")
    if device == "cuda" and not torch.cuda.is_available():
        why = driver_problem() or "torch sees no CUDA device"
        raise ModelLoadError(f"device=cuda was asked for, but {why}; or use --device cpu or auto")
    return torch.device(device)


def resolve_dtype(dtype: DtypeName | str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]


def attention_without_cudnn() -> bool:
    """Keep ``scaled_dot_product_attention`` off cuDNN's kernel in this process (flash, memory-efficient and math
    stay): cuDNN's builds a graph for every new (rows, width) batch shape, and the builder's and the service's
    batches rarely repeat a shape (docs/decisions/cuda-attention-kernels.md). Called where a model is put on a
    CUDA device; False where this torch has no such switch."""
    switch = getattr(torch.backends.cuda, "enable_cudnn_sdp", None)
    if switch is None:
        return False
    switch(False)
    return True


def cpu_quota_threads() -> int:
    """CPUs this process may use (cgroup quota or affinity), for torch thread settings."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            return max(1, int(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return len(os.sched_getaffinity(0))


@contextlib.contextmanager
def faiss_threads(n: int) -> Iterator[None]:
    """FAISS's OpenMP threads set to ``n`` for a block, and set back after it. FAISS and torch share one OpenMP
    runtime: ``faiss.omp_set_num_threads`` also sets the calling thread's torch intra-op threads, so a setting
    that outlived its search would leave the next forward pass on that thread with ``n`` threads."""
    import faiss

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(n)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)


def return_free_memory() -> None:
    """Give the C heap's free pages back to the system (glibc ``malloc_trim``; a no-op elsewhere).

    PyTorch's CPU forward over batches of changing shapes leaves freed buffers in glibc's heap, which keeps them:
    a build's RSS then grows with the number of batches, not with what it holds (docs/decisions/malloc-trim.md)."""
    libc = glibc()
    if libc is not None:
        libc.malloc_trim(0)


class DeviceWait:
    """How a thread waits for the work it queued on a GPU before reading its results: CUDA's default busy-waits on
    its core; ``blocking`` sleeps until the device signals (a blocking CUDA event), leaving the core to other
    threads and processes (several service processes per GPU: docs/decisions/serving-processes.md). Nothing to
    wait for off CUDA."""

    def __init__(self, device: torch.device, *, blocking: bool = False):
        self.device = device
        self.blocking = blocking
        self._event: torch.cuda.Event | None = None

    def __call__(self) -> None:
        """Return once the device finished what this thread queued (at once where it need not wait)."""
        if not self.blocking or self.device.type != "cuda":
            return
        if self._event is None:
            self._event = torch.cuda.Event(blocking=True)
        self._event.record()
        self._event.synchronize()
