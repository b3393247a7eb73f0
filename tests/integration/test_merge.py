"""`bert-knn merge` joins the slices of one sliced build, or refuses with one line that names what is wrong and
what to do. Slices of an int8 datastore share its codec (``--codec-from``). Whatever can be told from the slices
alone is refused before anything is written into ``--out``; a slice's shard found damaged while the shards are
taken is named, no manifest is written, and the same merge with the slice rebuilt resumes to the single build's
datastore.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from bertknn.builder.__main__ import main
from bertknn.builder.merge import merge_slices
from bertknn.core.errors import MergeError
from bertknn.core.format import read_manifest, validate_datastore
from bertknn.core.format.contract import (
    LABELS,
    MANIFEST,
    REDIRECTS,
    SHARD_MARKER,
    SHARDS_DIR,
    read_shard_info,
)
from bertknn.core.format.files import write_manifest
from tests.conftest import build_tiny


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_corpus: Path) -> Path:
    """The single build the merged slices must equal: int8 codes, three blocks of two articles."""
    out = build_tiny(tmp_path_factory.mktemp("merge-full") / "ds", [tiny_corpus], tiny_model_dir, codec="int8")
    assert len(read_manifest(out).shards) == 3
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, tiny_corpus: Path, full: Path) -> list[Path]:
    root = tmp_path_factory.mktemp("merge-slices")
    return [
        build_tiny(root / f"s{i}", [tiny_corpus], tiny_model_dir, codec="int8", codec_from=full, shard_index=i,
                   num_shards=2)  # fmt: skip
        for i in range(2)
    ]


@pytest.fixture
def slices(tmp_path: Path, built: list[Path]) -> list[Path]:
    """This test's own copies of the two slices (a test damages them)."""
    return [Path(shutil.copytree(s, tmp_path / s.name)) for s in built]


def test_merged_int8_slices_equal_the_single_build(slices: list[Path], full: Path, tmp_path: Path) -> None:
    merged = merge_slices(list(reversed(slices)), tmp_path / "out", sparse_indexes=False)
    assert validate_datastore(tmp_path / "out") == []
    want = read_manifest(full)
    assert merged.codec == want.codec and merged.datastore_id == want.datastore_id
    assert merged.counts == want.counts


# ---- refused before anything is written: (slices, out) damaged -> the arguments and the line --------------------


def edit(ds: Path, **changes: object) -> None:
    write_manifest(ds, read_manifest(ds).model_copy(update=changes))


def edit_state(ds: Path, key: str, value: object) -> None:
    state = json.loads((ds / "build.json").read_text(encoding="utf-8"))
    state[key] = value
    (ds / "build.json").write_text(json.dumps(state), encoding="utf-8")


Case = Callable[[list[Path], Path], tuple[list[Path], str]]


def old_format(s: list[Path], full: Path) -> tuple[list[Path], str]:
    edit(s[1], format_version=3)
    return s, f"{s[1] / MANIFEST}: format version 3, this code merges 4"


def not_a_slice(s: list[Path], full: Path) -> tuple[list[Path], str]:
    return [s[0], full], f"{full}: not a slice (built without --num-shards)"


def other_layer(s: list[Path], full: Path) -> tuple[list[Path], str]:
    layer = read_manifest(s[0]).layer
    edit(s[1], layer=layer - 1)
    return s, f"{s[1]}: layer is {layer - 1}, but {s[0]} has {layer}; the slices come from different builds"


def other_language(s: list[Path], full: Path) -> tuple[list[Path], str]:
    edit(s[1], language="uk")
    return s, f"{s[1]}: language is 'uk', but {s[0]} has 'en'"


def other_build_settings(s: list[Path], full: Path) -> tuple[list[Path], str]:
    edit_state(s[1], "min_sentence_chars", 99)
    return s, f"{s[1]}: built with other settings than {s[0]} (min_sentence_chars differ)"


def a_slice_twice(s: list[Path], full: Path) -> tuple[list[Path], str]:
    again = Path(shutil.copytree(s[0], s[0].with_name("again")))
    return [s[0], again, s[1]], f"{again} and {s[0]} are both slice 0 of 2; give each once"


def a_slice_missing(s: list[Path], full: Path) -> tuple[list[Path], str]:
    return [s[1]], "slices [0] of 2 are missing; build them with --shard-index K --num-shards 2"


def a_shard_of_another_slice(s: list[Path], full: Path) -> tuple[list[Path], str]:
    shards = read_manifest(s[0]).shards
    edit(s[0], shards=[shards[0], shards[1].model_copy(update={"index": 3})])
    return s, f"{s[0]}: holds {shards[1].name}, which belongs to slice 1 of 2, not 0"


def a_shard_missing(s: list[Path], full: Path) -> tuple[list[Path], str]:
    edit(s[0], shards=read_manifest(s[0]).shards[1:])
    return s, "do not form shard-00000..shard-00001: missing [0], duplicated []"


