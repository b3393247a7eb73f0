"""Service settings from the environment: nesting, the BERTKNN_MODEL shorthand, cross-field checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from bertknn.service.settings import ServiceSettings


def test_model_shorthand_nested_and_json(monkeypatch):
    monkeypatch.setenv("BERTKNN_MODEL", "/models/proxy")
    assert ServiceSettings().model.name == "/models/proxy"
    monkeypatch.setenv("BERTKNN_MODEL", '{"name": "bert-base-uncased", "device": "cpu"}')
    s = ServiceSettings()
    assert (s.model.name, s.model.device) == ("bert-base-uncased", "cpu")
    monkeypatch.delenv("BERTKNN_MODEL")
    monkeypatch.setenv("BERTKNN_MODEL__DEVICE", "cpu")
    monkeypatch.setenv("BERTKNN_CACHE__REDIS_URL", "rediss://:pw@redis:6380/0")
    s = ServiceSettings()
    assert s.model.device == "cpu" and s.model.name is None and s.cache.redis_url.get_secret_value().startswith("rediss://")
    assert "pw" not in repr(s) and "pw" not in str(s.model_dump())  # a secret never shows


def test_cross_field_and_range_checks(monkeypatch):
    monkeypatch.setenv("BERTKNN_DEFAULTS__TOP_K", "500")
    with pytest.raises(ValidationError, match="top_k"):
        ServiceSettings()
    monkeypatch.delenv("BERTKNN_DEFAULTS__TOP_K")
    monkeypatch.setenv("BERTKNN_CACHE__KEY_PREFIX", "bad prefix with spaces")
    with pytest.raises(ValidationError, match="key_prefix"):
        ServiceSettings()


def test_backend_threads_and_jvm_options(monkeypatch):
    s = ServiceSettings()
    assert s.model.backend == "auto" and s.model.threads == 0
    assert s.jvm_options.split() == ["-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"]
    monkeypatch.setenv("BERTKNN_MODEL__BACKEND", "onnx")
    monkeypatch.setenv("BERTKNN_JVM_OPTIONS", "-Xmx2g -XX:TieredStopAtLevel=1")
    s = ServiceSettings()
    assert s.model.backend == "onnx" and s.jvm_options.split() == ["-Xmx2g", "-XX:TieredStopAtLevel=1"]
    monkeypatch.setenv("BERTKNN_MODEL__BACKEND", "tensorrt")
    with pytest.raises(ValidationError, match="backend"):
        ServiceSettings()


def test_default_threads_leave_a_core(monkeypatch):
    import bertknn.core.runtime as build
    from bertknn.service.model_load import default_threads

    for quota, want in ((1, 1), (2, 1), (8, 7)):
        monkeypatch.setattr(build, "cpu_quota_threads", lambda q=quota: q)
        assert default_threads() == want


def test_jvm_options_apply_only_before_the_jvm_starts(monkeypatch):
    import jnius_config  # pyjnius is a dependency (Lucene runs through it)

    from bertknn.service.jvm import configure_jvm

    added: list[str] = []
    monkeypatch.setattr(jnius_config, "get_options", lambda: ["-Xrs"])
    monkeypatch.setattr(jnius_config, "add_options", lambda *o: added.extend(o))
    monkeypatch.setattr(jnius_config, "vm_running", False)
    assert configure_jvm(["-Xrs", "-XX:TieredStopAtLevel=1"]) and added == ["-XX:TieredStopAtLevel=1"]
    monkeypatch.setattr(jnius_config, "vm_running", True)
    assert not configure_jvm(["-Xmx1g"]) and added == ["-XX:TieredStopAtLevel=1"]


@pytest.mark.parametrize(
    "argv", [[c, "--help"] for c in ("build", "train-codec", "recode", "calibrate", "validate", "merge", "add")]
)
def test_every_builder_command_s_help_renders(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """argparse formats help texts with %: a description holding "j % n" once broke `build --help`."""
    from bertknn.builder.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0 and "usage:" in capsys.readouterr().out
