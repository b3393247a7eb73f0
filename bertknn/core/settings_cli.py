"""Command-line flags generated from pydantic-settings classes, so that flags and settings never drift apart.

Every field becomes ``--group-field`` (nested groups joined by ``-``); a flag given on the command line overrides
the environment, which overrides the default. The same walk over the fields writes docs/configuration.md.
"""

from __future__ import annotations

import argparse
import difflib
import os
import types
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

_SEP = "__"


@dataclass(frozen=True)
class SettingField:
    """One leaf setting: its path through the nested groups and what the flag needs."""

    path: tuple[str, ...]  # keys as the settings class takes them (aliases where a field has one)
    annotation: Any
    info: FieldInfo

    @property
    def flag(self) -> str:
        return "--" + "-".join(self.path).replace("_", "-")

    @property
    def dest(self) -> str:
        return _SEP.join(self.path)

    @property
    def env_suffix(self) -> str:
        return _SEP.join(p.upper() for p in self.path)

    @property
    def default(self) -> Any:
        if self.info.default_factory is not None:
            return self.info.default_factory()  # type: ignore[call-arg]
        return None if self.info.default is PydanticUndefined else self.info.default

    @property
    def required(self) -> bool:
        return self.info.is_required()


def _unwrap_optional(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _strip_annotated(annotation: Any) -> Any:
    while hasattr(annotation, "__metadata__"):
        annotation = get_args(annotation)[0]
    return annotation


def iter_fields(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[SettingField]:
    """The leaf settings of ``model``, nested groups (BaseModel fields) walked in declaration order: a class's own
    fields before those it inherits from a shared group of options (`bert-knn build`'s corpus, model and output
    before the codec's options)."""
    own = [n for n in vars(model).get("__annotations__", {}) if n in model.model_fields]
    for name in [*own, *(n for n in model.model_fields if n not in own)]:
        info = model.model_fields[name]
        key = info.alias or name
        annotation = _unwrap_optional(_strip_annotated(info.annotation))
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and not _is_leaf_model(annotation):
            yield from iter_fields(annotation, (*prefix, key))
        else:
            yield SettingField((*prefix, key), annotation, info)


def _is_leaf_model(model: type[BaseModel]) -> bool:
    """A model given as one value (a file path or JSON), not as a group of flags."""
    return bool(getattr(model, "__settings_leaf__", False))


def _flag_options(field: SettingField) -> dict[str, Any]:
    ann = field.annotation
    help_text = (field.info.description or "").replace("%", "%%")  # argparse formats help with %
    opts: dict[str, Any] = {"dest": field.dest, "default": argparse.SUPPRESS}
    if get_origin(ann) is Literal:
        choices = list(get_args(ann))
        opts.update(choices=choices, type=type(choices[0]))
    elif ann is bool:
        opts["action"] = argparse.BooleanOptionalAction
    elif get_origin(ann) is list:
        (item,) = get_args(ann) or (str,)
        opts.update(action="append", type=item if item in (int, float, str, Path) else str)
        help_text += " (repeatable)"
    elif ann in (int, float, str, Path):
        opts["type"] = ann
    elif ann is SecretStr:
        opts["type"] = str
    else:
        opts["type"] = str
        help_text += " (a file path or a JSON object)"
    default = field.default
    if default not in (None, "", [], ()) and not isinstance(default, BaseModel):
        help_text += f" [default: {default}]"
    opts["help"] = help_text.strip() or None
    return opts


def add_command(sub: Any, name: str, summary: str, detail: str = "") -> argparse.ArgumentParser:
    """A subcommand (``sub``: an ``add_subparsers`` result) whose ``--help`` opens with the line that the list of
    commands shows for it (``summary``: `bertknn.core.commands.SUMMARIES`' for a ``bert-knn`` command), then
    ``detail``."""
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=summary, description=f"{summary}: {detail}" if detail else summary
    )
    return parser


def add_settings_flags(
    parser: argparse.ArgumentParser,
    model: type[BaseModel],
    *,
    aliases: Mapping[str, Sequence[str]] | None = None,
    skip: Sequence[str] = (),
) -> None:
    """One flag per leaf setting of ``model``; ``aliases`` maps a dotted path (``model.name``) to extra flag
    names kept for existing scripts (``--model``); paths in ``skip`` get no flag."""
    aliases = aliases or {}
    for field in iter_fields(model):
        dotted = ".".join(field.path)
        if dotted in skip:
            continue
        names = [*aliases.get(dotted, ()), field.flag]
        parser.add_argument(*dict.fromkeys(names), **_flag_options(field))


def settings_overrides(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The flags that were given, as the nested keyword arguments ``model(**overrides)`` takes."""
    out: dict[str, Any] = {}
    given = vars(args)
    for field in iter_fields(model):
        if field.dest not in given:
            continue
        node = out
        for key in field.path[:-1]:
            node = node.setdefault(key, {})
        node[field.path[-1]] = given[field.dest]
    return out


def flag_for(loc: Sequence[object]) -> str:
    """The flag that sets a validation error's location (``("cache", "ttl_s")`` -> ``--cache-ttl-s``)."""
    parts = [str(x) for x in loc if not isinstance(x, int)]
    return "--" + "-".join(parts).replace("_", "-") if parts else "settings"


def error_message(err: Mapping[str, Any]) -> str:
    """A validation error's message without pydantic's "Value error, " in front of the project's own words."""
    return str(err["msg"]).removeprefix("Value error, ")


def error_source(
    loc: Sequence[object], cls: type[BaseModel], given: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> str:
    """How to name the setting of a validation error: its flag when the command line gave it (``given``:
    `settings_overrides`), else the environment variable that did (``BERTKNN_CACHE__TTL_S``), else its flag."""
    parts = tuple(str(x) for x in loc if not isinstance(x, int))
    node: Any = given
    for part in parts:
        if not isinstance(node, Mapping) or part not in node:
            break
        node = node[part]
    else:
        return flag_for(loc)
    env = os.environ if environ is None else environ
    upper = {k.upper(): k for k in env}
    named = [upper[name] for name, path in env_variables(cls).items() if path == parts and name in upper]
    return named[0] if named else flag_for(loc)


def adopt_legacy_env(old_prefix: str, new_prefix: str, environ: dict[str, str] | None = None) -> list[str]:
    """Copy variables spelled the old way (``BERTKNN_BUILD_BATCH_SIZE``) to the one scheme
    (``BERTKNN_BUILD__BATCH_SIZE``) when the new name is unset; returns the old names found, for a warning."""
    env = os.environ if environ is None else environ
    found = []
    for name in list(env):
        if name.startswith(old_prefix) and not name.startswith(new_prefix):
            found.append(name)
            env.setdefault(new_prefix + name[len(old_prefix) :], env[name])
    return found


def model_type(annotation: Any) -> type[BaseModel] | None:
    """The settings group an annotation holds (``CacheSettings``, also inside Optional or Annotated), else None."""
    candidates = [annotation, *get_args(annotation)]
    return next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)


def env_variables(cls: type[BaseModel]) -> dict[str, tuple[str, ...]]:
    """Every environment variable a settings class reads, upper case -> the path of the field it sets; a nested
    group's own name too (pydantic-settings takes a whole group as JSON)."""
    cfg = cls.model_config
    prefix = str(cfg.get("env_prefix", "")).upper()
    delim = str(cfg.get("env_nested_delimiter") or "")
    out: dict[str, tuple[str, ...]] = {}

    def walk(model: type[BaseModel], env_prefix: str, path: tuple[str, ...]) -> None:
        for name, info in model.model_fields.items():
            nested = model_type(info.annotation)
            aliases = [a for a in (info.alias, info.validation_alias) if isinstance(a, str)]
            for key in dict.fromkeys([name, *aliases]):
                env = f"{env_prefix}{key}".upper()
                out[env] = (*path, name)
                if nested is not None and delim:
                    walk(nested, f"{env}{delim}", (*path, name))

    walk(cls, prefix, ())
    return out


def unknown_variables(
    known: Iterable[str], namespace: str, *, others: Sequence[str] = (), environ: Mapping[str, str] | None = None
) -> list[str]:
    """One warning per variable named ``namespace``* that sets nothing: pydantic-settings ignores such a variable,
    so a misspelt setting would keep its default without a word. ``known``: the variables that do set something
    (`env_variables`); ``others``: prefixes of names another command or the service's own processes read."""
    env = os.environ if environ is None else environ
    names = {k.upper() for k in known}
    out = []
    for name in sorted(env):
        upper = name.upper()
        if not upper.startswith(namespace) or upper in names or upper.startswith(tuple(others)):
            continue
        close = difflib.get_close_matches(upper, names, n=1, cutoff=0.8)
        hint = f"; did you mean {close[0]}?" if close else ""
        out.append(f"the environment variable {name} is not a setting and is ignored{hint} (docs/configuration.md)")
    return out
