#!/usr/bin/env bash
# Installs everything into .venv, then runs the whole test suite on the CPU (Triton kernels under TRITON_INTERPRET=1).
set -euo pipefail
. "$(dirname "$0")/setup.sh"
# one worker per core (tests/conftest.py shares the cores out to torch's threads); a module's tests stay on one
# worker, so its fixtures (a bundled model's reference runs) are built once
python -m pytest -q -n auto --dist loadscope "$@"
