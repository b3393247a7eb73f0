"""The service's forward replayed as CUDA graphs, one per (rows, width) bucket, instead of a Python loop that
launches each of its kernels (docs/decisions/cuda-graphs.md).

A batch is padded up to its bucket: more rows (each attending to its first position only, so no row is all
padding) and a wider padding on the right, which the attention mask hides. A bucket's graph is captured the first
time a batch needs it, and used only once its output for that batch matched the eager forward's; a bucket whose
capture fails or differs stays eager, as do batches larger than the largest bucket.

Capture needs a forward that never reads a device value on the host (`host_syncs`). Hugging Face's attention
looks at the 2D padding mask's values to skip it where nothing is padded; the cores then take the 4D additive mask
instead (`additive_mask`), where the outputs are the same.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bertknn.core.truncate import outputs_close, same_rows

logger = logging.getLogger(__name__)

Outputs = tuple[torch.Tensor, ...]
Core = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Outputs]
# capture(run, pool) -> (the static outputs run made, a call that replays it, the memory pool the next shares)
Capture = Callable[[Callable[[], Outputs], object], tuple[Outputs, Callable[[], None], object]]

# aten ops that copy a device value to the host: a stream being captured refuses them
SYNC_OPS = frozenset({"_local_scalar_dense", "is_nonzero", "nonzero", "equal", "item", "allclose"})
ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
WIDTH_STEP = 16


class _SyncSpy(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.__name__.split(".")[0] in SYNC_OPS:
            self.found.append(str(func))
        return func(*args, **(kwargs or {}))


def host_syncs(fn: Callable[..., object], *args: object) -> list[str]:
    """The ops of one call ``fn(*args)`` that read a device value on the host: on a GPU each waits for the device,
    and none can be captured in a CUDA graph. Found on any device (the CPU included), from the ops dispatched."""
    spy = _SyncSpy()
    with spy:
        fn(*args)
    return spy.found


@torch.inference_mode()
def capturable(core: torch.nn.Module, example: Sequence[torch.Tensor], tol: float) -> torch.nn.Module | None:
    """``core``, or a copy of it that gives the base model the 4D mask (``mask_4d``), whichever makes no host sync
    on ``example`` with the same outputs; None when neither does (the family's forward stays eager)."""
    if not host_syncs(core, *example):
        return core
    if not hasattr(core, "mask_4d"):
        return None
    four = copy.copy(core)  # the same modules and weights; only the flag differs
    setattr(four, "mask_4d", True)  # noqa: B010 - a plain attribute, not a submodule
    # same_rows first: a family whose model refuses a 4D mask fails there, and stays eager
    if not same_rows(four, core, tuple(example), tol) or host_syncs(four, *example):
        return None
    return four


def cuda_capture(run: Callable[[], Outputs], pool: object) -> tuple[Outputs, Callable[[], None], object]:
    """Capture ``run`` as a CUDA graph: warmed up on a side stream (as PyTorch's docs ask), then captured into
    ``pool`` (None: a new one)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # thread_local: another thread's CUDA calls (none in the service) do not break this capture
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):  # type: ignore[arg-type]
        outputs = run()
    return outputs, graph.replay, graph.pool()


@dataclass
class _Bucket:
    ids: torch.Tensor  # [rows, width] static inputs the graph reads
    attn: torch.Tensor
    rows: torch.Tensor  # [rows]
    pos: torch.Tensor
    outputs: Outputs = ()
    replay: Callable[[], None] | None = None  # None: not captured yet, or eager (``failed``)
    failed: bool = False


class GraphedForward:
    """``core`` (ids, attention mask, rows, mask positions -> outputs) on padded buckets, each a captured graph.

    ``capture``: how a bucket's forward is recorded (`cuda_capture`; the tests pass one that runs it each time,
    which exercises everything but the device). ``tol``: how far a replay may lie from the eager forward, relative
    to the outputs' scale (bf16 rounding on a GPU)."""

    def __init__(self, core: Core, *, pad_id: int, device: torch.device, max_rows: int, max_width: int,
                 tol: float, capture: Capture = cuda_capture, name: str = "model"):  # fmt: skip
        self.core, self.pad_id, self.device, self.tol, self.capture, self.name = core, pad_id, device, tol, capture, name
        self.row_buckets = [r for r in ROW_BUCKETS if r < max_rows] + [max_rows]
        self.max_width = max_width
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        # One memory pool shared by every graph. PyTorch allows it where graphs never run at once and no graph's
        # static outputs are read after another graph replays: each replay's outputs are cloned at once.
        self.pool: object = None

    def bucket_of(self, rows: int, width: int) -> tuple[int, int] | None:
        """The (rows, width) a batch is padded to; None: larger than every bucket (eager)."""
        r = next((b for b in self.row_buckets if b >= rows), None)
        w = min(-(-width // WIDTH_STEP) * WIDTH_STEP, self.max_width)
        return None if r is None or width > self.max_width else (r, w)

    def __call__(self, ids: torch.Tensor, attn: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor) -> Outputs | None:
        """The outputs of ``core`` on this batch from its bucket's graph; None where the caller runs it eagerly
        (no bucket, or the bucket's capture failed or differed)."""
        n, width = ids.shape
        if rows.shape[0] != n:  # several reads of one row (fill passes): not a shape the buckets cover
            return None
        key = self.bucket_of(n, width)
        if key is None:
            return None
        bucket = self.buckets.get(key) or self._new_bucket(*key)
        if bucket.failed:
            return None
        self._fill(bucket, ids, attn, rows, pos)
        if bucket.replay is None:
            return self._first(bucket, key, (ids, attn, rows, pos))
        bucket.replay()
        return tuple(o[:n].clone() for o in bucket.outputs)

    def _new_bucket(self, rows: int, width: int) -> _Bucket:
        i64, dev = torch.int64, self.device
        bucket = _Bucket(torch.full((rows, width), self.pad_id, dtype=i64, device=dev),
                         torch.zeros((rows, width), dtype=i64, device=dev), torch.arange(rows, dtype=i64, device=dev),
                         torch.zeros(rows, dtype=i64, device=dev))  # fmt: skip
        self.buckets[(rows, width)] = bucket
        return bucket

    def _fill(self, b: _Bucket, ids: torch.Tensor, attn: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor) -> None:
        """The batch into the bucket's static inputs; the rest padding (rows that attend to their first position)."""
        n, width = ids.shape
        b.ids.fill_(self.pad_id)
        b.ids[:n, :width].copy_(ids, non_blocking=True)
        b.attn.zero_()
        b.attn[:n, :width].copy_(attn, non_blocking=True)
        b.attn[n:, 0] = 1
        b.rows[:n].copy_(rows, non_blocking=True)
        b.rows[n:] = torch.arange(n, b.rows.shape[0], device=self.device)
        b.pos.zero_()
        b.pos[:n].copy_(pos, non_blocking=True)

    def _first(self, b: _Bucket, key: tuple[int, int], batch: Sequence[torch.Tensor]) -> Outputs | None:
        """Capture the bucket's graph and keep it only if its replay gives the eager forward's outputs on this
        batch; else the bucket stays eager. Returns the outputs (the replay's, or None: the caller's eager run)."""
        n = batch[0].shape[0]
        try:
            b.outputs, replay, self.pool = self.capture(lambda: self.core(b.ids, b.attn, b.rows, b.pos), self.pool)
            replay()
            got = tuple(o[:n].clone() for o in b.outputs)
        except Exception as exc:  # noqa: BLE001 - any failure to capture leaves the bucket eager
            logger.warning("%s: CUDA graph for %d rows x %d tokens not captured (%s): eager", self.name, *key, exc)
            b.failed = True
            return None
        if not outputs_close(got, self.core(*batch), self.tol):
            logger.warning("%s: CUDA graph for %d rows x %d tokens differs from the eager forward: eager", self.name, *key)
            b.failed = True
            return None
        b.replay = replay
        logger.debug("%s: CUDA graph captured for %d rows x %d tokens", self.name, *key)
        return got
