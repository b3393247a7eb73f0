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
    deps = report.get("dependencies", [])
    audited = [d for d in deps if "skip_reason" not in d]
    if not audited:
        print(f"audit: NOT AUDITED: no vulnerability database reachable for any of {len(deps)} packages "
              "(offline machine); run `python .ci/audit.py` where PyPI's JSON API or OSV is reachable")
        return 0
    fixable, unfixed = [], []
    for d in audited:
        for v in d.get("vulns", []):
            (fixable if v.get("fix_versions") else unfixed).append(f"{d['name']} {d['version']}: {v['id']} "
                                                                   f"(fix: {', '.join(v.get('fix_versions', [])) or '-'})")
    for line in unfixed:
        print(f"audit: known, no fix released: {line}")
    for line in fixable:
        print(f"audit: VULNERABLE, fix available: {line}", file=sys.stderr)
    print(f"audit: {len(audited)}/{len(deps)} packages audited, {len(fixable)} fixable, {len(unfixed)} without fix")
    return 1 if fixable else 0


if __name__ == "__main__":
    raise SystemExit(main())
