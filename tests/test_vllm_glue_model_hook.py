"""The selector hook: DSV4_NVFP4 reaches DeepSeek-V4's layers, every other choice behaves as
upstream, and a vLLM whose hook targets changed is refused naming the supported version."""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import textwrap
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm.v1.attention.backends.registry import AttentionBackendEnum

from dsv4_attn import plugin
from dsv4_attn.vllm_glue import BACKEND_NAME, compat, model_hook
from tests.test_vllm_glue_moe_warmup import h200, stand_in_worker  # noqa: F401 (h200: fixture)

UPSTREAM_CHOICES = [
    None,
    "FLASHMLA_SPARSE_DSV4",
    "FLASHMLA_SPARSE",
    "FLASHINFER_MLA_SPARSE_DSV4",
    "FLASHINFER_MLA_SPARSE",
    "FLASHINFER_MLA_SPARSE_SM120",
    "FLASHMLA_SPARSE_DSV41",
    "FLASHINFER_MLA_SPARSE_DSV41",
    "FLASHMLA_MEGA_ATTN_DSV41",
    "TRITON_ATTN",
]


def fake_config(backend: str | None):
    member = None if backend is None else AttentionBackendEnum[backend]
    return SimpleNamespace(
        attention_config=SimpleNamespace(backend=member),
        parallel_config=SimpleNamespace(prefill_context_parallel_size=1),
    )


def outcome(select, config):
    """What a selector does with ``config``: the class it returns, or the error it raises."""
    try:
        return select(config)
    except Exception as exc:
        return type(exc), str(exc)


@pytest.fixture(scope="module")
def dsv4_model():
    plugin.register()
    return importlib.import_module("vllm.models.deepseek_v4.nvidia.model")


@pytest.fixture(scope="module")
def dsv41_model():
    plugin.register()
    return importlib.import_module("vllm.models.deepseek_v41.nvidia.model")


def test_dsv4_selector_returns_our_class_only_for_our_backend(dsv4_model):
    from dsv4_attn.vllm_glue.attention import DSV4NVFP4Attention

    select = dsv4_model._select_dsv4_attn_cls
    assert model_hook.is_patched(dsv4_model, compat.HOOK_TARGETS[0])
    assert select(fake_config(BACKEND_NAME)) is DSV4NVFP4Attention
    original = select.__wrapped__
    for choice in UPSTREAM_CHOICES:
        got = outcome(select, fake_config(choice))
        assert got == outcome(original, fake_config(choice)), choice
        assert got is not DSV4NVFP4Attention
    # The decoder layer looks the selector up in its module globals at construction time.
    decoder_globals = dsv4_model.DeepseekV4DecoderLayer.__init__.__globals__
    assert decoder_globals["_select_dsv4_attn_cls"] is select


def test_dsv41_selector_returns_our_class_for_fp8_and_keeps_the_rest(dsv41_model):
    from dsv4_attn.vllm_glue.attention_v41 import DSV41NVFP4Attention

    select = dsv41_model._select_dsv4_attn_cls
    assert model_hook.is_patched(dsv41_model, compat.HOOK_TARGETS[1])
    for cache_dtype in ("fp8", "fp8_ds_mla"):
        config = fake_config(BACKEND_NAME)
        config.cache_config = SimpleNamespace(cache_dtype=cache_dtype)
        assert select(config) is DSV41NVFP4Attention
    config.cache_config = SimpleNamespace(cache_dtype="auto")  # NVFP4: not for V4.1 yet
    with pytest.raises(ValueError, match=r"DeepSeek-V4\.1 with fp8 KV caches only.*'auto'"):
        select(config)
    original = select.__wrapped__
    for choice in UPSTREAM_CHOICES:
        got = outcome(select, fake_config(choice))
        assert got == outcome(original, fake_config(choice)), choice
        assert got is not DSV41NVFP4Attention


def _runner(*backends: type) -> SimpleNamespace:
    """A stand-in model runner whose attention groups (one list per KV-cache group) use
    ``backends``, with what vLLM's DeepSeek-V4 warmup reads before its mixed step."""
    groups = [[SimpleNamespace(backend=b)] for b in backends]
    runner = SimpleNamespace(attn_groups=groups, is_pooling_model=False, dummy_runs=[])
    runner.vllm_config = SimpleNamespace(use_v2_model_runner=False)
    runner._dummy_run = lambda **kwargs: runner.dummy_runs.append(kwargs)
    return runner


