"""Audit the locked dependencies (requirements.lock) with pip-audit; fail on known vulnerabilities that have a fix.

Vulnerabilities without a released fix are reported but do not fail the run. When no vulnerability database can
be reached (an offline CI machine), the audit says so loudly and does not pretend to have passed or failed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

LOCK = Path(__file__).resolve().parents[1] / "requirements.lock"


def verdict(report: dict) -> tuple[int, list[str]]:
    """Exit code and report lines for a pip-audit JSON report: 1 when a vulnerability with a fix is known."""
    deps = report.get("dependencies", [])
    audited = [d for d in deps if "skip_reason" not in d]
    if not audited:
        return 0, [
            f"audit: NOT AUDITED: no vulnerability database reachable for any of {len(deps)} packages "
            "(offline machine); run `python .ci/audit.py` where PyPI's JSON API or OSV is reachable"
        ]
    fixable, unfixed = [], []
    for d in audited:
        for v in d.get("vulns", []):
            line = f"{d['name']} {d['version']}: {v['id']} (fix: {', '.join(v.get('fix_versions', [])) or '-'})"
            (fixable if v.get("fix_versions") else unfixed).append(line)
    lines = [f"audit: known, no fix released: {x}" for x in unfixed]
    lines += [f"audit: VULNERABLE, fix available: {x}" for x in fixable]
    skipped = len(deps) - len(audited)
    lines.append(
        f"audit: {len(audited)}/{len(deps)} packages audited ({skipped} not reachable), {len(fixable)} fixable, "
        f"{len(unfixed)} without fix"
    )
    return (1 if fixable else 0), lines


def main() -> int:
    proc = subprocess.run(
        [sys.executable, "-m", "pip_audit", "-r", str(LOCK), "--no-deps", "--disable-pip", "-f", "json",
         "--progress-spinner", "off"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        print(f"audit: pip-audit could not run ({proc.stderr.strip().splitlines()[-1:]}); no result", file=sys.stderr)
        return 0
    code, lines = verdict(report)
    for line in lines:
        print(line, file=sys.stderr if "VULNERABLE" in line else sys.stdout)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
