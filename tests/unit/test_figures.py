"""scripts/check_figures.py: every figure in README.md and docs/ is a value that a results file its passage cites holds,
a ratio of two such figures, a setting's default, a published figure next to the paper's name, or an entry of the
unverified list; a figure edited by hand fails."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.support.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
cf = load_script(Path("scripts/check_figures.py"), "check_figures")


def _doc(tmp_path: Path, text: str) -> Path:
    (tmp_path / "docs").mkdir(exist_ok=True)
    (tmp_path / "README.md").write_text(text, encoding="utf-8")
    return tmp_path


def _absent(near: float, decimals: int, files: tuple[str, ...]) -> str:
    """A number written with ``decimals`` that no cited file holds at any scale: what a careless hand edit writes."""
    checker = cf.Checker()
    values = checker.values(files) + checker.defaults
    step = 10.0**-decimals
    for i in range(1, 10_000):
        candidate = near + i * step
        fig = cf.Figure("x", "", candidate, decimals, "", "", files)
        if not cf.supported(fig, values):
            return f"{candidate:.{decimals}f}"
    raise AssertionError("no absent value near the figure")


def test_the_repository_s_docs_pass() -> None:
    assert [f"{f.doc}: {f.text} ({f.context})" for f in cf.new_figures()] == []


def test_the_unverified_list_has_no_stale_entries() -> None:
    keys = {fig.key() for fig in cf.unsupported(cf.documents())}
    assert [line for line in cf.read_unverified() if line not in keys] == []


def test_a_headline_figure_edited_by_hand_fails(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    row = next(line for line in readme.splitlines() if line.startswith("| **Real article text**"))
    fig = next(f for f in cf._unit_figures("README.md", cf.plain(row), cf.cited_files(row), 0) if f.text == "34.0")
    edited = _absent(fig.value, fig.decimals, fig.cited)
    root = _doc(tmp_path, readme.replace(row, row.replace("34.0", edited, 1)))
    failing = [f.text for f in cf.new_figures(root, listed=[])]
    assert edited in failing
    assert cf.new_figures(_doc(tmp_path, readme), listed=[]) == []


def test_an_unverified_figure_edited_by_hand_fails(tmp_path: Path) -> None:
    """An entry of the list covers its figure as written, in its sentence: the figure edited is a new one."""
    root = _doc(tmp_path, "# T\n\nA run long ago took 12.34 ms.\n")
    listed = [f.key() for f in cf.new_figures(root, listed=[])]
    assert len(listed) == 1 and cf.new_figures(root, listed=listed) == []
    root = _doc(tmp_path, "# T\n\nA run long ago took 12.37 ms.\n")
    assert [f.text for f in cf.new_figures(root, listed=listed)] == ["12.37 ms"]


def test_no_figure_of_the_docs_is_left_unverified() -> None:
    """Every figure in README.md and docs/ is a value of a results file its passage cites: the list is empty."""
    assert cf.read_unverified() == []


def test_a_figure_whose_passage_cites_no_command_fails(tmp_path: Path) -> None:
    root = _doc(tmp_path, "# T\n\nThe service answers 1,234.5 requests a second.\n")
    assert [f.text for f in cf.new_figures(root, listed=[])] == ["1,234.5"]


def test_what_made_a_result_holds_no_figure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A results file's command line and commit (bench.common.provenance) are not measurements: a figure that
    only they hold fails."""
    results = tmp_path / "results"
    results.mkdir()
    made = {"command": "python -m bench.x --requests 3917", "source": "8bf259f056f8", "p50_ms": 1.25}
    (results / "x.json").write_text(json.dumps(made))
    monkeypatch.setattr(cf, "RESULTS", results)
    assert list(cf.numbers(made)) == [1.25]
    root = _doc(tmp_path, "# T\n\n`python -m bench.x`: 3,917 requests, p50 1.25 ms.\n")
    assert [f.text for f in cf.new_figures(root, listed=[])] == ["3,917"]


def test_a_quoted_command_must_be_the_one_its_results_file_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "x.json").write_text(json.dumps({"command": "python -m bench.x --requests 3000", "ms": 1.5}))
    (results / "old.json").write_text(json.dumps({"ms": 1.5}))  # written before results recorded their command
    monkeypatch.setattr(cf, "RESULTS", results)

    def wrong(text: str) -> list[str]:
        return cf.wrong_commands([_doc(tmp_path, text) / "README.md"], tmp_path)

    assert wrong("# T\n\n`python -m bench.x --requests 3000` (`bench/results/x.json`): 1.5 ms.\n") == []
    assert wrong("# T\n\n`python -m bench.x\n--requests 3000` (`bench/results/x.json`).\n") == []  # across lines
    assert wrong("# T\n\n`python -m bench.y --fast` beside `bench/results/x.json`.\n") == []  # another bench
    assert wrong("# T\n\n`python -m bench.x --requests 100` (`bench/results/old.json`).\n") == []  # none recorded
    assert wrong("# T\n\n`python -m bench.x --requests 100` (`bench/results/x.json`): 1.5 ms.\n") == [
        "README.md: quotes 'python -m bench.x --requests 100' beside x.json, which `python -m bench.x --requests "
        "3000` wrote"
    ]
    # another paragraph's command is not this one's
    assert wrong("# T\n\n`python -m bench.x --requests 100`.\n\nIt wrote `bench/results/x.json`.\n") == []


