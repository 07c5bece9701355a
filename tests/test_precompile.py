"""The precompile command covers what a server compiles, with vLLM's DeepSeek-V4 page sizes, and
the kernel cache directory it fills is the one a server reads."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest

from dsv4_attn.kernels import compile_cache, precompile
from dsv4_attn.kernels.compile_cache import CACHE_DIR_ENV, CompileCache
from tests import vllm_glue_testing as vt


def test_cache_directory_default_override_and_off(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.cache_directory() == tmp_path / "xdg" / "dsv4_attn" / "kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    expected = tmp_path / "home" / ".cache" / "dsv4_attn" / "kernels"
    assert compile_cache.cache_directory() == expected
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "mine"))
    assert compile_cache.cache_directory() == tmp_path / "mine"
    for off in ("", "0", " "):
        monkeypatch.setenv(CACHE_DIR_ENV, off)
        assert compile_cache.cache_directory() is None


def test_page_sizes_are_vllms_deepseek_v4_ones():
    """The sizes precompile assumes are those vLLM 0.33 serves DeepSeek-V4 with."""
    pytest.importorskip("vllm")
    from vllm.models.deepseek_v4.sparse_mla import DeepseekV4SparseMLABackend
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    from dsv4_attn.vllm_glue.backend import DSV4NVFP4Backend

    swa_default = inspect.signature(DeepseekV4SWACache.__init__).parameters["block_size"].default
    assert swa_default == precompile.SWA_BLOCK_TOKENS
    for backend in (DeepseekV4SparseMLABackend, DSV4NVFP4Backend):
        assert backend.get_supported_kernel_block_sizes() == [precompile.CACHE_BLOCK_TOKENS]


def test_model_compress_ratios_from_both_config_forms(tmp_path):
    assert precompile.model_compress_ratios(vt.tiny_checkpoint()) == (1, 4, 128)
    legacy = tmp_path / "config.json"
    legacy.write_text(json.dumps({"compress_ratios": [4, 128, 0, 4]}))
    assert precompile.model_compress_ratios(legacy) == (1, 4, 128)
    legacy.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="not a DeepSeek-V4 config"):
        precompile.model_compress_ratios(tmp_path)


class _KeyRecorder:
    """Stands in for the compile caches' lookups: records every key, builds nothing."""

    def __init__(self, monkeypatch):
        self.keys: set[tuple[str, object]] = set()

        def get(cache: CompileCache, key, build):
            self.keys.add((cache.name, key))
            return None

        monkeypatch.setattr(CompileCache, "get", get)


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8"])
def test_precompile_covers_every_kernel_a_server_layer_compiles(kv_dtype, monkeypatch, tmp_path):
    """Each layer of the tiny model (built as vLLM's CUDA worker builds it: window-only, CSA and
    HCA; the HCA layer both with and without the balanced schedule) compiles only keys that
    ``python -m dsv4_attn.kernels.precompile --kv-cache-dtype <its dtype>`` compiled."""
    pytest.importorskip("vllm")
    recorder = _KeyRecorder(monkeypatch)
    precompile.main(["--kv-cache-dtype", kv_dtype, "--cache-dir", str(tmp_path / "kc")])
    precompiled = set(recorder.keys)
    assert {name for name, _ in precompiled} == {"sparse_decode_sm90", "split_combine", "fmha"}
    model = vt.tiny_model(kv_dtype)
    for layer in model.layers.values():
        for balanced in (False, True) if layer.compress_ratio == 128 else (False,):
            recorder.keys.clear()
            monkeypatch.setattr(layer, "_may_run_balanced", lambda b=balanced: b)
            layer._compile_kernels()
            assert recorder.keys and recorder.keys <= precompiled, (layer.compress_ratio, balanced)


def test_precompile_refuses_an_unusable_cache_directory(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    recorder = _KeyRecorder(monkeypatch)
    with pytest.raises(SystemExit, match="no usable kernel cache directory"):
        precompile.main(["--cache-dir", str(shared)])
    monkeypatch.setenv(CACHE_DIR_ENV, "")
    with pytest.raises(SystemExit, match=r"no usable kernel cache directory \(None\)"):
        precompile.main([])
    assert not recorder.keys and not any(Path(shared).iterdir())
