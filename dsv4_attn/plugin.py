"""vLLM plugin entry point: registers the ``DSV4_NVFP4`` attention backend.

Declared in pyproject.toml under ``[project.entry-points."vllm.general_plugins"]`` as
``dsv4_nvfp4 = "dsv4_attn.plugin:register"``. vLLM calls :func:`register` in every process it
starts (API server, engine core, workers) before it parses ``--attention-backend`` or builds the
model. Registering is cheap and safe there: it imports vLLM's backend registry (already loaded
in any vLLM process) and nothing of vLLM's model code, and never touches CUDA.

What it does, once per process (a second call is a no-op):

1. checks that the installed vLLM has the functions the glue hooks, with the signatures it was
   written for (:mod:`dsv4_attn.vllm_glue.compat`);
2. adds the member ``DSV4_NVFP4`` to ``AttentionBackendEnum``, pointing at
   :class:`dsv4_attn.vllm_glue.backend.DSV4NVFP4Backend`;
3. makes that member pickle by name (see :func:`restore_backend`);
4. hooks DeepSeek-V4's attention-class selector (:mod:`dsv4_attn.vllm_glue.model_hook`).

It never raises: vLLM calls general plugins without a guard, so an exception here would stop
vLLM for every model. When the installed vLLM does not fit (another version, hook targets
renamed) or registering fails for any other reason, it logs one WARNING naming the installed
and the supported vLLM and leaves ``DSV4_NVFP4`` unregistered: every other backend works as
upstream, and only ``--attention-backend DSV4_NVFP4`` fails (vLLM: "Unknown attention backend").

Spawn safety: enum members pickle by value, and a worker started with the ``spawn`` method
unpickles its ``VllmConfig`` before it loads plugins, so the dynamic member would fail there
(``'<class path>' is not a valid AttentionBackendEnum``). The member therefore reduces to
``restore_backend("DSV4_NVFP4")``, which registers the backend in the fresh interpreter and
returns the member.
"""

from __future__ import annotations

from typing import Any

from dsv4_attn.log import get_logger
from dsv4_attn.vllm_glue import BACKEND_CLASS_PATH, BACKEND_NAME

__all__ = ["register", "restore_backend", "unregistered_reason"]

logger = get_logger(__name__)

_registered = False
_unregistered_reason: str | None = None


def register() -> None:
    """Register ``DSV4_NVFP4`` with vLLM and hook DeepSeek-V4's selector; idempotent, and never
    raises (a vLLM it does not fit gets a WARNING and no backend: :func:`unregistered_reason`)."""
    global _registered, _unregistered_reason
    if _registered:
        return
    _registered = True  # one attempt (and at most one warning) per process
    try:
        _unregistered_reason = _register()
    except Exception as exc:  # a vLLM whose registry or logger moved: never break vLLM
        _unregistered_reason = f"registering failed ({type(exc).__name__}: {exc})"
    if _unregistered_reason is not None:
        logger.warning(
            "dsv4-attn: attention backend %s left unregistered: %s. Every other attention "
            "backend is unaffected; --attention-backend %s will be refused.",
            BACKEND_NAME,
            _unregistered_reason,
            BACKEND_NAME,
        )


def unregistered_reason() -> str | None:
    """Why :func:`register` left ``DSV4_NVFP4`` unregistered in this process, or None."""
    return _unregistered_reason


def _register() -> str | None:
    """Register and hook; the reason it did not, or None."""
    from dsv4_attn.vllm_glue import compat

    incompatible = compat.incompatibility()
    if incompatible is not None:
        return incompatible
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from dsv4_attn.vllm_glue import model_hook

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_CLASS_PATH)
    member = AttentionBackendEnum[BACKEND_NAME]
    if member.get_path() != BACKEND_CLASS_PATH:
        return (
            f"the name {BACKEND_NAME} is registered for {member.get_path()}, not for "
            f"{BACKEND_CLASS_PATH}: two plugins claim it"
        )
    _pickle_by_name(member)
    model_hook.install()
    return None


def restore_backend(name: str) -> Any:
    """Unpickling target of the ``DSV4_NVFP4`` member: register, then return the member."""
    register()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if name not in AttentionBackendEnum.__members__:
        raise RuntimeError(f"attention backend {name} is not available: {_unregistered_reason}")
    return AttentionBackendEnum[name]


def _pickle_by_name(member: Any) -> None:
    # Pickle looks __reduce_ex__ up on the object, so an attribute on this one member overrides
    # Enum's by-value reduction for it alone; every other member pickles as before.
    def reduce_ex(protocol: int) -> tuple[Any, tuple[str]]:
        return restore_backend, (member.name,)

    member.__reduce_ex__ = reduce_ex
