"""The one place that readies pyserini's import: version 0.25 builds an OpenAI client when imported and fails
without a key; BM25 never calls it, so a placeholder is set here and nowhere else."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

OPENAI_PLACEHOLDER = ("OPENAI_API_KEY", "unused")


def ready_pyserini_env(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Set the placeholder in ``env`` (this process's environment by default) unless a key is already set."""
    target = os.environ if env is None else env
    target.setdefault(*OPENAI_PLACEHOLDER)
    return target
