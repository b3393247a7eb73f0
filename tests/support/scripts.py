"""The repository's scripts (``scripts/*.py``, ``.ci/*.py``, the images' helpers), imported by their path for a test."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_script(path: Path, name: str) -> ModuleType:
    """The script at ``path`` (relative to the repository, or absolute) as module ``name``, registered in
    ``sys.modules`` (a dataclass of its own looks its module up there)."""
    spec = importlib.util.spec_from_file_location(name, path if path.is_absolute() else REPO / path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