def redirects_disagree(s: list[Path], full: Path) -> tuple[list[Path], str]:
    (s[0] / REDIRECTS).write_text(json.dumps({"Plonk City": "Zorblat"}), encoding="utf-8")
    (s[1] / REDIRECTS).write_text(json.dumps({"Plonk City": "Quimby"}), encoding="utf-8")
    return s, f"{s[1] / REDIRECTS}: redirect 'Plonk City' -> 'Quimby', another slice says 'Zorblat'"


def codec_corrupted(s: list[Path], full: Path) -> tuple[list[Path], str]:
    codec = read_manifest(s[0]).codec
    assert codec is not None
    data = bytearray((s[0] / codec.file).read_bytes())
    data[-1] ^= 0x01
    (s[0] / codec.file).write_bytes(bytes(data))
    return s, f"{s[0] / codec.file}: sha256 differs from the slice's manifest (corrupted); rebuild that slice"


def codec_missing(s: list[Path], full: Path) -> tuple[list[Path], str]:
    codec = read_manifest(s[0]).codec
    assert codec is not None
    (s[0] / codec.file).unlink()
    return s, f"{s[0] / codec.file}: missing (the codec the slice's manifest names)"


BEFORE = [old_format, not_a_slice, other_layer, other_language, other_build_settings, a_slice_twice, a_slice_missing,
          a_shard_of_another_slice, a_shard_missing, redirects_disagree, codec_corrupted, codec_missing]  # fmt: skip


@pytest.mark.parametrize("case", BEFORE, ids=lambda f: f.__name__)
def test_a_merge_refused_from_the_slices_writes_nothing(
    slices: list[Path], full: Path, tmp_path: Path, case: Case, capsys: pytest.CaptureFixture[str]
) -> None:
    given, what = case(slices, full)
    out = tmp_path / "out"
    with pytest.raises(MergeError) as err:
        merge_slices(given, out, sparse_indexes=False)
    assert what in str(err.value), err.value
    assert not out.exists()
    capsys.readouterr()
    assert main(["merge", *map(str, given), "--out", str(out), "--no-sparse-indexes"]) == 1
    assert capsys.readouterr().err.strip() == f"error: {err.value}"
    assert not out.exists()


def test_merge_refuses_no_slices_a_slice_as_out_and_a_finished_out(slices: list[Path], full: Path) -> None:
    with pytest.raises(MergeError, match="no slices given"):
        merge_slices([], slices[0].with_name("out"))
    with pytest.raises(MergeError, match=f"--out {slices[1]} is one of the slices; merge into a new directory"):
        merge_slices(slices, slices[1], sparse_indexes=False)
    assert validate_datastore(slices[1]) == []
    with pytest.raises(MergeError, match="already holds a finished datastore; use another --out or delete it"):
        merge_slices(slices, full, sparse_indexes=False)
    assert validate_datastore(full) == []


# ---- a damaged shard, found while the shards are taken ---------------------------------------------------------


def damage_shard(ds: Path, name: str, how: str) -> tuple[Path, str]:
    d = ds / SHARDS_DIR / name
    if how == "marker-missing":
        (d / SHARD_MARKER).unlink()
        return d / SHARD_MARKER, "missing or unreadable; rebuild this slice (same arguments resume it)"
    if how == "marker-differs":
        info = read_shard_info(d)
        assert info is not None
        (d / SHARD_MARKER).write_text(info.model_copy(update={"rows": info.rows + 1}).model_dump_json())
        return d / SHARD_MARKER, "differs from its slice manifest's entry; rebuild this slice"
    if how == "truncated":
        (d / LABELS).write_bytes((d / LABELS).read_bytes()[:-4])
        return d / LABELS, "(truncated or rewritten); rebuild this slice (re-running its build command"
    data = bytearray((d / LABELS).read_bytes())
    data[-1] ^= 0x01
    (d / LABELS).write_bytes(bytes(data))
    return d / LABELS, "sha256 mismatch (corrupted); rebuild this slice"


@pytest.mark.parametrize("how", ["marker-missing", "marker-differs", "truncated", "corrupted"])
def test_a_damaged_shard_stops_the_merge_and_the_repaired_slice_resumes_it(
    slices: list[Path], built: list[Path], full: Path, tmp_path: Path, how: str
) -> None:
    path, what = damage_shard(slices[1], "shard-00001", how)
    out = tmp_path / "out"
    with pytest.raises(MergeError) as err:
        merge_slices(slices, out, sparse_indexes=False)
    assert str(err.value).startswith(f"{path}: ") and what in str(err.value), err.value
    assert not (out / MANIFEST).exists()
    assert not (out / SHARDS_DIR / "shard-00001").exists()
    shutil.rmtree(slices[1])
    shutil.copytree(built[1], slices[1])  # the slice rebuilt
    merged = merge_slices(slices, out, sparse_indexes=False)
    assert merged.datastore_id == read_manifest(full).datastore_id and validate_datastore(out) == []
    assert np.array_equal(np.load(out / SHARDS_DIR / "shard-00001" / LABELS),
                          np.load(full / SHARDS_DIR / "shard-00001" / LABELS))  # fmt: skip
