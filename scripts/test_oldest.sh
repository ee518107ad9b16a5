#!/usr/bin/env bash
# The tests of what differs between transformers releases (the cache argument, layer kinds, static and compiled
# caches, sliding layers, assisted decoding, the guard, continuous batching, a real model's generate), in
# .venv-oldest with the oldest transformers pyproject.toml accepts (its lower bound).
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST=$(python3 -c 'import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(next(re.fullmatch(r"transformers>=([0-9.]+)(,<[0-9.]+)?", d).group(1) for d in deps if d.startswith("transformers")))')
VENV=.venv-oldest TRANSFORMERS="transformers==$OLDEST.*" . scripts/setup.sh
python -c "import transformers; print('transformers', transformers.__version__)"
python -m pytest -q -n auto --dist loadscope tests/test_compat.py tests/test_cache.py tests/test_window.py \
  tests/test_static.py tests/test_sliding.py tests/test_compile.py tests/test_continuous_batching.py \
  tests/test_guard.py "tests/test_smollm2.py::test_greedy_with_both_spellings" "$@"
