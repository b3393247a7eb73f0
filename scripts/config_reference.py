"""Write docs/configuration.md from the settings classes; ``--check`` fails when the file is not current (CI)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pydantic import BaseModel

from bertknn.builder.settings import AddSettings, BuildSettings
from bertknn.core.settings_cli import iter_fields
from bertknn.service.__main__ import ALIASES
from bertknn.service.settings import ServiceSettings

OUT = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
SECTIONS: list[tuple[str, str, type[BaseModel], str, dict[str, tuple[str, ...]]]] = [
    ("`bert-knn serve` (the service)", "BERTKNN_", ServiceSettings, "bert-knn serve", ALIASES),
    ("`bert-knn build`", "BERTKNN_BUILD__", BuildSettings, "bert-knn build", {}),
    ("`bert-knn add`", "BERTKNN_ADD__", AddSettings, "bert-knn add", {}),
]


def _type(annotation: object) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "").replace("pathlib.", "").replace("|", "\\|")


def _default(value: object) -> str:
    if isinstance(value, BaseModel):
        return "see its fields"
    return "" if value is None else f"`{value}`"


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the settings classes by `python scripts/config_reference.py`; CI fails when it is stale.",
        "",
        "One scheme everywhere: a setting is a flag (`--group-name`) and an environment variable (prefix, then the",
        "group and the name joined by `__`). A flag beats the environment, which beats the default. Secrets",
        "(`admin_token`, `cache.redis_url`) are never logged or echoed.",
        "",
        "A variable with a command's prefix that sets nothing (`BERTKNN_BATCHING__MAXBATCH`) would keep the default",
        "without a word, so `bert-knn serve` and the builder's commands warn of it at start, with the setting it most",
        "likely meant. A bad value is refused in one line that names where it was given: the flag, or the variable.",
        "",
    ]
    for title, prefix, cls, command, aliases in SECTIONS:
        lines += [f"## {title}", "", f"Environment prefix `{prefix}`; flags on `{command}`.", "",
                  "| flag | environment | type | default | description |", "|---|---|---|---|---|"]
        for f in iter_fields(cls):
            dotted = ".".join(f.path)
            flags = ", ".join(f"`{x}`" for x in (*aliases.get(dotted, ()), f.flag))
            desc = (f.info.description or "").replace("|", "\\|").replace("\n", " ")
            default = "required" if f.required else _default(f.default)
            lines.append(f"| {flags} | `{prefix}{f.env_suffix}` | {_type(f.annotation)} | {default} | {desc} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--check", action="store_true", help="exit 1 when docs/configuration.md is not current")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT} is stale: run `python scripts/config_reference.py`", file=sys.stderr)
            return 1
        print(f"{OUT}: current")
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
