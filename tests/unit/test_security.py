"""Security properties of the code itself (issue 8): no unpickling anywhere, models from safetensors, no request
text in logs or Redis keys.

The code checks read the syntax tree (``ast``), so a word in a comment or a docstring never counts and an
aliased import (``import numpy as n; n.load(...)``) still does.
"""

from __future__ import annotations

import ast
import inspect
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp

from tests.conftest import REPO

SCANNED = ("bertknn", "service", "datastore_builder", "evaluation", "bench", "docker")
UNPICKLING_MODULES = {"pickle", "_pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader"}
ALWAYS_UNSAFE = {"pandas.read_pickle", "yaml.unsafe_load", "yaml.full_load", "yaml.unsafe_load_all", "yaml.full_load_all"}


@dataclass(frozen=True)
class Finding:
    where: str  # file:line
    what: str


def _qualified(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``np.load`` -> ``numpy.load`` given ``import numpy as np``; None for calls on computed values."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        base = _qualified(node.value, aliases)
        return f"{base}.{node.attr}" if base else None
    return None


def _aliases(tree: ast.AST) -> dict[str, str]:
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    out[a.asname] = a.name
                else:
                    top = a.name.split(".")[0]
                    out[top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_const(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def scan_source(source: str, where: str) -> tuple[list[Finding], list[str]]:
    """Unsafe deserialisation in one module: (findings, the np.load calls seen, as file:line)."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    findings: list[Finding] = []
    np_loads: list[str] = []

    def report(node: ast.AST, what: str) -> None:
        findings.append(Finding(f"{where}:{getattr(node, 'lineno', 0)}", what))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in UNPICKLING_MODULES:
                    report(node, f"import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in UNPICKLING_MODULES:
            report(node, f"from {node.module} import ...")
        if not isinstance(node, ast.Call):
            continue
        name = _qualified(node.func, aliases) or ""
        has_star_kwargs = any(k.arg is None for k in node.keywords)
        if name in ("eval", "exec", "builtins.eval", "builtins.exec"):
            report(node, f"{name}()")
        elif name == "torch.load":
            if not _is_const(_keyword(node, "weights_only"), True):
                report(node, "torch.load without weights_only=True")
        elif name in ("numpy.load", "numpy.lib.format.read_array"):
            np_loads.append(f"{where}:{node.lineno}")
            allow = _keyword(node, "allow_pickle")
            if has_star_kwargs or (allow is not None and not _is_const(allow, False)) or len(node.args) > 2:
                report(node, f"{name} that may allow pickles (pass allow_pickle=False or nothing)")
        elif name in ALWAYS_UNSAFE:
            report(node, f"{name}()")
        elif name in ("yaml.load", "yaml.load_all"):
            loader = _keyword(node, "Loader") or (node.args[1] if len(node.args) > 1 else None)
            loader_name = (_qualified(loader, aliases) or "") if loader is not None else ""
            if loader_name.rsplit(".", 1)[-1] not in SAFE_YAML_LOADERS:
                report(node, f"{name} without Loader=yaml.SafeLoader")
        if name.endswith("from_pretrained") and _is_const(_keyword(node, "use_safetensors"), False):
            report(node, "from_pretrained(use_safetensors=False)")
    return findings, np_loads


def project_files() -> Iterator[Path]:
    for top in SCANNED:
        yield from sorted((REPO / top).rglob("*.py"))


def test_the_scanner_finds_what_it_should_and_ignores_comments() -> None:
    source = '''
"""Docstrings may say pickle.load(x), torch.load(p) and eval(s): they are not code."""
import pickle  # flagged
import numpy as n
import torch
import yaml
from joblib import load  # flagged
from numpy import load as npl

# eval("1 + 1"), np.load(p, allow_pickle=True) in a comment: not code
model.eval()  # a method named eval is not the builtin
eval("1 + 1")  # flagged
torch.load("w.pt")  # flagged
torch.load("w.pt", weights_only=True)
n.load("a.npy", allow_pickle=True)  # flagged
n.load("a.npy", allow_pickle=False)
n.load("a.npy", mmap_mode="r")
npl("a.npy", **options)  # flagged: cannot tell
yaml.load(text)  # flagged
yaml.load(text, Loader=yaml.SafeLoader)
yaml.safe_load(text)
yaml.full_load(text)  # flagged
Model.from_pretrained("m", use_safetensors=False)  # flagged
Model.from_pretrained("m", use_safetensors=None)
'''
    findings, np_loads = scan_source(source, "example.py")
    flagged = sorted(int(f.where.split(":")[1]) for f in findings)
    want = sorted(i + 1 for i, line in enumerate(source.splitlines()) if line.endswith("# flagged") or
                  line.endswith("# flagged: cannot tell"))  # fmt: skip
    assert flagged == want, findings
    assert len(np_loads) == 4


def test_no_unpickling_eval_or_unsafe_yaml_in_the_project() -> None:
    findings: list[Finding] = []
    np_loads: list[str] = []
    files = list(project_files())
    assert len(files) > 30  # the scan really covers the code base
    for path in files:
        found, loads = scan_source(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
        findings += found
        np_loads += loads
    assert findings == []
    # The memory-mapped shard reader and the TF-IDF reader are among the np.load calls checked above.
    assert any(w.startswith("bertknn/core/format/reader.py:") for w in np_loads), np_loads
    assert any(w.startswith("bertknn/service/retrieval/sparse.py:") for w in np_loads), np_loads


def test_numpy_and_scipy_refuse_pickles_by_default(tmp_path: Path) -> None:
    """Calls that leave allow_pickle out rely on numpy's default: check that it is False, and that it bites."""
    assert inspect.signature(np.load).parameters["allow_pickle"].default is False
    evil = tmp_path / "evil.npy"
    np.save(evil, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match="allow_pickle=False"):
        np.load(evil)
    with pytest.raises(ValueError, match="Python objects"):  # the shard reader's memory-mapped load
        np.load(evil, mmap_mode="r")
    # scipy's load_npz (the TF-IDF postings) reads with allow_pickle=False too.
    npz = tmp_path / "evil.npz"
    np.savez(npz, format=np.array(["csr"]), shape=np.array([1, 1]), data=np.array([{"a": 1}], dtype=object),
             indices=np.array([0]), indptr=np.array([0, 1]))  # fmt: skip
    with pytest.raises(ValueError, match="allow_pickle=False"):
        sp.load_npz(npz)


def test_the_shard_reader_refuses_an_object_array(tmp_path: Path) -> None:
    from bertknn.core.errors import DatastoreError
    from bertknn.core.format import FileInfo, Shard, ShardInfo

    shard_dir = tmp_path / "shards" / "shard-00000"
    shard_dir.mkdir(parents=True)
    np.save(shard_dir / "labels.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    info = ShardInfo(name="shard-00000", index=0, rows=1, articles=0, sentences=0,
                     files={"labels.npy": FileInfo(bytes=0, sha256="")})  # fmt: skip
    with pytest.raises(DatastoreError, match="labels.npy: cannot be read"):
        _ = Shard(tmp_path, info).labels


def test_models_load_from_safetensors(tiny_model_dir: Path) -> None:
    from bertknn.core import model_files

    tree = ast.parse(inspect.getsource(model_files))  # every load of a model in the module that loads them
    calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
             and c.func.attr == "from_pretrained" and _qualified(c.func.value, {}) == "AutoModelForMaskedLM"]  # fmt: skip
    assert len(calls) == 1
    value = _keyword(calls[0], "use_safetensors")
    assert isinstance(value, ast.Constant) and value.value in (None, True)  # None: safetensors first, as documented

    names = {p.name for p in tiny_model_dir.iterdir()}
    assert "model.safetensors" in names
    assert not [n for n in names if n.endswith((".bin", ".pt", ".pth", ".pkl", ".ckpt"))], names
    from bertknn.core.encoder import MaskedLMEncoder

    encoder = MaskedLMEncoder.load(str(tiny_model_dir), device="cpu")  # the production loader takes it
    assert encoder.num_layers == 2


# ---- logs and Redis keys -------------------------------------------------------------------------------------

MARKER = "quoxelbrint"  # appears in no vocabulary, message or fixture: it can only come from a request
KEY = re.compile(r"^[A-Za-z0-9_.:-]+:(enc|ret):[0-9a-f]{64}$")


def test_cache_keys_are_digests() -> None:
    from bertknn.service.cache import cache_key

    hostile = f"{MARKER}\r\nFLUSHALL\r\n* {{}} [MASK] \x00"
    key = cache_key("bertknn", "ret", "bm25", "ds1", hostile, None, 3)
    assert KEY.match(key) and MARKER not in key and "\r" not in key
    # Parts are delimited before hashing: moving a boundary changes the key.
    assert cache_key("p", "ret", "ab", "c") != cache_key("p", "ret", "a", "bc")


def _all_log_text(records: list[logging.LogRecord]) -> str:
    return "\n".join(f"{r.getMessage()} {r.__dict__!r}" for r in records)


def _hostile_requests() -> list[tuple[str, dict]]:
    text = f"{MARKER} was born in [MASK] ."
    return [
        ("/predict", {"text": text, "subject": MARKER}),
        ("/predict", {"text": text, "subject": MARKER, "retriever": "tfidf"}),  # another cache key
        ("/predict", {"text": f"{MARKER} has no mask"}),  # 422 from the query check
        ("/predict", {"text": f"{MARKER} [MASK] " * 400}),  # 422 from the length limit
        ("/predict", {"text": text, "k": MARKER}),  # 422 from validation, the bad value being the marker
        ("/predict/batch", {"queries": [{"text": text}, {"text": MARKER}]}),
    ]


def test_logs_never_contain_request_text(tiny_datastore: Path, caplog: pytest.LogCaptureFixture) -> None:
    from fastapi.testclient import TestClient

    from bertknn.service.main import create_app
    from bertknn.service.settings import ServiceSettings

    caplog.set_level(logging.DEBUG)
    settings = ServiceSettings(datastore=tiny_datastore, model={"device": "cpu"}, log_level="debug")  # type: ignore[arg-type]
    with TestClient(create_app(settings)) as client:
        statuses = [client.post(path, json=body).status_code for path, body in _hostile_requests()]
    assert statuses == [200, 200, 422, 422, 422, 422]
    text = _all_log_text(caplog.records)
    assert "path=/predict" in text  # the request lines were captured: the check below is not vacuous
    assert MARKER not in text


def test_redis_keys_and_logs_hold_no_request_text_or_password(
    tiny_datastore: Path, redis_server, caplog: pytest.LogCaptureFixture
) -> None:
    import redis
    from fastapi.testclient import TestClient

    from bertknn.service.main import create_app
    from bertknn.service.settings import ServiceSettings

    caplog.set_level(logging.DEBUG)
    settings = ServiceSettings(  # type: ignore[arg-type]
        datastore=tiny_datastore, model={"device": "cpu"}, cache={"redis_url": redis_server.url, "key_prefix": "sec"}
    )
    with TestClient(create_app(settings)) as client:
        for path, body in _hostile_requests():
            client.post(path, json=body)
        hostile = {"text": f"{MARKER} was born in [MASK] .", "subject": f"{MARKER}\r\nFLUSHALL\r\n"}
        assert client.post("/predict", json=hostile).status_code == 200
    keys = [k.decode() for k in redis.Redis.from_url(redis_server.url).scan_iter("*")]
    assert len(keys) >= 4  # encodings and retrievals were cached: the check below is not vacuous
    assert [k for k in keys if not KEY.match(k) or not k.startswith("sec:")] == []
    assert not [k for k in keys if MARKER in k]
    text = _all_log_text(caplog.records)
    assert MARKER not in text
    assert redis_server.password and redis_server.password not in text
