"""`bert-knn`: each command's help and errors name the command a user typed, not the module behind it."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest

from bertknn.cli import main
from tests.conftest import REPO

SAMPLE = REPO / "data" / "sample_wiki.jsonl"
COMMANDS = ["build", "add", "validate", "merge", "serve", "eval", "predict"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_names_the_command_typed(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    usage = capsys.readouterr().out.splitlines()[0]
    assert usage.startswith(f"usage: bert-knn {command}"), usage
    assert "python -m" not in usage


@pytest.mark.parametrize("argv", [["calibrate"], ["validate"], ["build"], ["eval", "lama"], ["eval", "follow"], ["predict"]])
def test_help_opens_with_what_the_command_does(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """The line the command list shows for it, under the usage (not a bare list of flags)."""
    with contextlib.suppress(SystemExit):  # (bert-knn's own list returns; argparse's exits)
        main([*argv[:-1], "--help"])  # the list of commands (of bert-knn, or of its group)
    listed = capsys.readouterr().out
    line = re.search(rf"^ +{re.escape(argv[-1])} +(\S.*)$", listed, flags=re.M)
    assert line is not None, listed
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    described = " ".join(capsys.readouterr().out.split("\n\n")[1].split())
    assert described.startswith(line.group(1).strip()), (described, line.group(1))


@pytest.mark.parametrize(("command", "first"), [("build", ["--corpus", "--model", "--out"]), ("recode", ["--datastore", "--out"])])
def test_a_command_s_own_flags_come_before_the_shared_codec_options(
    command: str, first: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main([command, "--help"])
    usage = capsys.readouterr().out.split("\n\n")[0]
    flags = re.findall(r"\[(--[a-z-]+)", usage)
    assert flags[: len(first)] == first and flags.index("--codec") >= len(first), flags


def test_the_command_list_is_one_aligned_column(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--help"])
    rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r"^  [a-z]", line)]
    starts = {re.match(r"^  \S+ +", line).end() for line in rows}  # type: ignore[union-attr]
    assert len(rows) >= 12 and len(starts) == 1, rows  # (train-codec is the longest name)


@pytest.mark.parametrize(("argv", "named"), [(["predict"], "bert-knn predict"), (["eval", "lama", "--n"], "bert-knn eval lama")])
def test_a_wrong_call_names_the_command_typed(argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"{named}: error:" in err, err


def test_every_flag_of_predict_says_what_it_does(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["predict", "--help"])
    options = capsys.readouterr().out.split("options:")[1]
    entries = re.findall(r"^  (-.*?)(?=^  -|\Z)", options, flags=re.M | re.S)
    said = {e.split()[0].rstrip(","): [w for w in e.split() if not re.fullmatch(r"-.*|[A-Z_]+,?|\{.*\},?", w)]
            for e in entries}  # fmt: skip
    assert set(said) >= {"--url", "--subject", "--top-k", "--retriever", "--interpolation", "--json"}, said
    assert all(len(words) >= 2 for words in said.values()), said


@pytest.mark.parametrize(("argv", "line"), [
    (["eval", "lama", "--k", "0"], "argument --k: 0: must be at least 1"),
    (["eval", "lama", "--num-articles", "x"], "argument --num-articles: 'x': give a whole number"),
    (["eval", "lama", "--lambda", "2"], "argument --lambda: 2: must be between 0 and 1"),
    (["eval", "lama", "--lambda", "nan"], "argument --lambda: nan: must be between 0 and 1"),
    (["eval", "lama", "--mlm-prior", "-1"], "argument --mlm-prior: -1: must be at least 0"),
    (["eval", "lama", "--batch-size", "0"], "argument --batch-size: 0: must be at least 1"),
    (["eval", "follow", "--datastore", "ds", "--beam", "0"], "argument --beam: 0: must be at least 1"),
    (["eval", "self-probe", "--datastore", "ds", "--threads", "-1"], "argument --threads: -1: must be at least 0"),
])  # fmt: skip
def test_eval_refuses_an_out_of_range_setting_before_any_work(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not a traceback from deep in a run (an AssertionError for --k 0, a ValueError for --lambda 2): the flag,
    in argparse's one line."""
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"error: {line}")


def test_predict_refuses_a_bad_flag_in_one_line_per_flag_before_asking(capsys: pytest.CaptureFixture[str]) -> None:
    # (nothing listens at the URL: the check comes first)
    assert main(["predict", "", "--top-k", "0", "--mlm-prior", "-1", "--url", "http://127.0.0.1:9"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: text: String should have at least 1 character",
        "error: --top-k: Input should be greater than or equal to 1",
        "error: --mlm-prior: Input should be greater than or equal to 0",
    ]


@pytest.mark.parametrize(
    ("argv", "code", "says"),
    [
        (["build"], 1, "no corpus given: pass --corpus FILE (JSONL or MediaWiki XML dump), repeatable"),
        (["train-codec", "--corpus", str(SAMPLE)], 1, "train-codec trains a codec: give --codec int8 or --codec pq"),
        (["build", "--corpus", str(SAMPLE), "--index", "idx.txt.bz2", "--no-multistream"], 1,
         "--index was given together with --no-multistream; leave one out"),
        (["build", "--corpus", str(SAMPLE), "--language", "english"], 2,  # a setting's value: a usage error
         "--language: language 'english': give a Wikipedia language code such as en, de, ja, uk or vi"),
    ],
)  # fmt: skip
def test_the_builder_refuses_a_call_it_cannot_run_before_any_work(
    tmp_path: Path, argv: list[str], code: int, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from bertknn.builder.__main__ import main as builder_main

    out = tmp_path / "out"
    assert builder_main([*argv, "--out", str(out)]) == code
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"error: {says}"
    assert not out.exists()