def test_a_section_s_citation_covers_its_subsections(tmp_path: Path) -> None:
    quality = json.loads((REPO / "bench/results/quality.json").read_text())
    contexts = quality["datastore"]["contexts"]
    text = f"# T\n\n`python -m bench.quality`\n\n## Sub\n\nIt stores {contexts:,} contexts.\n\n# Other\n\n{contexts:,}.\n"
    failing = cf.new_figures(_doc(tmp_path, text), listed=[])
    assert [(f.text, f.context) for f in failing] == [(f"{contexts:,}", f"{contexts:,}.")]


def test_ratios_must_be_the_ratio_of_their_passage_s_figures(tmp_path: Path) -> None:
    hostwork = json.loads((REPO / "bench/results/hostwork.json").read_text())
    ms = hostwork["bare_forward_ms"]
    onnx, eager = ms["onnx_p50"], ms["eager_p50"]
    good = f"{eager / onnx:.2f}x"
    # (a wrong ratio that a cited file holds by chance would pass: the command cites every hostwork*.json)
    held = {f"{v:.2f}" for v in cf.Checker().values(cf.cited_files("`python -m bench.hostwork`"))}
    wrong = next(f"{eager / onnx + off / 100:.2f}x" for off in range(37, 400) if f"{eager / onnx + off / 100:.2f}" not in held)
    line = "`python -m bench.hostwork`: eager {e:.2f} / ONNX Runtime {o:.2f} ms = {r}\n"
    root = _doc(tmp_path, "# T\n\n" + line.format(e=eager, o=onnx, r=good))
    assert cf.new_figures(root, listed=[]) == []
    root = _doc(tmp_path, "# T\n\n" + line.format(e=eager, o=onnx, r=wrong))
    assert [f.text for f in cf.new_figures(root, listed=[])] == [wrong]


def test_a_figure_in_scientific_notation_is_checked_whole(tmp_path: Path) -> None:
    """``9.5e-7`` is one figure, rounded at its own exponent: not ``9.5`` (which a file may hold by chance)."""
    numerics = json.loads((REPO / "bench/results/numerics.json").read_text())
    tiny = min(v for v in cf.numbers(numerics) if 0 < v < 1e-3)
    mantissa, exponent = f"{tiny:.1e}".split("e")
    written = f"{mantissa}e{int(exponent)}"
    root = _doc(tmp_path, f"# T\n\n`python -m bench.numerics`: a difference of {written}.\n")
    assert cf.new_figures(root, listed=[]) == []
    off = f"{float(mantissa) + 0.3:.1f}e{int(exponent)}"
    root = _doc(tmp_path, f"# T\n\n`python -m bench.numerics`: a difference of {off}.\n")
    assert [f.text for f in cf.new_figures(root, listed=[])] == [off]


def test_each_number_of_a_list_ending_in_a_unit_is_a_figure(tmp_path: Path) -> None:
    """``99 / 93 / 95 %``: the unit is written once, after the last; each number is checked, not only that one
    (the README once said 99 / 93 / 95 where the cited file held 100 / 95 / 96)."""
    table = json.loads((REPO / "bench/results/languages.json").read_text())["table"]
    row = next(line for line in table.splitlines() if "BM25 top 3" in line)
    ja, uk, vi = (float(c.strip(" %")) for c in row.split("|")[2:5])
    good = f"{ja:.0f} / {uk:.0f} / {vi:.0f} %"
    root = _doc(tmp_path, f"# T\n\n`python -m bench.languages`: own article in the top 3 {good}.\n")
    assert cf.new_figures(root, listed=[]) == []
    bad = f"{ja - 1:.0f} / {uk - 2:.0f} / {vi:.0f} %"
    root = _doc(tmp_path, f"# T\n\n`python -m bench.languages`: own article in the top 3 {bad}.\n")
    assert [f.text for f in cf.new_figures(root, listed=[])] == [f"{ja - 1:.0f}", f"{uk - 2:.0f}"]


def test_published_figures_pass_only_next_to_the_paper_s_name(tmp_path: Path) -> None:
    root = _doc(tmp_path, "# T\n\nThe paper reports 39.4 P@1.\n\nWe measured 39.4 P@1.\n")
    failing = cf.new_figures(root, listed=[])
    assert [f.context for f in failing] == ["We measured 39.4 P@1."]


@pytest.mark.parametrize("text", ["torch 2.13 CPU", "pyserini 0.25", "Python 3.11", "`python -m x --limit 1.5`",
                                  "[link](docs/a-1.5.md)", "on 2026-11-27", "lambda 0.3", "k=1.5"])
def test_versions_code_links_dates_and_parameters_are_not_figures(tmp_path: Path, text: str) -> None:
    assert cf.new_figures(_doc(tmp_path, f"# T\n\n{text}\n"), listed=[]) == []


def test_prune_drops_only_stale_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    listed = tmp_path / "figures_unverified.tsv"
    shutil.copy(cf.UNVERIFIED, listed)
    with listed.open("a", encoding="utf-8") as f:
        f.write("docs/gone.md\t1.5\tsomething that is no longer written 1.5\n")
    monkeypatch.setattr(cf, "UNVERIFIED", listed)
    assert cf.main(["--prune"]) == 0
    assert cf.read_unverified(listed) == cf.read_unverified(REPO / "scripts" / "figures_unverified.tsv")
