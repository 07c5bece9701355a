"""What the backend refuses to serve, and the explicit opt-in to its torch fallback."""

from __future__ import annotations

import logging

import pytest
import torch

from tests import vllm_glue_testing as vt

pytest.importorskip("vllm")

from dsv4_attn.vllm_glue import support


def test_cpu_worker_is_refused_with_the_supported_gpus(monkeypatch):
    monkeypatch.delenv(support.ALLOW_FALLBACK_ENV, raising=False)
    with pytest.raises(RuntimeError) as err:
        support.check_serving_device(torch.device("cpu"))
    message = str(err.value)
    assert "runs on cpu, not on a CUDA GPU" in message
    assert "sm_90: H100, H200" in message and "DSV4_ATTN_ALLOW_FALLBACK=1" in message


def test_other_gpus_are_refused_by_name(monkeypatch):
    """The decision for a non-Hopper GPU (an A100 stood in by the capability query)."""
    monkeypatch.delenv(support.ALLOW_FALLBACK_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(RuntimeError, match=r"this GPU is NVIDIA A100-SXM4-80GB \(sm_80\)"):
        support.check_serving_device(torch.device("cuda", 0))


def test_a_broken_kernel_stack_is_refused_with_its_cause(monkeypatch):
    monkeypatch.delenv(support.ALLOW_FALLBACK_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(support, "kernel_stack_error", lambda: "cutlass cannot be imported (X)")
    with pytest.raises(RuntimeError, match=r"but cutlass cannot be imported \(X\)"):
        support.check_serving_device(torch.device("cuda", 0))


def test_opt_in_allows_the_fallback_and_says_so(monkeypatch, dsv4_logs):
    """With ``DSV4_ATTN_ALLOW_FALLBACK=1`` a CPU worker is let through, and says so once: one
    WARNING naming the backend, the reason and the variable (a second check logs nothing)."""
    import vllm.logger

    monkeypatch.setenv(support.ALLOW_FALLBACK_ENV, "1")
    # warning_once remembers what it logged for the life of the process, and an earlier test's
    # layer on this CPU worker logs the same line: forget it so this test sees its own.
    vllm.logger._print_warning_once.cache_clear()
    for _ in range(2):
        support.check_serving_device(torch.device("cpu"))  # no error
    logged = [
        (r.name, r.levelno, r.getMessage())
        for r in dsv4_logs.records
        if r.name.startswith("vllm.dsv4_attn")
    ]
    assert logged == [
        (
            "vllm.dsv4_attn.vllm_glue.support",
            logging.WARNING,
            "DSV4_NVFP4 runs its torch fallback for attention because this vLLM worker runs on "
            "cpu, not on a CUDA GPU (DSV4_ATTN_ALLOW_FALLBACK=1 allows this; it is for testing, "
            "and slow).",
        )
    ]


def test_model_build_refuses_without_the_opt_in(monkeypatch):
    """Through the real layer class: building a layer on this CPU worker fails at startup."""
    from dsv4_attn.vllm_glue.attention import DSV4NVFP4Attention

    vt._distributed_ready()
    # A config of its own: the half-built layer registers itself in the config's static forward
    # context, which the shared test config must not see.
    config = vt.engine_args(attention_backend="DSV4_NVFP4").create_engine_config()
    monkeypatch.delenv(support.ALLOW_FALLBACK_ENV, raising=False)
    from vllm.config import set_current_vllm_config

    with (
        set_current_vllm_config(config),
        vt._cpu_events(),
        pytest.raises(RuntimeError, match="H100"),
    ):
        DSV4NVFP4Attention(config, prefix="model.layers.99.attn")


def test_kernel_stack_imports_here():
    """CI has nvidia-cutlass-dsl, tvm-ffi and Triton: the stack itself imports (its GPU check
    is what refuses a CPU worker)."""
    assert support.kernel_stack_error() is None
