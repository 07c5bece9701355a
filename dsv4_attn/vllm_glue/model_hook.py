"""Route ``--attention-backend DSV4_NVFP4`` to DeepSeek-V4's decoder layers.

vLLM 0.33.0 builds DeepSeek-V4 attention in ``DeepseekV4DecoderLayer.__init__`` through the module
function ``vllm.models.deepseek_v4.nvidia.model._select_dsv4_attn_cls(vllm_config)``, which maps
unknown backend names to FlashMLA without a word. :func:`install` wraps that function: for
``DSV4_NVFP4`` it returns :class:`dsv4_attn.vllm_glue.attention.DSV4NVFP4Attention`; every other
choice goes to the original unchanged. The decoder layer looks the function up as a module global
at call time, so the wrapper covers the main model, MTP and DSpark alike.

DSpark's draft writes the context KV of its layers itself, through the module function
``vllm.models.deepseek_v4.nvidia.dspark._insert_context_kv``, which picks vLLM's writer by the
cache tensor's dtype: it would write fp8_ds_mla rows into an NVFP4 cache. Its wrapper hands
this package's NVFP4 layers to
:meth:`~dsv4_attn.vllm_glue.attention.DSV4NVFP4Attention.insert_context_rows` and every other
layer (fp8_ds_mla pages are vLLM's layout) to the original.

vLLM's kernel warmup runs a mixed prefill + decode step before serving only for the DeepSeek-V4
backends it names (``vllm.model_executor.warmup.flashinfer_sparse_mla_warmup.
_has_deepseek_v4_sparse_mla_backend``), so without a word this backend's prefill-only kernels
would compile during a user's first request. Its wrapper also answers yes for a runner whose
attention groups use ``DSV4_NVFP4`` or its SWA twin.

That warmup (``deepseek_v4_sparse_mla_attention_warmup(worker)``) runs one 16-token step, so
vLLM's Triton fused-MoE kernel would still compile, per block config and per Triton's
divisibility-by-16 specialization of its integer arguments, during the first requests of
prefill lengths the startup never ran. Its wrapper runs the original, then, for a runner using
this package's backends, :func:`~dsv4_attn.vllm_glue.moe_warmup.warm_moe` (one dummy step per
token count of :func:`~dsv4_attn.vllm_glue.moe_warmup.moe_warmup_token_counts`;
``DSV4_ATTN_MOE_WARMUP=0`` turns it off). ``vllm.model_executor.warmup.kernel_warmup`` imports
the function by name, so a binding it took before the hook is replaced too
(:attr:`~dsv4_attn.vllm_glue.compat.HookTarget.importers`).

The V4.1 model (``vllm.models.deepseek_v41``) has its own selector and its own attention base
class: there ``DSV4_NVFP4`` selects :class:`dsv4_attn.vllm_glue.attention_v41.DSV41NVFP4Attention`
with fp8 caches, and raises a ValueError naming the accepted ``--kv-cache-dtype`` values for any
other cache format at model construction, instead of silently running FlashMLA.

The model modules are heavy (seconds to import), so :func:`install` does not import them: it patches
a module already imported, and otherwise patches it right after its first import, through a
``sys.meta_path`` finder; one module may hold several targets, each wrapped by its own function
(``_WRAPPERS``, keyed by module and function). A target whose function is missing or has another
signature there (:func:`~dsv4_attn.vllm_glue.compat.check_hook_callable`; the plugin's source
check missed it, as for a vLLM installed without sources) is not hooked: the import succeeds, a
WARNING says why, and the function is wrapped in a guard that passes every call through unchanged
except those selecting ``DSV4_NVFP4``, which raise
:class:`~dsv4_attn.vllm_glue.compat.IncompatibleVLLMError` instead of running FlashMLA.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from dsv4_attn.kv_cache import KVFormat
from dsv4_attn.log import get_logger
from dsv4_attn.vllm_glue import BACKEND_NAME, SWA_BACKEND_NAME
from dsv4_attn.vllm_glue.compat import (
    HOOK_TARGETS,
    HookTarget,
    IncompatibleVLLMError,
    check_hook_callable,
)

__all__ = ["install", "is_dsv4_nvfp4", "is_patched", "runs_dsv4_nvfp4"]

logger = get_logger(__name__)

_PATCHED_MARK = "_dsv4_nvfp4_hook"


def is_dsv4_nvfp4(backend: Any) -> bool:
    """Whether an ``attention_config.backend`` value selects this package's backend."""
    return backend is not None and getattr(backend, "name", None) == BACKEND_NAME


