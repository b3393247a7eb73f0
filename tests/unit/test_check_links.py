"""scripts/check_links.py: every relative link of the repository's Markdown leads to a file and a heading."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.scripts import REPO, load_script

cl = load_script(Path("scripts/check_links.py"), "check_links")


def test_the_repository_s_pages_pass() -> None:
    assert cl.main([]) == 0


def test_anchors_are_github_s() -> None:
    assert cl.slug("Host work (what a GPU's throughput divides by)") == "host-work-what-a-gpus-throughput-divides-by"
    assert cl.slug("`bert-knn serve --workers`: one *port*") == "bert-knn-serve---workers-one-port"
    assert cl.slug("See [the API](api.md) first") == "see-the-api-first"
    assert cl.slug("Übersicht: 東京 & snake_case") == "übersicht-東京--snake_case"
    page = "# Figures\n\n## Figures\n\n```\n# not a heading\n```\n## Figures ##\n"
    assert cl.anchors(page) == {"figures", "figures-1", "figures-2"}


def _page(tmp_path: Path, text: str) -> list[str]:
    (tmp_path / "docs").mkdir(exist_ok=True)
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## A part (of it)\n", encoding="utf-8")
    page = tmp_path / "docs" / "page.md"
    page.write_text(text, encoding="utf-8")
    return [str(b) for b in cl.check_page(page, tmp_path)]


def test_a_missing_file_or_heading_is_named_with_its_line(tmp_path: Path) -> None:
    text = (
        "# Page\n\n"
        "[fine](other.md), [fine too](other.md#a-part-of-it), [here](#page), [up](../docs/other.md)\n"
        "[gone](missing.md) and ![img](img/none.png)\n"
        "[no part](other.md#a-part) [no heading here](#nothing)\n"
        "[out](../../elsewhere.md)\n"
    )
    assert _page(tmp_path, text) == [
        "docs/page.md:4: missing.md: no such file",
        "docs/page.md:4: img/none.png: no such file",
        "docs/page.md:5: other.md#a-part: no heading with the anchor #a-part in other.md",
        "docs/page.md:5: #nothing: no heading with the anchor #nothing in page.md",
        "docs/page.md:6: ../../elsewhere.md: outside the repository",
    ]


def test_links_with_a_scheme_and_links_in_code_are_not_checked(tmp_path: Path) -> None:
    text = (
        "# Page\n\n[web](https://example.org/x.md) [mail](mailto:a@b.c)\n"
        "`[inline](missing.md)`\n\n```\n[fenced](missing.md)\n```\n"
    )
    assert _page(tmp_path, text) == []


def test_the_command_fails_on_a_broken_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cl.main([str(REPO / "docs" / "limits.md")]) == 0
    broken = tmp_path / "broken.md"
    broken.write_text("# Broken\n\n[x](nowhere.md)\n", encoding="utf-8")
    monkeypatch.setattr(cl, "REPO", tmp_path)
    assert cl.main([str(broken)]) == 1
    assert "broken.md:3: nowhere.md: no such file" in capsys.readouterr().out
