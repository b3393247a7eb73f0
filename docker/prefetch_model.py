"""Pre-fetch a masked LM (default ``bert-base-uncased``) into the Hugging Face cache volume, once.

The images carry no weights: the service and the builder load the model by name from the cache at ``$HF_HOME``
(``/models/hf`` in the images), which docker-compose and Kubernetes mount as a volume.  Run this once with network
access; afterwards the containers can run with ``HF_HUB_OFFLINE=1``.

    python /opt/bertknn/prefetch_model.py [--model bert-base-uncased] [--revision main]

Only the files ``transformers`` needs for PyTorch are fetched (config, tokenizer, safetensors weights; the legacy
``pytorch_model.bin`` only where a repository has no safetensors).  Exit status 0 when the model is complete in the
cache, 1 otherwise, with a message that says what to do.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger("prefetch_model")

CONFIG_AND_TOKENIZER = ["*.json", "*.txt", "*.model"]
WEIGHTS = ["*.safetensors"]
LEGACY_WEIGHTS = ["pytorch_model.bin"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="bert-base-uncased",
                   help="Hugging Face model id (default bert-base-uncased)")
    p.add_argument("--revision", default=None, help="branch, tag or commit to pin (default: the repository's main)")
    return p


def _has_weights(folder: Path) -> bool:
    return any(folder.glob("*.safetensors")) or (folder / "pytorch_model.bin").is_file()


def prefetch(model: str, revision: str | None) -> Path:
    """Download what is missing and return the snapshot folder; raises RuntimeError with advice on failure."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(model, revision=revision, allow_patterns=CONFIG_AND_TOKENIZER + WEIGHTS))
        if not _has_weights(folder):
            logger.info("%s has no safetensors weights; fetching %s", model, LEGACY_WEIGHTS[0])
            folder = Path(snapshot_download(model, revision=revision, allow_patterns=LEGACY_WEIGHTS))
    except LocalEntryNotFoundError as exc:
        raise RuntimeError(
            f"{model} is not in the cache at {os.environ.get('HF_HOME', '~/.cache/huggingface')} and cannot be "
            "downloaded (offline?). Run this step with network access and HF_HUB_OFFLINE unset, or mount a model "
            "directory and set BERTKNN_MODEL__NAME / BERTKNN_BUILD__MODEL to it."
        ) from exc
    except HfHubHTTPError as exc:
        raise RuntimeError(f"{model}: download failed ({exc}); check the model id, the revision and the network") from exc
    if not _has_weights(folder):
        raise RuntimeError(f"{model}: no weights (*.safetensors or pytorch_model.bin) in {folder}")
    return folder


def verify(folder: Path) -> None:
    """Config and tokenizer load offline from the fetched folder (the weights are checked by file, not loaded)."""
    from transformers import AutoConfig, AutoTokenizer

    AutoConfig.from_pretrained(folder, local_files_only=True)
    AutoTokenizer.from_pretrained(folder, local_files_only=True)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        folder = prefetch(args.model, args.revision)
        verify(folder)
    except (RuntimeError, OSError, ValueError) as exc:
        logger.error("%s", exc)
        return 1
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    logger.info("%s ready in %s (%.1f MB)", args.model, folder, size / 1e6)
    return 0


if __name__ == "__main__":
    sys.exit(main())