def _dsv4_selector(original: Callable[[Any], type]) -> Callable[[Any], type]:
    @functools.wraps(original)
    def select(vllm_config: Any) -> type:
        if is_dsv4_nvfp4(vllm_config.attention_config.backend):
            from dsv4_attn.vllm_glue.attention import DSV4NVFP4Attention

            return DSV4NVFP4Attention
        return original(vllm_config)

    return select


def _dsv41_selector(original: Callable[[Any], type]) -> Callable[[Any], type]:
    @functools.wraps(original)
    def select(vllm_config: Any) -> type:
        if is_dsv4_nvfp4(vllm_config.attention_config.backend):
            from dsv4_attn.vllm_glue.attention_v41 import DSV41NVFP4Attention, v41_kv_format

            v41_kv_format(vllm_config.cache_config.cache_dtype)  # fp8 only: says so otherwise
            return DSV41NVFP4Attention
        return original(vllm_config)

    return select


def _dspark_context_insert(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def insert(attn: Any, kv: Any, positions: Any, slot_mapping: Any) -> None:
        from dsv4_attn.vllm_glue.attention import DSV4NVFP4Attention

        if isinstance(attn, DSV4NVFP4Attention) and attn.kv_format is KVFormat.NVFP4:
            attn.insert_context_rows(kv, positions, slot_mapping)
            return
        original(attn, kv, positions, slot_mapping)

    return insert


def runs_dsv4_nvfp4(runner: Any) -> bool:
    """Whether a model runner's attention groups use this package's backends (the main or the
    SWA one), read as vLLM's warmup reads its own: ``runner.attn_groups[i][j].backend``."""
    names = {BACKEND_NAME, SWA_BACKEND_NAME}
    for groups in getattr(runner, "attn_groups", None) or ():
        for group in groups:
            get_name = getattr(getattr(group, "backend", None), "get_name", None)
            if get_name is not None and get_name() in names:
                return True
    return False


def _dsv4_warmup_check(original: Callable[[Any], bool]) -> Callable[[Any], bool]:
    @functools.wraps(original)
    def has_backend(runner: Any) -> bool:
        return original(runner) or runs_dsv4_nvfp4(runner)

    return has_backend


def _serves_dsv4_nvfp4(worker: Any) -> bool:
    """Whether a worker serves with this package's backend: its attention groups use it (V4),
    or its config selects it (V4.1, whose layers keep vLLM's V4.1 backend classes)."""
    attention_config = getattr(getattr(worker, "vllm_config", None), "attention_config", None)
    return runs_dsv4_nvfp4(worker.model_runner) or is_dsv4_nvfp4(
        getattr(attention_config, "backend", None)
    )


def _dsv4_kernel_warmup(original: Callable[[Any], None]) -> Callable[[Any], None]:
    @functools.wraps(original)
    def warmup(worker: Any) -> None:
        original(worker)
        if _serves_dsv4_nvfp4(worker):
            from dsv4_attn.vllm_glue.moe_warmup import warm_moe

            warm_moe(worker)

    return warmup


_WARMUP_MODULE = "vllm.model_executor.warmup.flashinfer_sparse_mla_warmup"

# (module, function) of each hook target -> the function making its wrapper from the original.
_WRAPPERS: dict[tuple[str, str], Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    ("vllm.models.deepseek_v4.nvidia.model", "_select_dsv4_attn_cls"): _dsv4_selector,
    ("vllm.models.deepseek_v41.nvidia.model", "_select_dsv4_attn_cls"): _dsv41_selector,
    ("vllm.models.deepseek_v4.nvidia.dspark", "_insert_context_kv"): _dspark_context_insert,
    (_WARMUP_MODULE, "_has_deepseek_v4_sparse_mla_backend"): _dsv4_warmup_check,
    (_WARMUP_MODULE, "deepseek_v4_sparse_mla_attention_warmup"): _dsv4_kernel_warmup,
}


def _selects_dsv4_nvfp4(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call of an unhooked selector carries a config selecting ``DSV4_NVFP4``
    (any argument with ``attention_config.backend``, else vLLM's current config)."""
    for value in (*args, *kwargs.values()):
        attention_config = getattr(value, "attention_config", None)
        if attention_config is not None:
            return is_dsv4_nvfp4(getattr(attention_config, "backend", None))
    try:
        from vllm.config import get_current_vllm_config

        return is_dsv4_nvfp4(get_current_vllm_config().attention_config.backend)
    except Exception:
        return False


def _guard(original: Any, error: IncompatibleVLLMError) -> Callable[..., Any]:
    """``original`` unchanged for every call but those selecting ``DSV4_NVFP4``: ``error``."""

    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if _selects_dsv4_nvfp4(args, kwargs):
            raise error
        return original(*args, **kwargs)

    return guarded


def _patch(module: ModuleType, target: HookTarget) -> None:
    original = getattr(module, target.function, None)
    if getattr(original, _PATCHED_MARK, False):
        return
    try:
        check_hook_callable(original, target)
    except IncompatibleVLLMError as error:
        logger.warning("dsv4-attn: %s.%s not hooked: %s", target.module, target.function, error)
        if not callable(original):
            return
        wrapper, mark = _guard(original, error), "guard"
    else:
        wrapper, mark = _WRAPPERS[target.module, target.function](original), "hook"
        logger.debug("dsv4-attn: hooked %s.%s", target.module, target.function)
    setattr(wrapper, _PATCHED_MARK, mark)
    setattr(module, target.function, wrapper)
    # An importer imported later reads the wrapper from ``module``; one imported earlier holds
    # the original under the same name.
    for name in target.importers:
        importer = sys.modules.get(name)
        if importer is not None and getattr(importer, target.function, None) is original:
            setattr(importer, target.function, wrapper)


def is_patched(module: ModuleType, target: HookTarget) -> bool:
    """Whether ``module``'s hook target is this package's selector (not the guard)."""
    return getattr(getattr(module, target.function, None), _PATCHED_MARK, None) == "hook"


class _PatchingLoader(importlib.abc.Loader):
    """Delegates to the real loader, then patches the freshly executed module's targets."""

    def __init__(self, loader: importlib.abc.Loader, targets: tuple[HookTarget, ...]) -> None:
        self._loader = loader
        self._targets = targets

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        for target in self._targets:
            _patch(module, target)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, is_package, ...
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds the hook targets' modules like the path finder does, with a patching loader."""

    def __init__(self) -> None:
        # module name -> its targets by function name
        self.targets: dict[str, dict[str, HookTarget]] = {}

    def find_spec(
        self, fullname: str, path: Any = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        hooks = self.targets.get(fullname)
        if not hooks:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PatchingLoader(spec.loader, tuple(hooks.values()))
        return spec


_finder = _PostImportFinder()


def install() -> None:
    """Hook every target in :data:`~dsv4_attn.vllm_glue.compat.HOOK_TARGETS`; idempotent."""
    for target in HOOK_TARGETS:
        module = sys.modules.get(target.module)
        if module is not None:
            _patch(module, target)
        # also covers a later re-import
        _finder.targets.setdefault(target.module, {})[target.function] = target
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
