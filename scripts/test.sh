#!/usr/bin/env bash
# Installs everything into .venv, then runs the whole test suite on the CPU (Triton kernels under TRITON_INTERPRET=1).
set -euo pipefail
. "$(dirname "$0")/setup.sh"
# one worker per core (tests/conftest.py shares the cores out to torch's threads); a module's tests stay on one
# worker, so its fixtures (a bundled model's reference runs) are built once. The served model's tests
# (tests/serving) then run alone: beside another worker, one of them once found no request scheduled in 60 s
# (one full run in five; alone, never so far)
if [ $# -eq 0 ]; then
  python -m pytest -q -n auto --dist loadscope --ignore=tests/serving
  python -m pytest -q tests/serving
else
  python -m pytest -q -n auto --dist loadscope "$@"
fi
