"""dtype and backend are part of the model's identity: recorded in the manifest, checked at start-up."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from bertknn.core.errors import ModelLoadError
from bertknn.core.format import read_manifest
from bertknn.core.format.contract import MANIFEST
from bertknn.core.logs import Event
from bertknn.service.main import create_app
from bertknn.service.pipeline import check_numerics
from bertknn.service.settings import ServiceSettings


def test_the_build_records_the_forward_s_numerics(tiny_datastore: Path) -> None:
    numerics = read_manifest(tiny_datastore).model.numerics
    assert numerics is not None and numerics.split("/")[0] == "float32" and numerics.split("/")[1] in ("eager", "onnx")


@pytest.mark.parametrize(
    ("built", "served"),
    [(None, "float32/onnx"), ("float32/onnx", "float32/onnx"), ("float16/eager", "float32/onnx"),
     ("bfloat16/eager", "float32/eager"), ("float32/onnx", "bfloat16/eager")],
)  # fmt: skip
def test_the_measured_dtypes_serve_each_other(built: str | None, served: str) -> None:
    check_numerics(built, served)


def test_another_dtype_is_refused_with_what_to_do() -> None:
    with pytest.raises(ModelLoadError, match=r"embedded as float8_e4m3fn/eager .* served as float32/onnx.*model.dtype"):
        check_numerics("float8_e4m3fn/eager", "float32/onnx")


def test_the_start_up_log_names_the_numerics_served_and_built(
    tiny_datastore: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Named once the backend is chosen (ONNX Runtime or eager), not before: what the service serves with."""
    ds = tmp_path / "ds"
    shutil.copytree(tiny_datastore, ds)
    manifest = json.loads((ds / MANIFEST).read_text())
    manifest["model"]["numerics"] = "float16/eager"  # as if built by a float16 forward
    (ds / MANIFEST).write_text(json.dumps(manifest))
    with caplog.at_level(logging.INFO, logger="service"), TestClient(
        create_app(ServiceSettings(datastore=ds, model={"device": "cpu"}))
    ) as client:
        served = client.app.state.resources.pipeline.encoder.numerics  # type: ignore[attr-defined]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model backend:")]
    backend = served.split("/")[1]
    assert len(lines) == 1 and lines[0].startswith(f"model backend: {backend} ({served}), "), lines
    assert lines[0].endswith("; the datastore was embedded as float16/eager, within the measured rounding "
                             "(docs/decisions/numerics.md)")  # fmt: skip
    # the ready line's fields, which a log reader parses: the identity that /readyz reports
    ready = [r.msg for r in caplog.records if isinstance(r.msg, Event) and r.msg.name == "ready"]
    assert len(ready) == 1 and ready[0].fields["model"]["num_layers"] >= 1, ready
    assert str(ready[0]).startswith(f"ready model=name:{ready[0].fields['model']['name']},"), str(ready[0])
