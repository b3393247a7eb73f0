"""Finding a datastore's model again: the name it was built with, and for a local directory its absolute path.

The weights' sha256 in the manifest is what proves it is the same model; this only decides where to load from.
"""

from __future__ import annotations

from pathlib import Path

from bertknn.core.errors import ModelLoadError


def public_model_name(name: str) -> str:
    """How a model is named to the service's callers: a hub id as it is, a local directory by its last part
    (``/srv/models/bert-base-uncased`` -> ``bert-base-uncased``: no machine path in a response)."""
    if name.startswith((".", "/", "~")) or "\\" in name or Path(name).expanduser().is_dir():
        return Path(name.rstrip("/\\")).name or name
    return name


def local_model_path(name: str) -> str | None:
    """The absolute path of ``name`` when it is a local model directory (as given, relative to the working
    directory), else None (a hub name)."""
    path = Path(name).expanduser()
    return str(path.resolve()) if path.is_dir() else None


def check_model_dir(name_or_path: str) -> None:
    """Refuse, in one line, a model given as a local path that is not there or is not a model's directory; a
    hub name passes (whether the hub has it is the loader's to say)."""
    where = Path(name_or_path).expanduser()
    if (name_or_path.startswith((".", "/", "~")) or where.exists()) and not where.is_dir():
        raise ModelLoadError(f"the model directory {name_or_path} does not exist; pass a masked LM's directory "
                             "or its Hugging Face hub name")  # fmt: skip
    if where.is_dir() and not (where / "config.json").is_file():
        raise ModelLoadError(f"{name_or_path} is not a Hugging Face model directory: it has no config.json (a masked "
                             "LM's directory holds config.json, its tokenizer's files and its weights)")  # fmt: skip


def locate_model(name: str, path: str | None, override: str | None = None) -> str:
    """What to load: ``override`` (the caller's choice) if given; else the recorded absolute directory when it
    exists; else the recorded name, when it is a local directory from here or could be a hub name.

    Raises `ModelLoadError` in one line when the datastore's model was a local directory that is not found.
    """
    if override:
        return override
    if path and Path(path).is_dir():
        return path
    if Path(name).expanduser().is_dir():
        return name
    looks_local = path is not None or name.startswith((".", "/", "~")) or name.count("/") > 1
    if looks_local:
        where = f" ({path})" if path and path != name else ""
        raise ModelLoadError(
            f"the datastore was built with the model directory {name!r}{where}, which is not there from here; "
            "pass the same model with --model DIR (or BERTKNN_MODEL__NAME)"
        )
    return name
