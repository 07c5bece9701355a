"""Every ``serving_configs/*.yaml`` loads with vLLM's own ``vllm serve --config`` parser and
selects this backend; each key carries a comment."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests import vllm_glue_testing as _  # noqa: F401  (sets VLLM_TARGET_DEVICE before vLLM)

pytest.importorskip("vllm")

from dsv4_attn.vllm_glue import BACKEND_NAME
from dsv4_attn.vllm_glue.kv_spec import KV_CACHE_DTYPES

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "serving_configs").glob("*.yaml"))
MODELS = {"flash": "deepseek-ai/DeepSeek-V4-Flash", "pro": "deepseek-ai/DeepSeek-V4-Pro"}
GPUS_PER_NODE = 8


@functools.cache
def serve_parser():
    """The parser ``vllm serve`` uses (vllm.entrypoints.cli.main builds it the same way)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    return parser


def test_a_config_per_model_and_machine():
    names = {p.stem for p in CONFIGS}
    expected = {f"deepseek-v4-{m}_{gpu}x8" for m in MODELS for gpu in ("h200", "h100")}
    assert names == expected


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_loads_with_vllms_parser(path):
    from vllm import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand

    args = serve_parser().parse_args(["serve", "--config", str(path)])
    ServeSubcommand().validate(args)
    engine = AsyncEngineArgs.from_cli_args(args)
    model_key, machine = path.stem.removeprefix("deepseek-v4-").split("_")
    assert engine.model == MODELS[model_key]
    assert engine.attention_backend == BACKEND_NAME
    assert engine.kv_cache_dtype in KV_CACHE_DTYPES
    assert engine.enable_expert_parallel
    gpus = engine.tensor_parallel_size * engine.pipeline_parallel_size * engine.data_parallel_size
    assert gpus == GPUS_PER_NODE * engine.nnodes, (gpus, engine.nnodes)
    assert machine.removesuffix("x8").upper() in path.read_text().splitlines()[0]
    assert engine.max_model_len <= 1048576  # DeepSeek-V4's native context


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_key_is_commented(path):
    """Each key, or each run of adjacent keys, sits right below a comment."""
    lines = path.read_text().splitlines()
    keys = {i for i, line in enumerate(lines) if line and not line.startswith(("#", " "))}
    assert keys
    for i in sorted(keys):
        above = i - 1
        while above in keys:
            above -= 1
        assert above >= 0 and lines[above].startswith("#"), f"uncommented key: {lines[i]}"
