"""docker/prefetch_model.py: the optional step that fills the Hugging Face cache volume, and the offline check the
Kubernetes build pods wait on (``HF_HUB_OFFLINE=1 prefetch_model.py --model M`` succeeds once the model is cached)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "docker" / "prefetch_model.py"


def hub_cache_with(model_dir: Path, repo_id: str, root: Path) -> Path:
    """A Hugging Face hub cache (HF_HOME) holding ``model_dir`` as ``repo_id``, laid out as huggingface_hub writes it."""
    repo = root / "hub" / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    snapshot.mkdir(parents=True)
    for f in model_dir.iterdir():
        shutil.copy(f, snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    return root


def run_prefetch(hf_home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120)


def test_cached_model_is_found_and_verified_offline(tiny_model_dir: Path, tmp_path: Path) -> None:
    hf_home = hub_cache_with(tiny_model_dir, "org/tiny-bert", tmp_path / "hf")
    result = run_prefetch(hf_home, "--model", "org/tiny-bert")
    assert result.returncode == 0, result.stderr
    assert "org/tiny-bert ready in" in result.stderr


def test_missing_model_fails_with_advice(tmp_path: Path) -> None:
    result = run_prefetch(tmp_path / "empty-hf", "--model", "org/not-there")
    assert result.returncode == 1
    assert "is not in the cache" in result.stderr and "network access" in result.stderr


def test_cache_without_weights_is_not_ready(tiny_model_dir: Path, tmp_path: Path) -> None:
    hf_home = hub_cache_with(tiny_model_dir, "org/no-weights", tmp_path / "hf")
    for weights in hf_home.rglob("*.safetensors"):
        weights.unlink()
    result = run_prefetch(hf_home, "--model", "org/no-weights")
    assert result.returncode == 1


@pytest.mark.parametrize("flag", ["--local-dir", "--cache"])
def test_unknown_flags_are_refused(flag: str, tmp_path: Path) -> None:
    assert run_prefetch(tmp_path, flag, "x").returncode == 2
