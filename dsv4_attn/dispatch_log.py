"""One WARNING per distinct reason an entry point fell back from its kernel to torch: the
fallback is one to two orders of magnitude slower, so a server must say so where its operator
looks (the package logs under vLLM's ``vllm`` logger: :mod:`dsv4_attn.log`)."""

from __future__ import annotations

import logging

__all__ = ["log_fallback_once", "logged_reasons"]

logged_reasons: set[tuple[str, str]] = set()  # (entry point, reason) already logged


def log_fallback_once(logger: logging.Logger, entry_point: str, reason: str) -> None:
    """Log ``reason`` at WARNING on ``logger`` the first time it is seen for ``entry_point``."""
    if (entry_point, reason) not in logged_reasons:
        logged_reasons.add((entry_point, reason))
        logger.warning("dsv4_attn: %s uses the SDPA fallback: %s", entry_point, reason)
