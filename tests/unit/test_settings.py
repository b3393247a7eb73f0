"""Service settings from the environment: nesting, the BERTKNN_MODEL shorthand, cross-field checks."""

from __future__ import annotations

from pathlib import Path

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


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"DEFAULTS__TOP_K": "500"}, "defaults.top_k 500 exceeds limits.max_top_k 100: lower the default, or raise"),
        ({"DEFAULTS__TOP_K": "40", "LIMITS__MAX_TOP_K": "30"}, "defaults.top_k 40 exceeds limits.max_top_k 30"),
        ({"DEFAULTS__K": "5000"}, "defaults.k 5000 exceeds limits.max_k 2048: lower the default, or raise the limit"),
        ({"DEFAULTS__TEMPERATURE": "0"}, "temperature must be > 0, or auto"),
        ({"MODEL__VOTE_DEVICE": "model"}, "model.vote_device model votes the questions searched on the device: set "
                                          "model.knn_device to model as well, or vote_device to host"),
        ({"LAYOUT": "split", "MODEL__KNN_DEVICE": "model"}, "layout split runs the model in a process of its own"),
        ({"LAYOUT": "split", "BATCHING__ON_EVENT_LOOP": "true"}, "batching.on_event_loop need the model in the "
                                                                 "serving process (layout full)"),
    ],
)  # fmt: skip
def test_settings_that_do_not_go_together_are_refused_saying_which(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], says: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(f"BERTKNN_{name}", value)
    with pytest.raises(ValidationError) as exc:
        ServiceSettings()
    assert says in str(exc.value), exc.value


def test_cross_field_and_range_checks(monkeypatch):
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


# ---- what a setting's name says when it is wrong ---------------------------------------------------------------


def test_a_variable_that_sets_nothing_is_named_with_the_setting_it_likely_meant(monkeypatch) -> None:
    from bertknn.core.settings_cli import env_variables, unknown_variables
    from bertknn.service.__main__ import NOT_THE_SERVICES

    environ = {
        "BERTKNN_BATCHING__MAXBATCH": "64", "BERTKNN_DATASTOR": "/data", "BERTKNN_FOO": "1",  # set nothing
        "BERTKNN_PORT": "8001", "bertknn_log_level": "debug", "BERTKNN_MODEL": "/models/x",  # settings
        "BERTKNN_MODEL__DEVICE": "cpu", "BERTKNN_CACHE": '{"ttl_s": 5}', "BERTKNN_DEFAULTS__LAMBDA": "0.5",
        "BERTKNN_BUILD__BATCH_SIZE": "8", "BERTKNN_BUILD_WORKERS": "2", "BERTKNN_RUN_DIR": "/tmp/r",  # not the service's
        "PATH": "/usr/bin", "BERTKNN": "x",
    }  # fmt: skip
    found = unknown_variables(env_variables(ServiceSettings), "BERTKNN_", others=NOT_THE_SERVICES, environ=environ)
    assert found == [
        "the environment variable BERTKNN_BATCHING__MAXBATCH is not a setting and is ignored; did you mean "
        "BERTKNN_BATCHING__MAX_BATCH_SIZE? (docs/configuration.md)",
        "the environment variable BERTKNN_DATASTOR is not a setting and is ignored; did you mean BERTKNN_DATASTORE? "
        "(docs/configuration.md)",
        "the environment variable BERTKNN_FOO is not a setting and is ignored (docs/configuration.md)",
    ]
    # and what it says is true: the settings are read, the misspelt ones keep the defaults
    for name, value in environ.items():
        if name != "PATH":
            monkeypatch.setenv(name, value)
    s = ServiceSettings()
    assert (s.port, s.log_level, s.model.name, s.cache.ttl_s, s.defaults.lambda_) == (8001, "debug", "/models/x", 5, 0.5)
    assert s.batching.max_batch_size == 32 and s.datastore == Path("datastore")


def test_serve_warns_of_a_misspelt_variable_before_its_first_run_checks(
    tmp_path, monkeypatch, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """The typo that explains the error right after it (no datastore at the default path) is said first."""
    from bertknn.service.__main__ import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BERTKNN_DATASTOR", str(tmp_path))
    with caplog.at_level("WARNING"):
        assert main([]) == 2
    assert [r.getMessage() for r in caplog.records if "BERTKNN_DATASTOR " in r.getMessage()] == [
        "the environment variable BERTKNN_DATASTOR is not a setting and is ignored; did you mean BERTKNN_DATASTORE? "
        "(docs/configuration.md)"
    ]
    assert "datastore: no datastore here" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "env", "named"), [
    (None, "abc", "BERTKNN_BATCHING__MAX_BATCH_SIZE"),  # the environment gave it: its variable
    ("0", "64", "--batching-max-batch-size"),  # the command line gave it (and wins): its flag
])  # fmt: skip
def test_a_bad_value_is_named_where_it_was_given(
    monkeypatch, capsys: pytest.CaptureFixture[str], flag: str | None, env: str, named: str
) -> None:
    from bertknn.service.__main__ import main

    monkeypatch.setenv("BERTKNN_BATCHING__MAX_BATCH_SIZE", env)
    assert main(["--datastore", "nowhere", *(["--batching-max-batch-size", flag] if flag else [])]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {named}: Input should be"), line


@pytest.mark.parametrize(("url", "shown"), [("http://user:secret@redis:6379/0", "scheme 'http'"),
                                            ("redis-host:6379", "no scheme")])  # fmt: skip
def test_a_redis_url_that_is_no_redis_url_is_refused_without_showing_it(
    monkeypatch, capsys: pytest.CaptureFixture[str], url: str, shown: str
) -> None:
    """One line before anything starts (not the Redis client's traceback at start-up), without the URL, which may
    hold the password."""
    from bertknn.service.__main__ import main

    monkeypatch.setenv("BERTKNN_CACHE__REDIS_URL", url)
    assert main(["--datastore", "nowhere"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: BERTKNN_CACHE__REDIS_URL: a Redis URL starts with redis://, rediss://, unix:// (this one has {shown})"
    ]
    with pytest.raises(ValidationError) as exc:  # nor does the error's text, as a traceback would print it
        ServiceSettings()
    assert "secret" not in str(exc.value) and "redis-host" not in str(exc.value)
    for good in ("redis://:pw@redis:6379/0", "rediss://redis:6380", "unix:///run/redis.sock"):
        monkeypatch.setenv("BERTKNN_CACHE__REDIS_URL", good)
        assert ServiceSettings().cache.redis_url is not None


def test_the_builder_names_its_own_misspelt_and_bad_variables(
    tmp_path, monkeypatch, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    from bertknn.builder.__main__ import main

    monkeypatch.setenv("BERTKNN_BUILD__BATCHSIZE", "8")
    monkeypatch.setenv("BERTKNN_BUILD__WORKERS", "many")
    with caplog.at_level("WARNING"):
        assert main(["build", "--corpus", str(tmp_path / "c.jsonl"), "--out", str(tmp_path / "ds")]) == 2
    assert [r.getMessage() for r in caplog.records if "BATCHSIZE" in r.getMessage()] == [
        "the environment variable BERTKNN_BUILD__BATCHSIZE is not a setting and is ignored; did you mean "
        "BERTKNN_BUILD__BATCH_SIZE? (docs/configuration.md)"
    ]
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: BERTKNN_BUILD__WORKERS: Input should be a valid integer"), line