def test_vllms_deepseek_v4_warmup_runs_for_our_backends(monkeypatch):
    """vLLM's DeepSeek-V4 kernel warmup (a mixed prefill + decode dummy step before serving,
    so no kernel compiles during a user's first request) runs its step for a runner whose
    groups use DSV4_NVFP4 or its SWA twin, as for vLLM's own DeepSeek-V4 backends, and still
    skips other backends. (The fused-MoE steps the hook adds after it are off here and tested
    below.)"""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as Backends

    from dsv4_attn.vllm_glue.backend import DSV4NVFP4Backend, DSV4NVFP4SWABackend

    monkeypatch.setenv("DSV4_ATTN_MOE_WARMUP", "0")
    plugin.register()
    warmup = importlib.import_module("vllm.model_executor.warmup.flashinfer_sparse_mla_warmup")
    assert model_hook.is_patched(warmup, compat.HOOK_TARGETS[3])
    has_backend = warmup._has_deepseek_v4_sparse_mla_backend
    original = has_backend.__wrapped__
    vllms = Backends["FLASHMLA_SPARSE_DSV4"].get_class()
    other = Backends["TRITON_ATTN"].get_class()
    ours = (DSV4NVFP4Backend, DSV4NVFP4SWABackend)
    for backends, runs in [(ours, True), (ours[1:], True), ((vllms,), True), ((other,), False)]:
        runner = _runner(*backends)
        assert has_backend(runner) is runs, backends
        assert original(runner) is (backends == (vllms,)), backends  # upstream skips ours
        worker = SimpleNamespace(
            model_runner=runner,
            scheduler_config=SimpleNamespace(max_num_batched_tokens=8192),
            vllm_config=SimpleNamespace(
                kernel_config=SimpleNamespace(enable_flashinfer_autotune=False)
            ),
        )
        warmup.deepseek_v4_sparse_mla_attention_warmup(worker)  # vLLM's own function, hooked
        mixed = [run for run in runner.dummy_runs if run.get("create_mixed_batch")]
        assert len(mixed) == (1 if runs else 0), (backends, runner.dummy_runs)
    assert not model_hook.runs_dsv4_nvfp4(SimpleNamespace())  # a runner without groups


def _worker(runner: SimpleNamespace, max_batched: int = 8192) -> SimpleNamespace:
    """A stand-in worker around ``runner`` with what vLLM's DeepSeek-V4 warmup reads."""
    return SimpleNamespace(
        model_runner=runner,
        scheduler_config=SimpleNamespace(max_num_batched_tokens=max_batched),
        vllm_config=SimpleNamespace(
            kernel_config=SimpleNamespace(enable_flashinfer_autotune=False)
        ),
    )


def _warmup_module():
    plugin.register()
    return importlib.import_module("vllm.model_executor.warmup.flashinfer_sparse_mla_warmup")


def test_kernel_warmup_calls_the_hooked_deepseek_v4_warmup():
    """vLLM's kernel warmup imports the DeepSeek-V4 warmup by name: the name it calls is the
    hook, as is the warmup module's own."""
    warmup = _warmup_module()
    kernel_warmup = importlib.import_module("vllm.model_executor.warmup.kernel_warmup")
    target = compat.HOOK_TARGETS[4]
    assert target.function == "deepseek_v4_sparse_mla_attention_warmup"
    assert model_hook.is_patched(warmup, target) and model_hook.is_patched(kernel_warmup, target)
    assert kernel_warmup.deepseek_v4_sparse_mla_attention_warmup is (
        warmup.deepseek_v4_sparse_mla_attention_warmup
    )
    assert model_hook.is_patched(warmup, compat.HOOK_TARGETS[3])  # the module's other hook


