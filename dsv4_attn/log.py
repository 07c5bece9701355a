"""Loggers of this package, placed under vLLM's ``vllm`` logger.

vLLM configures one logger, ``vllm`` (its handler, format and level); loggers outside that tree
print nothing below WARNING in a vLLM process, and WARNINGs only through Python's bare last-resort
handler. :func:`get_logger` names this package's loggers ``vllm.dsv4_attn.*``, so in a vLLM
process they print as vLLM's own lines do; without vLLM's configuration they propagate to the
root logger as any other.
"""

from __future__ import annotations

import logging

__all__ = ["LOGGER_PREFIX", "get_logger"]

LOGGER_PREFIX = "vllm."


def get_logger(module_name: str) -> logging.Logger:
    """The logger of ``module_name`` (a ``dsv4_attn.*`` module's ``__name__``)."""
    return logging.getLogger(LOGGER_PREFIX + module_name)
