"""The vLLM plugin: discovery through the entry point, registration, the CLI, engine configs,
and spawn safety, against the real vllm 0.33.0 install."""

from __future__ import annotations

import contextlib
import importlib.metadata
import multiprocessing
import os
import queue
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import vllm_glue_testing as vt

pytest.importorskip("vllm")

from vllm.v1.attention.backends.registry import (
    AttentionBackendEnum,
    register_backend,
)

from dsv4_attn import plugin
from dsv4_attn.vllm_glue import BACKEND_CLASS_PATH, BACKEND_NAME, compat

ROOT = Path(__file__).resolve().parents[1]


def fresh_python(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu"}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_entry_point_is_discoverable():
    """Needs the package installed (``pip install --no-deps -e .``), as vLLM finds plugins."""
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    (ep,) = [e for e in eps if e.name == "dsv4_nvfp4"]
    assert ep.value == "dsv4_attn.plugin:register"
    assert ep.load() is plugin.register


def test_register_is_idempotent():
    plugin.register()
    plugin.register()
    names = [n for n in AttentionBackendEnum.__members__ if n == BACKEND_NAME]
    assert names == [BACKEND_NAME]
    member = AttentionBackendEnum[BACKEND_NAME]
    assert member.get_path() == BACKEND_CLASS_PATH
    assert member.get_class().get_name() == BACKEND_NAME


def test_register_is_light_and_hooks_on_first_import():
    """In a fresh interpreter: register() imports no vLLM model code and initialises no CUDA;
    the DeepSeek-V4 model modules are hooked when they are first imported."""
    code = (
        "import sys, torch\n"
        "from dsv4_attn import plugin\n"
        "plugin.register(); plugin.register()\n"
        "heavy = [m for m in sys.modules if m.startswith(('vllm.models', 'dsv4_attn.vllm_glue.'))\n"
        "         and m not in ('dsv4_attn.vllm_glue.compat', 'dsv4_attn.vllm_glue.model_hook')]\n"
        "print('HEAVY', heavy)\n"
        "print('CUDA', torch.cuda.is_initialized())\n"
        "import vllm.models.deepseek_v4.nvidia.model as m4\n"
        "import vllm.models.deepseek_v41.nvidia.model as m41\n"
        "from dsv4_attn.vllm_glue import model_hook\n"
        "from dsv4_attn.vllm_glue.compat import HOOK_TARGETS as T\n"
        "print('PATCHED', model_hook.is_patched(m4, T[0]), model_hook.is_patched(m41, T[1]))\n"
        "layer = m4.DeepseekV4DecoderLayer.__init__.__globals__['_select_dsv4_attn_cls']\n"
        "print('DECODER', layer is m4._select_dsv4_attn_cls)\n"
    )
    result = fresh_python(code)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "HEAVY []" in result.stdout
    assert "CUDA False" in result.stdout
    assert "PATCHED True True" in result.stdout
    assert "DECODER True" in result.stdout


def test_an_incompatible_vllm_leaves_the_backend_unregistered_with_a_warning(
    monkeypatch, dsv4_logs
):
    changed = compat.HookTarget(
        "vllm.models.deepseek_v4.nvidia.model", "_select_dsv4_attn_cls", ("cfg",), True
    )
    monkeypatch.setattr(compat, "HOOK_TARGETS", (changed,))
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "_unregistered_reason", None)
    plugin.register()  # no exception
    plugin.register()  # and one warning per process
    reason = plugin.unregistered_reason()
    assert reason is not None and "supports vLLM 0.33.0 only" in reason
    assert "takes (vllm_config), expected (cfg)" in reason
    warnings = [r.getMessage() for r in dsv4_logs.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and f"{BACKEND_NAME} left unregistered" in warnings[0]
    assert f"found vLLM {compat.installed_vllm_version()}" in warnings[0]


def _without_our_member(monkeypatch: pytest.MonkeyPatch) -> None:
    """Take ``DSV4_NVFP4`` out of ``AttentionBackendEnum`` for this test (an earlier test may
    have registered it), as in a process that has not registered it yet; monkeypatch puts it
    back afterwards, class attribute before the member map (the enum refuses to set an attribute
    named like one of its members)."""
    enum = AttentionBackendEnum
    monkeypatch.delitem(enum._member_map_, BACKEND_NAME, raising=False)
    monkeypatch.delitem(enum._value2member_map_, BACKEND_CLASS_PATH, raising=False)
    monkeypatch.setattr(
        enum, "_member_names_", [n for n in enum._member_names_ if n != BACKEND_NAME]
    )
    monkeypatch.delattr(enum, BACKEND_NAME, raising=False)


@pytest.mark.parametrize("failing", ["register_backend", "AttentionBackendEnum.register"])
def test_an_error_while_registering_is_a_warning_not_an_exception(monkeypatch, dsv4_logs, failing):
    """vLLM calls plugins unguarded: a RuntimeError from vLLM's registry (its register_backend,
    or the enum method that adds the member) must leave register() returning normally, with one
    WARNING naming the error, the reason kept, no DSV4_NVFP4 member, and a second call that tries
    nothing and warns nothing."""
    from vllm.v1.attention.backends import registry

    _without_our_member(monkeypatch)
    monkeypatch.setattr(plugin, "_registered", False)
    monkeypatch.setattr(plugin, "_unregistered_reason", None)
    monkeypatch.setattr(compat, "incompatibility", lambda: None)  # a vLLM that fits
    attempts = []

    def fail(*args: object, **kwargs: object) -> None:
        attempts.append(args)
        raise RuntimeError("registry moved")

    if failing == "register_backend":
        monkeypatch.setattr(registry, "register_backend", fail)
    else:
        monkeypatch.setattr(AttentionBackendEnum, "register", fail)

    assert plugin.register() is None
    assert plugin.register() is None
    assert len(attempts) == 1  # the second call is a no-op
    reason = plugin.unregistered_reason()
    assert reason is not None and "RuntimeError: registry moved" in reason
    warnings = [r.getMessage() for r in dsv4_logs.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert f"{BACKEND_NAME} left unregistered" in warnings[0]
    assert "RuntimeError: registry moved" in warnings[0]
    assert BACKEND_NAME not in AttentionBackendEnum.__members__


def test_vllm_plugin_loading_survives_a_removed_hook_target(tmp_path):
    """vLLM's own plugin loading, in a fresh interpreter whose DeepSeek-V4 model source lacks
    the hooked selector: plugins load, a WARNING names both vLLM versions, vLLM's own backends
    still configure the model, and only DSV4_NVFP4 is refused."""
    code = (
        "import re, pathlib\n"
        "from dsv4_attn.vllm_glue import compat\n"
        "name = 'vllm.models.deepseek_v4.nvidia.model'\n"
        "real = compat._source_path(name)\n"
        "source = real.read_text()\n"
        "removed = re.sub(r'\\ndef _select_dsv4_attn_cls\\(', '\\ndef _renamed(', source)\n"
        "assert removed != source\n"
        f"copy = pathlib.Path({str(tmp_path)!r}) / 'model.py'\n"
        "copy.write_text(removed)\n"
        "original = compat._source_path\n"
        "compat._source_path = lambda m: copy if m == name else original(m)\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E\n"
        f"print('REGISTERED', {BACKEND_NAME!r} in E.__members__)\n"
        "from tests import vllm_glue_testing as vt\n"
        "config = vt.engine_args().create_engine_config()\n"
        "print('DEFAULT', config.attention_config.backend)\n"
        "try:\n"
        f"    vt.engine_args(attention_backend={BACKEND_NAME!r}).create_engine_config()\n"
        "except Exception as exc:\n"
        "    print('REFUSED', str(exc).splitlines()[0][:200])\n"
    )
    result = fresh_python(code)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "REGISTERED False" in result.stdout
    assert "DEFAULT None" in result.stdout
    assert f"Unknown attention backend: '{BACKEND_NAME}'" in output
    # vLLM configures its logging after plugins load here: the warning comes through Python's
    # last-resort handler (WARNING and above, to stderr), once.
    (warning,) = [line for line in result.stderr.splitlines() if "left unregistered" in line]
    assert "supports vLLM 0.33.0 only" in warning
    assert f"found vLLM {compat.installed_vllm_version()}" in warning
    assert "has no module-level function _select_dsv4_attn_cls" in warning


def test_vllm_serve_help_runs_with_the_plugin():
    """``vllm serve --help`` through the ``vllm`` console script's own entry function; at exit the
    process reports whether the plugin registered the backend while the parser was built."""
    (script,) = importlib.metadata.entry_points(group="console_scripts", name="vllm")
    module, function = script.value.split(":")
    code = (
        "import atexit, sys\n"
        "def report():\n"
        "    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E\n"
        f"    print('REGISTERED', {BACKEND_NAME!r} in E.__members__)\n"
        "atexit.register(report)\n"
        "sys.argv = ['vllm', 'serve', '--help']\n"
        f"from {module} import {function}\n"
        f"{function}()\n"
    )
    result = fresh_python(code)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "usage: vllm serve [model_tag] [options]" in output
    assert "AttentionConfig" in output
    assert "REGISTERED True" in output
    assert "Failed to load plugin" not in output


@pytest.mark.parametrize("spelling", ["DSV4_NVFP4", "dsv4_nvfp4"])
def test_cli_engine_config_resolves_to_our_backend(spelling):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from dsv4_attn.vllm_glue.backend import DSV4NVFP4Backend

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        [
            "--model",
            vt.tiny_checkpoint(),
            "--attention-backend",
            spelling,
            "--load-format",
            "dummy",
            "--skip-tokenizer-init",
            "--enforce-eager",
            "--max-model-len",
            "2048",
        ]
    )
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.attention_config.backend is AttentionBackendEnum[BACKEND_NAME]
    assert config.attention_config.backend.get_class() is DSV4NVFP4Backend


def test_unknown_backend_name_still_fails_in_vllm():
    with pytest.raises(Exception, match="Unknown attention backend: 'DSV4_NVFP5'"):
        vt.engine_args(attention_backend="DSV4_NVFP5").create_engine_config()


def _spawn_round_trip(config, timeout: float = 300):
    """Start ``vt.spawn_child`` with the spawn method; return (exit code, its report or None)."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=vt.spawn_child, args=(config, results))
    child.start()
    report, deadline = None, time.monotonic() + timeout
    while report is None and time.monotonic() < deadline:
        try:
            report = results.get(timeout=1)
        except queue.Empty:
            if not child.is_alive():  # died without reporting; drain a late message once
                with contextlib.suppress(queue.Empty):
                    report = results.get(timeout=1)
                break
    child.join(timeout=60)
    return child.exitcode, report


def test_config_survives_a_spawned_interpreter():
    """A worker started with ``spawn`` unpickles its VllmConfig before plugins load; the dynamic
    DSV4_NVFP4 member must come back as itself, and the config must come back to us."""
    config = vt.engine_config()
    exitcode, report = _spawn_round_trip(config)
    assert exitcode == 0 and report is not None
    assert report["backend"] == BACKEND_NAME
    assert report["class_path"] == BACKEND_CLASS_PATH
    assert report["plugins_loaded"] is False  # registered by unpickling, not by plugin loading
    assert report["plugin_module"] is True
    assert report["config"].attention_config.backend is AttentionBackendEnum[BACKEND_NAME]


def test_spawn_round_trip_detects_a_by_value_member(capfd):
    """Control: a dynamic member without the by-name reduction breaks the spawned child, so the
    test above would notice if ours did."""
    import copy

    name = "DSV4_SPAWN_CONTROL"
    if name not in AttentionBackendEnum.__members__:
        register_backend(name, "dsv4_attn.vllm_glue.backend.DSV4NVFP4SWABackend")
    config = copy.copy(vt.engine_config())
    config.attention_config = copy.copy(config.attention_config)
    object.__setattr__(config.attention_config, "backend", AttentionBackendEnum[name])
    exitcode, report = _spawn_round_trip(config)
    assert exitcode != 0 and report is None
    assert "is not a valid AttentionBackendEnum" in capfd.readouterr().err
