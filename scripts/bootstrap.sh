#!/usr/bin/env bash
# Creates ./.venv with everything the demo, the benchmarks' CPU parts and the tests need, on a
# CPU-only Linux machine with Python 3.11+. Idempotent: a second run with unchanged requirements
# returns at once.
#
# vllm 0.33.0 is installed with --no-deps, then its requirements from requirements/vllm-cpu.txt:
# a plain `pip install vllm==0.33.0` pins torch==2.14.0 (CUDA) and, on package indexes without
# certifi>=2026.10.19, does not resolve at all. On a GPU serving machine use `pip install dsv4-attn`.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
stamp=.venv/.bootstrap-$(cat pyproject.toml requirements/*.txt scripts/bootstrap.sh | sha1sum | cut -c1-12)
[ -f "$stamp" ] && exit 0

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
pip=(.venv/bin/python -m pip -q --disable-pip-version-check)
"${pip[@]}" install --upgrade pip
"${pip[@]}" install torch==2.13.0          # CPU build (a local wheel on the dev/CI machines)
"${pip[@]}" install --no-deps vllm==0.33.0
"${pip[@]}" install -r requirements/vllm-cpu.txt
"${pip[@]}" install --no-deps xgrammar==0.2.8   # vllm's pin; its own triton pin is relaxed below
"${pip[@]}" install -r requirements/dev.txt
"${pip[@]}" install --no-deps -e .
rm -f .venv/.bootstrap-* && touch "$stamp"
echo "bootstrap: .venv ready ($(.venv/bin/python -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)'))"
