"""The balanced decode schedule in serving: which steps of an HCA layer run on it, and its plan.

HCA layers at long contexts give every decode token its own number of compressed entries (all
it can see: a request at 900K tokens reads 7000 of them, one at 2K reads 16). Launched one CTA
per token (the split launch), a wave lasts as long as its longest token; the balanced schedule
(:mod:`dsv4_attn.kernels.sparse_decode_schedule`) gives every SM an equal share of all tokens'
key tiles instead. Its plan depends only on the tokens' key counts, which every HCA layer of a
step shares, so the compressed group's metadata builder makes it once per step (one Triton
program, on the device, no host sync) into buffers allocated once: a FULL CUDA graph replays
the layers' kernels on whatever plan the step's build wrote there, as with every other list.

``DSV4_ATTN_DECODE_SCHEDULE`` chooses: ``auto`` (default: where
:func:`dsv4_attn.kernels.sparse_decode_schedule.balanced_pays` says it pays, from the layer's key
capacity and the step's decode tokens), ``balanced`` (every decode step of every HCA layer, for
testing) or ``split`` (never). The choice for a step depends on its token count and static settings
only, so a captured graph and its replays agree.

The plan counts the keys of the very tensors the kernel reads: the builder writes each token's
window length into its own buffer (:attr:`DSV4CompressedMetadata.window_lens`, the formula of the
SWA group's lengths) and the layer hands that buffer to the kernel as its window's lengths.
"""

from __future__ import annotations

import os

import torch
from vllm.logger import init_logger

from dsv4_attn.kernels import sparse_decode_schedule
from dsv4_attn.kernels.sparse_decode_schedule import DecodeSchedule
from dsv4_attn.log import LOGGER_PREFIX
from dsv4_attn.vllm_glue.support import unsupported_device_reason

__all__ = [
    "SCHEDULES",
    "SCHEDULE_ENV",
    "BalancedDecodePlanner",
    "balanced_capable",
    "decode_schedule_choice",
]

logger = init_logger(LOGGER_PREFIX + __name__)  # vLLM's, with its *_once methods

SCHEDULE_ENV = "DSV4_ATTN_DECODE_SCHEDULE"
SCHEDULES = ("auto", "balanced", "split")


def decode_schedule_choice() -> str:
    """``DSV4_ATTN_DECODE_SCHEDULE`` (default ``auto``), checked."""
    value = os.environ.get(SCHEDULE_ENV, "auto").strip().lower() or "auto"
    if value not in SCHEDULES:
        raise ValueError(
            f"{SCHEDULE_ENV}={os.environ[SCHEDULE_ENV]!r} is not a decode schedule; accepted: "
            f"{', '.join(SCHEDULES)}"
        )
    return value


def balanced_capable(device: torch.device, key_capacity: int) -> bool:
    """Whether a layer whose key lists hold up to ``key_capacity`` keys may run decode steps on
    the balanced schedule: the kernels run on ``device``, the choice is not ``split``, and with
    ``auto`` the lists are long enough for it to pay (for some token count)."""
    choice = decode_schedule_choice()
    if choice == "split" or device.type != "cuda" or unsupported_device_reason(device):
        return False
    return choice == "balanced" or key_capacity >= sparse_decode_schedule.BALANCED_MIN_CAPACITY


class BalancedDecodePlanner:
    """Builds a step's balanced plan into buffers allocated once (the plan, and the window
    lengths it counts).

    Args:
        num_heads: the layers' query heads as the kernel sees them (padded).
        capacities: the widest window list and the widest compressed list (the window size and
            the most visible compressed entries); the plan clamps each length to its width.
        max_tokens: most decode tokens of a step.
        device: where the buffers live.
        num_parts: persistent CTAs per 64-head block (default: one CTA per SM of ``device``).
    """

    def __init__(
        self,
        num_heads: int,
        capacities: tuple[int, int],
        max_tokens: int,
        device: torch.device,
        num_parts: int | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.capacities = capacities
        self.key_capacity = sum(capacities)  # the widest key list
        self.num_parts = num_parts or sparse_decode_schedule.balanced_parts(num_heads, device)
        self.always = decode_schedule_choice() == "balanced"
        self.part_plan = torch.zeros(self.num_parts, 4, dtype=torch.int32, device=device)
        self.token_plan = torch.zeros(max_tokens, 5, dtype=torch.int32, device=device)
        # Each token's window length, filled by the builder's kernel, read by plan and kernel.
        self.window_lens = torch.zeros(max_tokens, dtype=torch.int32, device=device)
        logger.info_once(
            "HCA decode steps run on the balanced schedule %s (%s; lists of up to %d keys, "
            "%d parts per 64 heads).",
            "always" if self.always else "where it pays",
            f"{SCHEDULE_ENV}={'balanced' if self.always else 'auto'}",
            self.key_capacity,
            self.num_parts,
        )

    def wants(self, num_tokens: int) -> bool:
        """Whether a step with ``num_tokens`` decode tokens runs on the balanced schedule."""
        if num_tokens <= 0 or num_tokens > self.token_plan.shape[0]:
            return False
        return self.always or sparse_decode_schedule.balanced_pays(
            num_tokens, self.key_capacity, self.num_parts
        )

    def build(self, window_lens: torch.Tensor, extra_lens: torch.Tensor) -> DecodeSchedule:
        """The plan of tokens with ``window_lens + extra_lens`` keys (int32 ``[T]``, the tensors
        the kernel will read), written into the planner's buffers (on CUDA one Triton program;
        elsewhere the torch construction)."""
        T = window_lens.shape[0]
        out = DecodeSchedule(self.part_plan, self.token_plan[:T])
        method = "triton" if window_lens.is_cuda else "torch"
        return sparse_decode_schedule.plan_for_counts(
            window_lens,
            extra_lens,
            self.capacities,
            self.num_heads,
            method=method,
            num_parts=self.num_parts,
            out=out,
        )
