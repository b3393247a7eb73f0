"""The caches kept on disk read their setting one way (`bertknn.core.disk_cache.usable_dir`): ``auto`` under
``$XDG_CACHE_HOME/bert-knn``, ``off``, a directory, and a path that cannot be made (logged, nothing kept)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bertknn.core.onnx_cache import OnnxCache
from bertknn.core.vocab_cache import VocabCache


@pytest.mark.parametrize(
    ("cache", "name", "logged"),
    [(OnnxCache, "onnx", "ONNX cache not used"), (VocabCache, "vocab", "vocabulary cache not used")],
)
def test_the_setting(
    cache: type[OnnxCache] | type[VocabCache], name: str, logged: str, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    auto = cache.from_setting("auto")
    assert auto is not None and auto.directory == tmp_path / "xdg" / "bert-knn" / name and auto.directory.is_dir()
    assert cache.from_setting("off") is None
    given = cache.from_setting(str(tmp_path / "mine"))
    assert given is not None and given.directory == tmp_path / "mine"
    (tmp_path / "a-file").write_text("")
    assert cache.from_setting(str(tmp_path / "a-file" / name)) is None  # cannot be made: made again each start
    assert logged in caplog.text
