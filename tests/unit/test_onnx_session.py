"""The forward's ONNX Runtime session options: its intra-op threads stop using the CPU once a run has returned."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from bertknn.core.onnx_forward import session_options


@pytest.fixture
def two_threads() -> Iterator[None]:
    """The process's torch threads (which the session takes) at two, so that the session has a pool to idle."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _matmul_session(opts: ort.SessionOptions) -> ort.InferenceSession:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, 256])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [256, 256])
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "x"], ["y"])], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _idle_cpu_ms(session: ort.InferenceSession) -> float:
    """The process's CPU ms in 50 ms of sleep right after a run, the least of five tries."""
    a = np.random.default_rng(0).random((256, 256), dtype=np.float32)
    session.run(None, {"x": a})
    burnt = []
    for _ in range(5):
        session.run(None, {"x": a})
        t = time.process_time()
        time.sleep(0.05)
        burnt.append((time.process_time() - t) * 1000)
    return min(burnt)


def test_the_sessions_threads_sleep_once_a_run_returns(two_threads: None) -> None:
    opts = session_options()
    assert opts.intra_op_num_threads == 2
    assert opts.get_session_config_entry("session.force_spinning_stop") == "1"
    # ONNX Runtime's own default spins the pool's threads after each run: a core kept busy between batches
    assert _idle_cpu_ms(_matmul_session(session_options())) < 5.0
