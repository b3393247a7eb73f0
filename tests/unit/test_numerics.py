"""dtype and backend are part of the model's identity: recorded in the manifest, checked at start-up."""

from __future__ import annotations

from pathlib import Path

import pytest

from bertknn.core.errors import ModelLoadError
from bertknn.core.format import read_manifest
from bertknn.service.pipeline import check_numerics


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
