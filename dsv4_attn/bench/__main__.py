"""``python -m dsv4_attn.bench SUBCOMMAND [options]``."""

from dsv4_attn.bench import main

main()
