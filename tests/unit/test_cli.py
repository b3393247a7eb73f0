"""`bert-knn`: each command's help and errors name the command a user typed, not the module behind it."""

from __future__ import annotations

import re

import pytest

from bertknn.cli import main

COMMANDS = ["build", "add", "validate", "merge", "serve", "eval", "predict"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_names_the_command_typed(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    usage = capsys.readouterr().out.splitlines()[0]
    assert usage.startswith(f"usage: bert-knn {command}"), usage
    assert "python -m" not in usage


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
