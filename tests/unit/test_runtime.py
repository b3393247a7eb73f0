"""The GPU driver check: which driver torch's CUDA build needs, read from what a container sees, in one line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import bertknn.core.runtime as runtime
from bertknn.core.errors import ModelLoadError

PROPRIETARY = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\nGCC version: gcc 12\n"
OPEN = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16)\n"


@pytest.mark.parametrize(("text", "want"), [(PROPRIETARY, "535.104.05"), (OPEN, "580.65.06"), ("garbage", None)])
def test_the_driver_version_is_read_from_proc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, want: str | None) -> None:
    (tmp_path / "version").write_text(text)
    monkeypatch.setattr(runtime, "_PROC_VERSION", tmp_path / "version")
    assert runtime.driver_version() == want
    monkeypatch.setattr(runtime, "_PROC_VERSION", tmp_path / "absent")
    assert runtime.driver_version() is None


def test_a_driver_older_than_the_cuda_build_needs_is_named_with_both_versions() -> None:
    problem = runtime.driver_problem("13.0", "535.104.05")
    assert problem is not None and "535.104.05" in problem and "580.65.06" in problem and "CUDA 13.0" in problem
    assert runtime.driver_problem("13.0", "580.65.06") is None
    assert runtime.driver_problem("13.0", "590.1") is None
    assert runtime.driver_problem("12.6", "535.104.05") is None  # CUDA 12 runs on R525+ (minor-version compatibility)
    assert "525.60.13" in (runtime.driver_problem("12.6", "470.82.01") or "")  # older than R525: named
    assert "CPU-only" in (runtime.driver_problem("", "580.65.06") or "")


def test_no_driver_at_all_says_how_to_make_the_gpu_visible(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(runtime, "_PROC_VERSION", tmp_path / "absent")
    assert "no NVIDIA driver is visible" in (runtime.driver_problem("13.0") or "")


def test_device_cuda_on_an_old_driver_is_one_line_that_names_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "version").write_text(PROPRIETARY)
    monkeypatch.setattr(runtime, "_PROC_VERSION", tmp_path / "version")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # what torch says when the driver is too old
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(ModelLoadError) as err:
        runtime.resolve_device("cuda")
    message = str(err.value)
    assert "\n" not in message and "535.104.05" in message and "580.65.06" in message and "--device cpu" in message
    with caplog.at_level(logging.INFO, logger="bertknn.core.runtime"):
        assert runtime.resolve_device("auto") == torch.device("cpu")
    assert any(r.levelno == logging.WARNING and "535.104.05" in r.getMessage() for r in caplog.records)


def test_a_faiss_block_sets_torch_s_threads_back() -> None:
    """FAISS and torch may share one OpenMP runtime (whether they do depends on which loaded it first): a search's
    single thread must not outlive it, or the next forward on the same thread would run on one core."""
    import faiss

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    faiss_before = faiss.omp_get_max_threads()
    try:
        with runtime.faiss_threads(1):
            assert faiss.omp_get_max_threads() == 1
            shared = torch.get_num_threads() == 1  # the shared runtime's setting, as torch sees it
        assert torch.get_num_threads() == 2, f"torch's threads not set back (runtime shared: {shared})"
        assert faiss.omp_get_max_threads() == faiss_before
    finally:
        torch.set_num_threads(before)


def test_attention_without_cudnn_switches_off_cudnn_s_attention_kernel_alone():
    """Where a model goes on a GPU, scaled_dot_product_attention may not pick cuDNN's kernel (a graph build per
    new batch shape); the flash, memory-efficient and math kernels stay enabled."""
    cuda = torch.backends.cuda
    before = (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled())
    cuda.enable_cudnn_sdp(True)
    try:
        assert runtime.attention_without_cudnn() is True
        assert not cuda.cudnn_sdp_enabled()
        assert cuda.flash_sdp_enabled() == before[1] and cuda.mem_efficient_sdp_enabled() == before[2]
        assert cuda.math_sdp_enabled() == before[3]
    finally:
        cuda.enable_cudnn_sdp(before[0])


def test_device_wait_sleeps_on_a_blocking_event_only_on_cuda_and_only_when_asked(monkeypatch):
    from bertknn.core.runtime import DeviceWait

    made: list[bool] = []

    class Event:  # torch.cuda.Event's surface, recording what the wait asks of it
        def __init__(self, blocking: bool = False):
            made.append(blocking)
            self.calls: list[str] = []

        def record(self) -> None:
            self.calls.append("record")

        def synchronize(self) -> None:
            self.calls.append("synchronize")

    monkeypatch.setattr(torch.cuda, "Event", Event)
    DeviceWait(torch.device("cpu"), blocking=True)()
    DeviceWait(torch.device("cuda"))()  # CUDA's default wait: the copy that follows waits (spinning)
    assert made == []
    wait = DeviceWait(torch.device("cuda"), blocking=True)
    wait()
    wait()
    assert made == [True]  # one blocking event, recorded after each forward and waited on
    assert wait._event is not None and wait._event.calls == ["record", "synchronize"] * 2


def test_the_cuda_wait_setting_reaches_the_service_s_encoder(tiny_model_dir):
    from bertknn.core.encoder import MaskedLMEncoder
    from bertknn.service.model_load import prepare_forward
    from bertknn.service.settings import ServiceSettings

    enc = MaskedLMEncoder.load(str(tiny_model_dir), device="cpu", max_seq_len=32)
    for wait, blocking in (("block", True), ("spin", False)):
        settings = ServiceSettings(model={"backend": "eager", "cuda_wait": wait})
        prepare_forward(enc, settings, max_rows=8)
        assert enc.wait.blocking is blocking
