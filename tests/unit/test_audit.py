"""The CI audit's decision: fail on a known vulnerability with a fix, report the rest, never fake a pass."""

from __future__ import annotations

from pathlib import Path

from tests.support.scripts import load_script

audit = load_script(Path(".ci/audit.py"), "ci_audit")


def dep(name: str, version: str, *vulns: dict) -> dict:
    return {"name": name, "version": version, "vulns": list(vulns)}


def test_fixable_vulnerability_fails_the_run() -> None:
    report = {"dependencies": [dep("jinja2", "2.10", {"id": "PYSEC-2019-217", "fix_versions": ["2.10.1"]}),
                               dep("numpy", "2.0.0")]}
    code, lines = audit.verdict(report)
    assert code == 1
    assert any("VULNERABLE" in x and "jinja2 2.10: PYSEC-2019-217 (fix: 2.10.1)" in x for x in lines)
    assert lines[-1].startswith("audit: 2/2 packages audited")


def test_vulnerability_without_fix_is_reported_but_passes() -> None:
    code, lines = audit.verdict({"dependencies": [dep("foo", "1.0", {"id": "GHSA-x", "fix_versions": []})]})
    assert code == 0
    assert any("no fix released: foo 1.0: GHSA-x" in x for x in lines)


def test_unreachable_database_says_not_audited() -> None:
    report = {"dependencies": [{"name": "foo", "version": "1.0", "skip_reason": "could not reach PyPI"}]}
    code, lines = audit.verdict(report)
    assert code == 0 and lines == [lines[0]] and "NOT AUDITED" in lines[0]


def test_partly_reachable_counts_skipped_packages() -> None:
    report = {"dependencies": [dep("a", "1"), {"name": "b", "version": "2", "skip_reason": "timeout"}]}
    code, lines = audit.verdict(report)
    assert code == 0 and "1/2 packages audited (1 not reachable)" in lines[-1]
