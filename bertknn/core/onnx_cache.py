"""Exported ONNX graphs kept on disk under a key of everything the export read, so that a process that starts
again (a replaced worker, a reload, the next build) loads the graph instead of exporting it again
(docs/decisions/onnx-runtime-on-cpu.md). A loaded graph is still checked against the eager forward before use."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from bertknn.core.disk_cache import locked, module_bytes, prune, usable_dir

logger = logging.getLogger(__name__)

FORMAT = 1  # bumped when what a cached file holds changes
SUFFIX = ".onnx"
KEEP = 6  # graphs kept per directory, the most recently used: a graph is as large as its model's weights
SETTING_HELP = (
    "with the onnx backend, where exported graphs are kept, each under a key of the weights, the code and the "
    "library versions it came from, so that the next start loads instead of exporting (a kept graph is checked "
    "against the eager forward like a new one): auto ($XDG_CACHE_HOME/bert-knn/onnx, else ~/.cache/bert-knn/onnx), "
    "a directory, or off"
)


@dataclass(frozen=True)
class OnnxCache:
    """One directory of exported graphs, ``<key>.onnx`` each; any of them may be deleted at any time. A new graph
    makes room for itself: the least recently used beyond `KEEP` are deleted (a process that loaded one keeps it in
    memory)."""

    directory: Path

    @classmethod
    def from_setting(cls, setting: str) -> OnnxCache | None:
        """``auto``: ``$XDG_CACHE_HOME/bert-knn/onnx``; ``off``: no cache; anything else: that directory. None,
        logged, where the directory cannot be made or written: the graph is then exported each start."""
        directory = usable_dir(setting, "onnx", label="ONNX cache", without="the graph is exported at each start")
        return None if directory is None else cls(directory)

    def path(self, key: str) -> Path:
        return self.directory / f"{key}{SUFFIX}"

    def graph(self, key: str, export: Callable[[Path], None]) -> tuple[Path, bool]:
        """The graph stored under ``key``, exported first (``export(path)`` writes it) where it is not there yet;
        and whether it was there. Processes that start together export once: the others wait on a lock file."""
        path = self.path(key)
        with locked(self.directory, key):
            if path.is_file():
                os.utime(path)  # used: the last to be pruned
                return path, True
            tmp = path.with_name(f".{key}.{os.getpid()}.tmp")
            try:
                export(tmp)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
        self._prune()
        return path, False

    def _prune(self) -> None:
        for path in prune(self.directory, SUFFIX, KEEP):
            logger.info("ONNX cache: %s deleted, the least recently used beyond %d graphs", path, KEEP)

    def forget(self, key: str) -> None:
        """Delete the graph stored under ``key`` (it failed to load, or differed from the eager forward)."""
        with locked(self.directory, key):
            self.path(key).unlink(missing_ok=True)


def onnx_cache(backend: str, setting: str, device: torch.device) -> OnnxCache | None:
    """The cache a backend setting uses: none where nothing is exported (eager, or auto off the CPU), so that
    nothing is made on disk there."""
    if backend == "eager" or (backend == "auto" and device.type != "cpu"):
        return None
    return OnnxCache.from_setting(setting)


def graph_key(core: torch.nn.Module, *, weights_sha256: str, export: dict[str, object]) -> str:
    """What an exported graph depends on: the weights, the module tree with its settings and the code of this
    project's modules in it, the export's arguments, and the versions of the libraries that trace it."""
    ours = {type(m) for m in core.modules() if type(m).__module__.startswith("bertknn.")}
    code = hashlib.sha256()
    for module in sorted({t.__module__ for t in ours}):
        code.update(module_bytes(module))
    settings = [
        (type(m).__qualname__, sorted((k, repr(v)) for k, v in vars(m).items() if _plain(k, v)))
        for m in core.modules() if type(m) in ours
    ]  # fmt: skip
    described = {
        "format": FORMAT, "weights": weights_sha256, "modules": repr(core), "settings": settings,
        "code": code.hexdigest(), "export": export, "torch": torch.__version__,
        "transformers": transformers.__version__,
    }  # fmt: skip
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=repr).encode()).hexdigest()[:32]


def _plain(name: str, value: object) -> bool:
    return not name.startswith("_") and isinstance(value, (bool, int, float, str, type(None), tuple))
