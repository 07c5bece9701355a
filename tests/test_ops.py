"""ops.sparse_attention: validation, backend choice and logging, agreement with the reference."""

from __future__ import annotations

import logging

import pytest
import torch

from dsv4_attn import dispatch_log, ops
from dsv4_attn.testing import make_decode_case
from tests.test_fallback import assert_matches_reference, reference_on_rows


def small_case(**kwargs):
    kwargs.setdefault("extra", 8)
    return make_decode_case(3, 8, kwargs.pop("fmt", "nvfp4"), 16, seed=1, distinct=False, **kwargs)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "reference"])
def test_backends_agree_with_reference(backend):
    case = small_case(lens="random", hole_rate=0.2, sink="mixed")
    out, lse = ops.sparse_attention(*case.args(), backend=backend)
    assert_matches_reference(out, lse, *reference_on_rows(case))


def test_cutedsl_backend_refuses_cpu_with_reason():
    case = small_case()
    with pytest.raises(ValueError, match="backend='cutedsl' cannot run this case"):
        ops.sparse_attention(*case.args(), backend="cutedsl")


def test_auto_logs_each_fallback_reason_once(caplog, monkeypatch):
    monkeypatch.setattr(dispatch_log, "logged_reasons", set())
    case = small_case()
    with caplog.at_level(logging.INFO, logger="dsv4_attn.ops"):
        for _ in range(3):
            ops.sparse_attention(*case.args())
    messages = [r.getMessage() for r in caplog.records if "SDPA fallback" in r.getMessage()]
    assert len(messages) == 1, messages


def _replace(case, **fields):
    args = dict(
        zip(
            [
                "q",
                "cache",
                "fmt",
                "block_size",
                "indices",
                "lens",
                "sink",
                "scale",
                "extra_cache",
                "extra_block_size",
                "extra_indices",
                "extra_lens",
            ],
            case.args(),
            strict=True,
        )
    )
    args.update(fields)
    return args


BAD = [
    ({"q": torch.zeros(3, 8, 256, dtype=torch.bfloat16)}, "q must be \\[T, H, 512\\]"),
    ({"q": torch.zeros(3, 8, 512, dtype=torch.int32)}, "q must be bfloat16"),
    ({"block_size": 0}, "block_size must be a positive int, got 0"),
    ({"block_size": 128}, "page of"),  # the cache holds 64-token pages
    ({"indices": torch.zeros(3, 16)}, "indices must be an int32/int64 tensor, got torch.float32"),
    ({"indices": torch.zeros(2, 16, dtype=torch.int32)}, "indices must be \\[T=3, K\\]"),
    ({"lens": torch.full((3,), 17, dtype=torch.int32)}, "lens must lie in \\[0, K=16\\]"),
    ({"indices": torch.full((3, 16), 10**6, dtype=torch.int32)}, "hold slot 1000000"),
    ({"extra_indices": torch.full((3, 8), -5, dtype=torch.int32)}, "extra_indices hold slot -5"),
    ({"extra_lens": None}, "must be given together"),
    ({"sink": torch.zeros(7)}, "sink must be \\[H=8\\]"),
    ({"scale": -1.0}, "scale must be a positive finite float, got -1.0"),
    ({"fmt": "int4"}, "unknown KV-cache format 'int4'"),
]


@pytest.mark.parametrize(("fields", "message"), BAD)
def test_bad_input_raises_value_error(fields, message):
    with pytest.raises(ValueError, match=message):
        ops.sparse_attention(**_replace(small_case(), **fields))


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.sparse_attention(*small_case().args(), backend="flash")


def test_check_values_false_skips_value_checks_only():
    case = small_case()
    with pytest.raises(ValueError, match="indices must be \\[T=3, K\\]"):
        ops.sparse_attention(**_replace(case, indices=case.indices[:2]), check_values=False)
    out, _ = ops.sparse_attention(*case.args(), check_values=False)
    assert out.shape == (3, 8, 512)


def test_last_dispatch_reports_what_ran():
    case = small_case()
    ops.sparse_attention(*case.args(), backend="reference")
    assert ops.last_dispatch() == ops.Dispatch("reference", None)
    ops.sparse_attention(*case.args(), backend="sdpa")
    assert ops.last_dispatch() == ops.Dispatch("sdpa", None)
    ops.sparse_attention(*case.args())  # auto on CPU: the fallback, with its reason
    backend, reason = ops.last_dispatch()
    assert backend == "sdpa" and "cuda" in reason.lower()
