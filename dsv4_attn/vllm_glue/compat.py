"""The vLLM version this glue is written against, and a cheap check of the installed one.

The glue hooks private vLLM functions (:data:`HOOK_TARGETS`), so another vLLM version can break it
silently: a renamed or re-signatured selector would let DeepSeek-V4 fall back to FlashMLA
without a word. :func:`incompatibility` runs when the plugin registers, in every vLLM process,
and says why the installed vLLM does not fit; the plugin then leaves ``DSV4_NVFP4``
unregistered with a warning (vLLM itself, and every other backend, stay untouched), and only
``--attention-backend DSV4_NVFP4`` fails.

It is cheap: the version comes from the package metadata and the hook targets are checked by
parsing their source files (``ast``), without importing vLLM's model code. A vLLM installed
without ``.py`` sources (compiled modules only) cannot be checked this way; the hook checks the
real function object when the module is imported (:func:`check_hook_callable`).
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.metadata
import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path

from dsv4_attn.log import get_logger

__all__ = [
    "HOOK_TARGETS",
    "SUPPORTED_VLLM_VERSION",
    "HookTarget",
    "IncompatibleVLLMError",
    "check_hook_callable",
    "incompatibility",
    "installed_vllm_version",
]

logger = get_logger(__name__)

SUPPORTED_VLLM_VERSION = "0.33.0"


@dataclass(frozen=True)
class HookTarget:
    """A vLLM function the glue replaces, with the signature it was written for."""

    module: str  # dotted module name, e.g. "vllm.models.deepseek_v4.nvidia.model"
    function: str  # module-level function name
    params: tuple[str, ...]  # its positional-or-keyword parameters without defaults, nothing else
    required: bool  # False: the module may be absent (an older vLLM without it)
    # Modules that bind the function by ``from module import function`` when they are imported:
    # one imported before the hook holds the original, so its binding is replaced as well.
    importers: tuple[str, ...] = ()


# One module may hold several targets; each is checked, hooked or guarded on its own.
HOOK_TARGETS: tuple[HookTarget, ...] = (
    HookTarget(
        "vllm.models.deepseek_v4.nvidia.model", "_select_dsv4_attn_cls", ("vllm_config",), True
    ),
    HookTarget(
        "vllm.models.deepseek_v41.nvidia.model", "_select_dsv4_attn_cls", ("vllm_config",), False
    ),
    HookTarget(
        "vllm.models.deepseek_v4.nvidia.dspark",
        "_insert_context_kv",
        ("attn", "kv", "positions", "slot_mapping"),
        True,
    ),
    HookTarget(
        "vllm.model_executor.warmup.flashinfer_sparse_mla_warmup",
        "_has_deepseek_v4_sparse_mla_backend",
        ("runner",),
        False,
    ),
    HookTarget(
        "vllm.model_executor.warmup.flashinfer_sparse_mla_warmup",
        "deepseek_v4_sparse_mla_attention_warmup",
        ("worker",),
        False,
        importers=("vllm.model_executor.warmup.kernel_warmup",),
    ),
)


class IncompatibleVLLMError(RuntimeError):
    """The installed vLLM is not the one the DSV4_NVFP4 glue hooks into."""


def installed_vllm_version() -> str | None:
    """The installed ``vllm`` distribution's version, or None if it has no metadata."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def _message(reason: str) -> str:
    found = installed_vllm_version() or "unknown"
    return (
        f"dsv4-attn's DSV4_NVFP4 backend supports vLLM {SUPPORTED_VLLM_VERSION} only "
        f"(found vLLM {found}): {reason}. Install vllm=={SUPPORTED_VLLM_VERSION}, or keep this "
        f"plugin from loading by listing only the other plugins in VLLM_PLUGINS."
    )


def _module_base(module: str) -> Path | None:
    """``<vllm root>/a/b/c`` for ``vllm.a.b.c`` (no suffix), found without importing vLLM."""
    spec = importlib.util.find_spec("vllm")  # top-level only: does not import vllm
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    return root.joinpath(*module.split(".")[1:])


def _source_path(module: str) -> Path | None:
    """Path of ``module``'s source file inside the installed vLLM, found without importing it."""
    base = _module_base(module)
    path = base.with_suffix(".py") if base is not None else None
    return path if path is not None and path.is_file() else None


def _compiled_only(module: str) -> bool:
    """Whether ``module`` exists in the installed vLLM only as compiled code (``.pyc``, an
    extension module), which :func:`_check_source` cannot read."""
    base = _module_base(module)
    if base is None:
        return False
    suffixes = importlib.machinery.BYTECODE_SUFFIXES + importlib.machinery.EXTENSION_SUFFIXES
    return any(base.with_name(base.name + suffix).is_file() for suffix in suffixes)


def _describe_ast_args(args: ast.arguments) -> str:
    # Positional-only parameters and defaults are mismatches (HookTarget.params are
    # positional-or-keyword without defaults: a wrapper with none would refuse a call that
    # leaves a defaulted argument out), so they are written as Python writes them.
    positional = [a.arg for a in (*args.posonlyargs, *args.args)]
    first_default = len(positional) - len(args.defaults)
    positional = [p + ("=..." if i >= first_default else "") for i, p in enumerate(positional)]
    slash = len(args.posonlyargs)
    parts = positional[:slash] + (["/"] if slash else []) + positional[slash:]
    if args.vararg is not None:
        parts.append("*" + args.vararg.arg)
    parts += [a.arg + "=" for a in args.kwonlyargs]
    if args.kwarg is not None:
        parts.append("**" + args.kwarg.arg)
    return ", ".join(parts)


def _check_source(target: HookTarget) -> str | None:
    """Why ``target`` does not match in the installed source, or None when it does."""
    path = _source_path(target.module)
    if path is None:
        if not target.required or _compiled_only(target.module):
            return None  # absent and optional, or checked on import (check_hook_callable)
        return f"module {target.module} is missing"
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == target.function:
            found = _describe_ast_args(node.args)
            if found != ", ".join(target.params):
                return (
                    f"{target.module}.{target.function} takes ({found}), "
                    f"expected ({', '.join(target.params)})"
                )
            return None
    return f"{target.module} has no module-level function {target.function}"


def incompatibility() -> str | None:
    """Why the installed vLLM does not fit the glue (the full message, naming the installed and
    the supported version), or None when every hook target matches.

    A different version string alone only logs a warning: the hooks are what the glue depends on.
    """
    for target in HOOK_TARGETS:
        reason = _check_source(target)
        if reason is not None:
            return _message(reason)
    version = installed_vllm_version()
    if version is not None and version != SUPPORTED_VLLM_VERSION:
        logger.warning(
            "dsv4-attn was written for vLLM %s; found %s. Its hook targets match, so it loads.",
            SUPPORTED_VLLM_VERSION,
            version,
        )
    return None


def check_hook_callable(func: object, target: HookTarget) -> None:
    """Raise :class:`IncompatibleVLLMError` unless ``func`` is ``target`` with its signature."""
    if not callable(func):
        raise IncompatibleVLLMError(_message(f"{target.module} has no callable {target.function}"))
    params = inspect.signature(func).parameters.values()
    names = tuple(
        p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is p.empty
    )
    if names != target.params or len(names) != len(params):
        raise IncompatibleVLLMError(
            _message(
                f"{target.module}.{target.function} has signature {inspect.signature(func)}, "
                f"expected ({', '.join(target.params)})"
            )
        )
