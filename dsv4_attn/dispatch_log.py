"""One log line per distinct reason an entry point fell back from its kernel to torch."""

from __future__ import annotations

import logging

__all__ = ["log_fallback_once", "logged_reasons"]

logged_reasons: set[tuple[str, str]] = set()  # (entry point, reason) already logged


def log_fallback_once(logger: logging.Logger, entry_point: str, reason: str) -> None:
    """Log ``reason`` at INFO on ``logger`` the first time it is seen for ``entry_point``."""
    if (entry_point, reason) not in logged_reasons:
        logged_reasons.add((entry_point, reason))
        logger.info("dsv4_attn: %s uses the SDPA fallback: %s", entry_point, reason)
