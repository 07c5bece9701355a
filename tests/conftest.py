"""Fixtures shared by the test modules."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from dsv4_attn.log import LOGGER_PREFIX

# Tests compile kernels in memory unless a test or the caller chooses a kernel cache directory
# (the default, ~/.cache/dsv4_attn/kernels, is the user's, not the test run's).
os.environ.setdefault("DSV4_ATTN_KERNEL_CACHE_DIR", "")
# vLLM picks its platform when first imported, whichever test module imports it first: CUDA
# where there is a GPU (the GPU tests of vLLM's CUDA paths need it, and fail rather than skip
# under another setting), else the CPU one. An explicit VLLM_TARGET_DEVICE is kept.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def dsv4_logs(caplog):
    """``caplog`` holding this package's log records at every level.

    The package logs under ``vllm.dsv4_attn`` (:mod:`dsv4_attn.log`), and vLLM's logging
    configuration stops ``vllm`` from propagating to the root logger, where caplog listens: the
    handler is attached to the package's logger itself (and propagation cut meanwhile, so a
    record is not caught twice where vLLM has not configured logging)."""
    package = logging.getLogger(LOGGER_PREFIX + "dsv4_attn")
    level, propagate = package.level, package.propagate
    package.addHandler(caplog.handler)
    package.setLevel(logging.DEBUG)
    package.propagate = False
    try:
        yield caplog
    finally:
        package.removeHandler(caplog.handler)
        package.setLevel(level)
        package.propagate = propagate
