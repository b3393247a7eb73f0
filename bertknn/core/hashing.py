"""Content hashes that identify things across runs: a file's bytes, a model's weights."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def weights_sha256(model: torch.nn.Module) -> str:
    """Hash of the float32 weights by parameter name: the model identity recorded in the manifest."""
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()
