"""`bert-knn build --out`: a directory of someone else's files is refused before the model loads, and left as it was;
a new or empty directory, a mounted volume's root and a build in progress are taken."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bertknn.builder.build import BUILD_STATE, build, refuse_foreign_out
from bertknn.builder.settings import BuildSettings
from bertknn.core.errors import BuildError


def settings(tmp_path: Path, out: Path) -> BuildSettings:
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"title": "Zorblat", "text": "Zorblat was born in quimby."}) + "\n")
    # no model there: an error about the model would mean --out was not checked first
    return BuildSettings(corpus=[corpus], model=str(tmp_path / "no-such-model"), out=out, device="cpu")


def test_a_directory_of_other_files_is_refused_and_left_alone(tmp_path: Path) -> None:
    out = tmp_path / "home"
    out.mkdir()
    for name in ("notes.txt", "index", "photos", "todo.md"):
        (out / name).write_text("mine") if "." in name else (out / name).mkdir()
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(BuildError, match=r"holds files that are not a datastore's \(index, notes\.txt, photos and 1 more\)"):
        build(settings(tmp_path, out))
    assert sorted(p.name for p in out.iterdir()) == before
    assert (out / "notes.txt").read_text() == "mine"


def test_a_file_is_no_output_directory(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    out.write_text("x")
    with pytest.raises(BuildError, match="a file, not a directory"):
        build(settings(tmp_path, out))


@pytest.mark.parametrize("inside", [[], [".gitkeep"], ["lost+found/"], [BUILD_STATE, "shards/"], ["manifest.json"]])
def test_new_empty_volume_root_and_builds_are_taken(tmp_path: Path, inside: list[str]) -> None:
    out = tmp_path / "ds"
    out.mkdir()
    for name in inside:
        (out / name.rstrip("/")).mkdir() if name.endswith("/") else (out / name).write_text("{}")
    refuse_foreign_out(out)  # no error
    refuse_foreign_out(tmp_path / "new")
