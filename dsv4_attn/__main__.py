"""Command line: ``python -m dsv4_attn <command>`` (also installed as ``dsv4-attn``).

Commands:
    demo    greedy-decode a tiny DeepSeek-V4 through this backend and compare with transformers'
            own attention (runs on CPU or GPU, downloads nothing)

Each command lives in its own module and contributes ``add_arguments(parser)`` and
``run(args)``; add a command by adding an entry to :data:`COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

__all__ = ["COMMANDS", "build_parser", "main"]

# name -> (module with add_arguments/run, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": (
        "dsv4_attn.e2e.demo",
        "greedy-decode a tiny DeepSeek-V4 through this backend vs transformers' attention",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dsv4-attn", description="DSV4_NVFP4 attention backend for DeepSeek-V4 in vLLM"
    )
    sub = parser.add_subparsers(dest="command", metavar="command")
    sub.required = True
    for name, (module_name, help_text) in COMMANDS.items():
        command = sub.add_parser(name, help=help_text, description=help_text)
        # Importing a command module only defines functions (torch loads, vLLM does not).
        importlib.import_module(module_name).add_arguments(command)
        command.set_defaults(_module=module_name)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = importlib.import_module(args._module).run(args)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
