"""The vLLM version this glue is written against, and a cheap check of the installed one.

The glue hooks private vLLM functions (:data:`HOOK_TARGETS`), so another vLLM version can break it
silently: a renamed or re-signatured selector would let DeepSeek-V4 fall back to FlashMLA
without a word. :func:`check_installed_vllm` runs when the plugin registers, in every vLLM
process, and raises :class:`IncompatibleVLLMError` naming the supported version instead.

It is cheap: the version comes from the package metadata and the hook targets are checked by
parsing their source files (``ast``), without importing vLLM's model code.
:func:`check_hook_callable` re-checks the real function object when the hook is applied.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path

from vllm.logger import init_logger

__all__ = [
    "HOOK_TARGETS",
    "SUPPORTED_VLLM_VERSION",
    "HookTarget",
    "IncompatibleVLLMError",
    "check_hook_callable",
    "check_installed_vllm",
    "installed_vllm_version",
]

logger = init_logger(__name__)

SUPPORTED_VLLM_VERSION = "0.33.0"


@dataclass(frozen=True)
class HookTarget:
    """A vLLM function the glue replaces, with the signature it was written for."""

    module: str  # dotted module name, e.g. "vllm.models.deepseek_v4.nvidia.model"
    function: str  # module-level function name
    params: tuple[str, ...]  # its positional-or-keyword parameters, nothing else
    required: bool  # False: the module may be absent (an older vLLM without it)


HOOK_TARGETS: tuple[HookTarget, ...] = (
    HookTarget(
        "vllm.models.deepseek_v4.nvidia.model", "_select_dsv4_attn_cls", ("vllm_config",), True
    ),
    HookTarget(
        "vllm.models.deepseek_v41.nvidia.model", "_select_dsv4_attn_cls", ("vllm_config",), False
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


def _source_path(module: str) -> Path | None:
    """Path of ``module``'s source file inside the installed vLLM, found without importing it."""
    spec = importlib.util.find_spec("vllm")  # top-level only: does not import vllm
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    path = root.joinpath(*module.split(".")[1:]).with_suffix(".py")
    return path if path.is_file() else None


def _describe_ast_args(args: ast.arguments) -> str:
    parts = [a.arg for a in (*args.posonlyargs, *args.args)]
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
        return None if not target.required else f"module {target.module} is missing"
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


def check_installed_vllm() -> None:
    """Raise :class:`IncompatibleVLLMError` if a hook target is missing or has another signature.

    A different version string alone only logs a warning: the hooks are what the glue depends on.
    """
    for target in HOOK_TARGETS:
        reason = _check_source(target)
        if reason is not None:
            raise IncompatibleVLLMError(_message(reason))
    version = installed_vllm_version()
    if version is not None and version != SUPPORTED_VLLM_VERSION:
        logger.warning(
            "dsv4-attn was written for vLLM %s; found %s. Its hook targets match, so it loads.",
            SUPPORTED_VLLM_VERSION,
            version,
        )


def check_hook_callable(func: object, target: HookTarget) -> None:
    """Raise :class:`IncompatibleVLLMError` unless ``func`` is ``target`` with its signature."""
    if not callable(func):
        raise IncompatibleVLLMError(_message(f"{target.module} has no callable {target.function}"))
    params = inspect.signature(func).parameters.values()
    names = tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)
    if names != target.params or len(names) != len(params):
        raise IncompatibleVLLMError(
            _message(
                f"{target.module}.{target.function} has signature {inspect.signature(func)}, "
                f"expected ({', '.join(target.params)})"
            )
        )
