"""scripts/check_commands.py: every `bert-knn` command line the Markdown shows parses with that command's parser."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.scripts import load_script

cc = load_script(Path("scripts/check_commands.py"), "check_commands")


def _failing(tmp_path: Path, text: str) -> list[str]:
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    return [f.why for f in cc.failing([page], tmp_path)[0]]


def test_the_repository_s_pages_pass() -> None:
    assert cc.main([]) == 0


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("```bash\nbert-knn eval lama --datastore /data/ds --lama ../lama\n```\n", "unrecognized arguments: --lama"),
        ("Run `bert-knn serve --wokers 2` to start.\n", "unrecognized arguments: --wokers"),
        ("```\nbert-knn serve --layout spilt\n```\n", "invalid choice: 'spilt'"),
        ("```\nbert-knn build --corpus c.jsonl --out d \\\n  --batch-size many\n```\n", "invalid int value: 'many'"),
        ("```\nBERTKNN_X=1 bert-knn sevre --port 8000\n```\n", "unknown command 'sevre'"),
        ("```\nbert-knn validate\n```\n", "arguments are required: datastore"),  # a whole line lacks nothing
    ],
)
def test_a_command_that_does_not_parse_is_named_with_argparse_s_reason(tmp_path: Path, text: str, needle: str) -> None:
    found = _failing(tmp_path, text)
    assert len(found) == 1 and needle in found[0], found


@pytest.mark.parametrize(
    "text",
    [
        "`bert-knn validate` prints the warnings.\n",  # prose names a command without its arguments
        "```\nbert-knn build --corpus ...\n```\n",  # an elided value
        "```\nbert-knn build --corpus C --out D --batch-size N --device cuda & done; wait\n```\n",  # placeholders
        "```\nfor i in 0 1; do bert-knn build --corpus C --out s/$i --shard-index $i --num-shards 2; done\n```\n",
        "```\n$ bert-knn serve --datastore /data/ds --port 8000   # --workers N\n```\n",
        "```\n  cli.py                 the bert-knn command\n```\n",  # a layout listing, not a shell line
    ],
)
def test_what_a_page_may_show_passes(tmp_path: Path, text: str) -> None:
    assert _failing(tmp_path, text) == []
