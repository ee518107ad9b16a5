#!/usr/bin/env bash
# Installs everything into .venv, then runs the whole test suite on the CPU (Triton kernels under TRITON_INTERPRET=1).
set -euo pipefail
. "$(dirname "$0")/setup.sh"
python -m pytest -q "$@"
