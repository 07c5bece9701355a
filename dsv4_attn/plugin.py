"""vLLM plugin entry point: registers the ``DSV4_NVFP4`` attention backend.

Declared in pyproject.toml under ``[project.entry-points."vllm.general_plugins"]`` as
``dsv4_nvfp4 = "dsv4_attn.plugin:register"``. vLLM calls :func:`register` in every process it
starts (API server, engine core, workers) before it parses ``--attention-backend`` or builds the
model. Registering is cheap and safe there: it imports vLLM's backend registry (already loaded
in any vLLM process) and nothing of vLLM's model code, and never touches CUDA.

What it does, once per process (a second call is a no-op):

1. checks that the installed vLLM has the functions the glue hooks, with the signatures it was
   written for (:mod:`dsv4_attn.vllm_glue.compat`); otherwise it raises, naming vLLM 0.33.0;
2. adds the member ``DSV4_NVFP4`` to ``AttentionBackendEnum``, pointing at
   :class:`dsv4_attn.vllm_glue.backend.DSV4NVFP4Backend`;
3. makes that member pickle by name (see :func:`restore_backend`);
4. hooks DeepSeek-V4's attention-class selector (:mod:`dsv4_attn.vllm_glue.model_hook`).

Spawn safety: enum members pickle by value, and a worker started with the ``spawn`` method
unpickles its ``VllmConfig`` before it loads plugins, so the dynamic member would fail there
(``'<class path>' is not a valid AttentionBackendEnum``). The member therefore reduces to
``restore_backend("DSV4_NVFP4")``, which registers the backend in the fresh interpreter and
returns the member.
"""

from __future__ import annotations

from typing import Any

from dsv4_attn.vllm_glue import BACKEND_CLASS_PATH, BACKEND_NAME

__all__ = ["register", "restore_backend"]

_registered = False


def register() -> None:
    """Register ``DSV4_NVFP4`` with vLLM and hook DeepSeek-V4's selector; idempotent.

    Raises:
        dsv4_attn.vllm_glue.compat.IncompatibleVLLMError: the installed vLLM lacks a hooked
            function or changed its signature.
        ValueError: another package registered the name ``DSV4_NVFP4`` for another class.
    """
    global _registered
    if _registered:
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from dsv4_attn.vllm_glue import compat, model_hook

    compat.check_installed_vllm()
    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, BACKEND_CLASS_PATH)
    member = AttentionBackendEnum[BACKEND_NAME]
    if member.get_path() != BACKEND_CLASS_PATH:
        raise ValueError(
            f"attention backend {BACKEND_NAME} is registered for {member.get_path()}, "
            f"not for {BACKEND_CLASS_PATH}; two plugins claim the name"
        )
    _pickle_by_name(member)
    model_hook.install()
    _registered = True


def restore_backend(name: str) -> Any:
    """Unpickling target of the ``DSV4_NVFP4`` member: register, then return the member."""
    register()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name]


def _pickle_by_name(member: Any) -> None:
    # Pickle looks __reduce_ex__ up on the object, so an attribute on this one member overrides
    # Enum's by-value reduction for it alone; every other member pickles as before.
    def reduce_ex(protocol: int) -> tuple[Any, tuple[str]]:
        return restore_backend, (member.name,)

    member.__reduce_ex__ = reduce_ex
