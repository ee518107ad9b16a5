#!/usr/bin/env bash
# The tests of what differs between transformers releases (the cache argument, layer kinds, static and compiled
# caches, sliding layers, assisted decoding, the guard, continuous batching, a real model's generate, the kernels/
# directory beside Hugging Face's `kernels`), on the oldest or the newest transformers pyproject.toml accepts:
#     bash scripts/test_release.sh oldest    # in .venv-oldest, its lower bound
#     bash scripts/test_release.sh newest    # in .venv-newest, the release below its cap, without the serve extra
# (`hf-fp8kv serve` runs transformers serve as of 5.24, which the serve extra pins; test.sh's .venv has it).
set -euo pipefail
cd "$(dirname "$0")/.."
WHICH="${1:?which release: oldest or newest}"
shift
RELEASE=$(python3 - "$WHICH" <<'PY'
import re, sys, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
spec = next(d for d in deps if d.startswith("transformers"))
oldest, major, cap = re.fullmatch(r"transformers>=([0-9.]+),<([0-9]+)\.([0-9]+)", spec).groups()
print({"oldest": oldest, "newest": f"{major}.{int(cap) - 1}"}[sys.argv[1]])
PY
)
EXTRAS=$([ "$WHICH" = newest ] && echo test || echo test,serve)
VENV=".venv-$WHICH" TRANSFORMERS="transformers==$RELEASE.*" EXTRAS="$EXTRAS" . scripts/setup.sh
python -c "import transformers; print('transformers', transformers.__version__)"
python -m pytest -q -n auto --dist loadscope tests/test_compat.py tests/test_cache.py tests/test_window.py \
  tests/test_static.py tests/test_sliding.py tests/test_compile.py tests/test_continuous_batching.py \
  tests/test_guard.py tests/kernels/test_boundary.py "tests/test_smollm2.py::test_greedy_with_both_spellings" "$@"