def test_deepseek_v4_warmup_hook_adds_the_moe_warmup_for_our_backends_only(monkeypatch):
    """After vLLM's warmup step, the hook runs the fused-MoE warmup for a runner using
    DSV4_NVFP4 (or its SWA twin), or a V4.1 runner whose config selects it, and not for vLLM's
    backends. Stand-in runners record the
    calls; the real steps run on the GPU server."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as Backends

    from dsv4_attn.vllm_glue import moe_warmup
    from dsv4_attn.vllm_glue.backend import DSV4NVFP4Backend, DSV4NVFP4SWABackend

    warmup = _warmup_module()
    monkeypatch.setattr(
        moe_warmup, "warm_moe", lambda worker: worker.model_runner.dummy_runs.append("moe")
    )
    vllms = Backends["FLASHMLA_SPARSE_DSV4"].get_class()
    vllms_v41 = Backends["FLASHMLA_SPARSE_DSV41"].get_class()
    other = Backends["TRITON_ATTN"].get_class()
    for backends, selected, moe in [
        ((DSV4NVFP4Backend, DSV4NVFP4SWABackend), BACKEND_NAME, True),
        ((DSV4NVFP4SWABackend,), BACKEND_NAME, True),
        ((vllms_v41,), BACKEND_NAME, True),  # V4.1 layers keep vLLM's backend classes
        ((vllms,), None, False),
        ((vllms_v41,), None, False),
        ((other,), None, False),
    ]:
        runner = _runner(*backends)
        worker = _worker(runner)
        worker.vllm_config.attention_config = fake_config(selected).attention_config
        warmup.deepseek_v4_sparse_mla_attention_warmup(worker)
        runs = [run if run == "moe" else run["num_tokens"] for run in runner.dummy_runs]
        expected = ([] if backends == (other,) else [16]) + (["moe"] if moe else [])
        assert runs == expected, (backends, selected)


@pytest.mark.usefixtures("h200")
@pytest.mark.parametrize("switch, moe", [(None, True), ("1", True), ("0", False)])
def test_deepseek_v4_warmup_hook_runs_the_moe_steps_unless_switched_off(monkeypatch, switch, moe):
    """The hook with the real fused-MoE warmup, on a stand-in worker whose model has one MoE
    layer (8 experts, vLLM's default configs): vLLM's 16-token step, then one step per count of
    every config interval (here 1..16 and 33..40); ``DSV4_ATTN_MOE_WARMUP=0`` leaves vLLM's
    step alone."""
    from dsv4_attn.vllm_glue.backend import DSV4NVFP4Backend

    if switch is None:
        monkeypatch.delenv("DSV4_ATTN_MOE_WARMUP", raising=False)
    else:
        monkeypatch.setenv("DSV4_ATTN_MOE_WARMUP", switch)
    warmup = _warmup_module()
    worker = stand_in_worker(max_batched=40)
    worker.model_runner.attn_groups = [[SimpleNamespace(backend=DSV4NVFP4Backend)]]
    worker.vllm_config = _worker(worker.model_runner).vllm_config
    warmup.deepseek_v4_sparse_mla_attention_warmup(worker)
    steps = worker.model_runner.steps
    assert all(step["create_mixed_batch"] for step in steps)
    moe_counts = [*range(1, 17), *range(33, 41)] if moe else []
    assert [step["num_tokens"] for step in steps] == [16, *moe_counts]


def test_one_module_hooks_each_of_its_functions_on_first_import(tmp_path, monkeypatch):
    """Several targets in one module, on a stand-in module hooked through :func:`install`: on
    its first import each matching function gets its own wrapper, and one with another
    signature alone gets the guard."""
    from dsv4_attn.vllm_glue.backend import DSV4NVFP4Backend

    name = "dsv4_fake_two_targets"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent("""
            def _select_dsv4_attn_cls(vllm_config):
                return "upstream"

            def _has_deepseek_v4_sparse_mla_backend(runner):
                return False

            def _insert_context_kv(attn, kv, positions):
                return "upstream"
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    select = compat.HookTarget(name, "_select_dsv4_attn_cls", ("vllm_config",), True)
    check = compat.HookTarget(name, "_has_deepseek_v4_sparse_mla_backend", ("runner",), True)
    changed = compat.HookTarget(
        name, "_insert_context_kv", ("attn", "kv", "positions", "slot_mapping"), True
    )
    for target, wrap in [
        (select, model_hook._dsv4_selector),
        (check, model_hook._dsv4_warmup_check),
        (changed, model_hook._dspark_context_insert),
    ]:
        monkeypatch.setitem(model_hook._WRAPPERS, (name, target.function), wrap)
    monkeypatch.setattr(model_hook, "HOOK_TARGETS", (select, check, changed))
    monkeypatch.setattr(model_hook._finder, "targets", {})
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    model_hook.install()
    module = importlib.import_module(name)
    try:
        assert model_hook.is_patched(module, select) and model_hook.is_patched(module, check)
        assert not model_hook.is_patched(module, changed)
        assert module._select_dsv4_attn_cls(fake_config(BACKEND_NAME)).__name__ == (
            "DSV4NVFP4Attention"
        )
        assert module._select_dsv4_attn_cls(fake_config("TRITON_ATTN")) == "upstream"
        assert module._has_deepseek_v4_sparse_mla_backend(_runner(DSV4NVFP4Backend)) is True
        assert module._insert_context_kv(fake_config(None), 1, 2) == "upstream"
        with pytest.raises(compat.IncompatibleVLLMError, match=r"vLLM 0\.33\.0 only"):
            module._insert_context_kv(fake_config(BACKEND_NAME), 1, 2)
    finally:
        sys.modules.pop(name)


def test_importers_taken_before_the_hook_get_the_wrapper(tmp_path, monkeypatch):
    """A module that took the function by ``from ... import`` before the hook (as vLLM's kernel
    warmup takes the DeepSeek-V4 warmup) has its binding replaced; one imported after reads
    the wrapper; a binding of something else under that name is left alone."""
    defs, early, late, unrelated = (f"dsv4_fake_{n}" for n in ("defs", "early", "late", "other"))
    (tmp_path / f"{defs}.py").write_text("def run(worker):\n    return 'upstream'\n")
    for user in (early, late):
        (tmp_path / f"{user}.py").write_text(f"from {defs} import run\n")
    (tmp_path / f"{unrelated}.py").write_text("def run(worker):\n    return 'its own'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    target = compat.HookTarget(defs, "run", ("worker",), True, importers=(early, late, unrelated))
    monkeypatch.setitem(model_hook._WRAPPERS, (defs, "run"), model_hook._dsv4_kernel_warmup)
    names = (defs, early, late, unrelated)
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        module = importlib.import_module(defs)
        early_module = importlib.import_module(early)
        unrelated_module = importlib.import_module(unrelated)
        own = unrelated_module.run
        model_hook._patch(module, target)
        late_module = importlib.import_module(late)
        assert model_hook.is_patched(module, target)
        assert early_module.run is module.run and late_module.run is module.run
        assert unrelated_module.run is own
    finally:
        for name in names:
            sys.modules.pop(name, None)


def test_dspark_context_writer_routes_nvfp4_layers_to_ours(monkeypatch):
    """DSpark writes its context KV through a module function of its own; the hook sends
    DSV4_NVFP4 layers with an NVFP4 cache to the layer's writer (vLLM's would write
    fp8_ds_mla rows into NVFP4 pages) and everything else to vLLM's, and the draft model's
    method finds the hooked function at call time."""
    from tests import vllm_glue_testing as vt

    plugin.register()
    dspark = importlib.import_module("vllm.models.deepseek_v4.nvidia.dspark")
    insert = dspark._insert_context_kv
    assert model_hook.is_patched(dspark, compat.HOOK_TARGETS[2])
    method = inspect.unwrap(dspark.DSparkDeepseekV4Model.precompute_and_store_context_kv)
    method_globals = method.__globals__
    assert method_globals["_insert_context_kv"] is insert
    assert insert.__wrapped__.__name__ == "_insert_context_kv"
    to_vllm, to_layer = [], []
    hooked = model_hook._dspark_context_insert(lambda *args: to_vllm.append(args))
    nvfp4 = vt.tiny_model("auto").layers[1]
    fp8 = vt.tiny_model("fp8").layers[1]
    vllms_own = SimpleNamespace()
    monkeypatch.setattr(nvfp4, "insert_context_rows", lambda *args: to_layer.append(args))
    for layer in (nvfp4, fp8, vllms_own):
        hooked(layer, "kv", "positions", "slots")
    assert to_layer == [("kv", "positions", "slots")]
    assert to_vllm == [(fp8, "kv", "positions", "slots"), (vllms_own, "kv", "positions", "slots")]


def test_install_is_idempotent(dsv4_model):
    select = dsv4_model._select_dsv4_attn_cls
    model_hook.install()
    model_hook.install()
    assert dsv4_model._select_dsv4_attn_cls is select
    assert sys.meta_path.count(model_hook._finder) == 1


def test_installed_vllm_matches_the_hook_targets():
    assert compat.incompatibility() is None
    assert compat.installed_vllm_version() == compat.SUPPORTED_VLLM_VERSION


@pytest.mark.parametrize(
    "target, reason",
    [
        (
            compat.HookTarget(
                "vllm.models.deepseek_v4.nvidia.model",
                "_select_dsv4_attn_cls",
                ("vllm_config", "device"),
                True,
            ),
            r"takes \(vllm_config\)",
        ),
        (
            compat.HookTarget(
                "vllm.models.deepseek_v4.nvidia.model", "_select_attention", ("vllm_config",), True
            ),
            "has no module-level function",
        ),
        (
            compat.HookTarget(
                "vllm.models.deepseek_v9.nvidia.model",
                "_select_dsv4_attn_cls",
                ("vllm_config",),
                True,
            ),
            "is missing",
        ),
    ],
)
def test_changed_hook_targets_are_refused_naming_the_version(monkeypatch, target, reason):
    monkeypatch.setattr(compat, "HOOK_TARGETS", (target,))
    message = compat.incompatibility()
    assert message is not None and re.search(reason, message)
    assert "vLLM 0.33.0 only" in message and "VLLM_PLUGINS" in message


def test_a_target_without_source_is_left_to_the_import_check(tmp_path, monkeypatch):
    """A vLLM installed as compiled modules only: nothing to parse, so the source check passes
    it on to the check of the function object on import; a module that is absent in every form
    is still refused."""
    target = compat.HookTarget("vllm.models.fake.model", "_select", ("vllm_config",), True)
    monkeypatch.setattr(compat, "HOOK_TARGETS", (target,))
    monkeypatch.setattr(compat, "_module_base", lambda module: tmp_path / "model")
    assert "module vllm.models.fake.model is missing" in compat.incompatibility()
    (tmp_path / "model.pyc").write_bytes(b"compiled")
    assert compat.incompatibility() is None


def test_missing_optional_target_is_fine(monkeypatch):
    absent = compat.HookTarget("vllm.models.deepseek_v9.model", "f", ("vllm_config",), False)
    monkeypatch.setattr(compat, "HOOK_TARGETS", (absent,))
    assert compat.incompatibility() is None


def test_runtime_signature_check():
    target = compat.HOOK_TARGETS[0]

    def good(vllm_config):
        return None

    def extra(vllm_config, device=None):
        return None

    def renamed(config):
        return None

    compat.check_hook_callable(good, target)
    for bad in (extra, renamed, None):
        with pytest.raises(compat.IncompatibleVLLMError, match=r"0\.33\.0"):
            compat.check_hook_callable(bad, target)


# (hook target index, parameter list of a stand-in for the hooked function, whether it fits)
SIGNATURES = [
    (0, "vllm_config", True),
    (0, "vllm_config: 'VllmConfig'", True),  # annotations are not part of the contract
    (0, "config", False),  # renamed
    (0, "vllm_config, device", False),  # added
    (0, "", False),  # removed
    (0, "*, vllm_config", False),  # keyword-only
    (0, "vllm_config, /", False),  # positional-only
    (0, "*args", False),  # *args in place of the parameter
    (0, "**kwargs", False),  # **kwargs in place of the parameter
    (0, "*args, **kwargs", False),
    (2, "attn, kv, positions, slot_mapping", True),
    (2, "attn: object, kv: object, positions: object, slot_mapping: object", True),
    (2, "attn, kv, position, slot_mapping", False),  # one renamed
    (2, "attn, kv, slot_mapping, positions", False),  # reordered
    (2, "attn, kv, positions", False),  # one removed
    (2, "attn, kv, positions, slot_mapping, layer", False),  # one added
    (2, "attn, kv, positions, slot_mapping, layer=None", False),  # one added, with a default
    (2, "attn, kv, positions, slot_mapping, *, layer", False),  # a keyword-only one added
    (2, "attn, kv, positions, *, slot_mapping", False),  # the last turned keyword-only
    (2, "attn, kv, positions, slot_mapping, /", False),  # all positional-only
    (2, "attn, /, kv, positions, slot_mapping", False),  # the first positional-only
    (2, "attn, *args", False),  # *args in place of three
    (2, "attn, kv, **kwargs", False),  # **kwargs in place of two
    (2, "attn, kv, positions, slot_mapping, *rest", False),  # *args added
    (2, "attn, kv, positions, slot_mapping, **extra", False),  # **kwargs added
    (0, "vllm_config=None", False),  # a default: a wrapper without it refuses shorter calls
    (2, "attn, kv, positions, slot_mapping=None", False),  # the last defaulted
    (2, "attn, kv, positions=None, slot_mapping=None", False),  # the last two defaulted
    (2, "attn, /, kv, positions, slot_mapping=None", False),  # positional-only and a default
]


def _stand_in_source(target: compat.HookTarget, params: str) -> str:
    return f"def {target.function}({params}):\n    return None\n"


@pytest.mark.parametrize("index, params, ok", SIGNATURES)
def test_source_check_refuses_every_other_signature(tmp_path, monkeypatch, index, params, ok):
    """The plugin's check of vLLM's source (at registration): the hook target's own module
    replaced by a stand-in whose function takes ``params``; only the exact parameter list of
    the target fits, and a mismatch is refused naming what was found and what is expected."""
    target = compat.HOOK_TARGETS[index]
    source = tmp_path / "model.py"
    source.write_text(_stand_in_source(target, params))
    monkeypatch.setattr(compat, "HOOK_TARGETS", (target,))
    monkeypatch.setattr(compat, "_source_path", lambda module: source)
    message = compat.incompatibility()
    if ok:
        assert message is None
    else:
        assert message is not None and "vLLM 0.33.0 only" in message
        assert f"{target.module}.{target.function} takes (" in message
        assert f"expected ({', '.join(target.params)})" in message


@pytest.mark.parametrize("index, params, ok", SIGNATURES)
def test_runtime_check_refuses_every_other_signature(index, params, ok):
    """The check of the function object when vLLM's module is imported: the same stand-ins,
    the same verdicts as the source check."""
    target = compat.HOOK_TARGETS[index]
    namespace: dict[str, object] = {}
    exec(_stand_in_source(target, params), namespace)  # a function from the fixed strings above
    func = namespace[target.function]
    if ok:
        compat.check_hook_callable(func, target)
    else:
        with pytest.raises(compat.IncompatibleVLLMError, match=r"vLLM 0\.33\.0 only"):
            compat.check_hook_callable(func, target)


@pytest.mark.parametrize("signature, ok", [("vllm_config", True), ("vllm_config, extra", False)])
def test_import_hook_patches_or_guards_on_first_import(tmp_path, monkeypatch, signature, ok):
    """The post-import path, on a stand-in module: patched when its signature matches; when it
    does not, the import still succeeds and a guard passes every call through except those
    selecting DSV4_NVFP4, which are refused naming the supported vLLM (never FlashMLA silently)."""
    name = f"dsv4_fake_model_{int(ok)}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(f"""
            def _select_dsv4_attn_cls({signature}):
                return "upstream"
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    target = compat.HookTarget(name, "_select_dsv4_attn_cls", ("vllm_config",), True)
    monkeypatch.setitem(model_hook._WRAPPERS, (name, target.function), model_hook._dsv4_selector)
    monkeypatch.setitem(model_hook._finder.targets, name, {target.function: target})
    monkeypatch.setattr(sys, "meta_path", [model_hook._finder, *sys.meta_path])
    monkeypatch.delitem(sys.modules, name, raising=False)
    module = importlib.import_module(name)
    try:
        assert model_hook.is_patched(module, target) is ok
        if ok:
            assert module._select_dsv4_attn_cls(fake_config("TRITON_ATTN")) == "upstream"
            assert module._select_dsv4_attn_cls(fake_config(BACKEND_NAME)).__name__ == (
                "DSV4NVFP4Attention"
            )
        else:
            assert module._select_dsv4_attn_cls(fake_config("TRITON_ATTN"), 1) == "upstream"
            assert module._select_dsv4_attn_cls(fake_config(None), extra=2) == "upstream"
            with pytest.raises(compat.IncompatibleVLLMError, match=r"vLLM 0\.33\.0 only"):
                module._select_dsv4_attn_cls(fake_config(BACKEND_NAME), 1)
    finally:
        sys.modules.pop(name)
