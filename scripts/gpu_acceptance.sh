#!/usr/bin/env bash
# The first GPU anyone lends: the test suite on CUDA, then benchmarks/gpu_check.py, raw output under $1 (default
# benchmarks/results/gpu-acceptance-<date>-<gpu>/): environment.txt, tests.txt, gpu_check.txt. At most 12 minutes
# (6.5 for the tests, 5.5 for gpu_check; each is stopped at its limit, and what it printed is kept).
#
# It runs on the machine's own python3, torch, triton and transformers (a device machine reaches no registry:
# nothing is installed); hf_fp8kv is imported from this checkout. Tests that load the bundled models are skipped
# where their packages are missing (hundreds of MB, more than a device call carries), as are test files whose
# imports are missing (the serve extra, the notebook runner). Exit status: the tests'.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
gpu=$($PY -c "import torch; assert torch.cuda.is_available(); print(torch.cuda.get_device_name().replace(' ', '-'))") \
  || { echo "gpu_acceptance: no CUDA (or ROCm) GPU visible to $PY" >&2; exit 2; }
out=${1:-benchmarks/results/gpu-acceptance-$(date -u +%F)-$gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

# hf_fp8kv from this checkout without installing it: kernels/ is hf_fp8kv.kernels (pyproject's package-dir)
if [ ! -e hf_fp8kv/kernels ]; then
  ln -s ../kernels hf_fp8kv/kernels
  trap 'rm -f hf_fp8kv/kernels' EXIT
fi

{
  date -u
  git rev-parse HEAD 2>/dev/null || true
  nvidia-smi 2>/dev/null || rocm-smi 2>/dev/null || true
  $PY -c "import sys, torch, triton, transformers; print(sys.version); print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'hip', torch.version.hip); print('triton', triton.__version__, 'transformers', transformers.__version__); \
from hf_fp8kv.kernels.targets import device_target; from hf_fp8kv.kernels.ops import gpu_problem; \
d = torch.device('cuda'); print(device_target(d), 'Triton path' if not gpu_problem(d) else 'torch path')"
} >"$out/environment.txt" 2>&1
cat "$out/environment.txt"

# tests needing a bundled model whose package is missing are skipped, naming it (tests/conftest.py)
export HF_FP8KV_SKIP_MISSING_MODELS=1
parallel=()
$PY -c "import xdist" 2>/dev/null && parallel=(-n 8)  # the kernels' first compiles, 8 at a time

timeout 390 $PY -m pytest -q -p no:cacheprovider --continue-on-collection-errors "${parallel[@]}" 2>&1 | tee "$out/tests.txt"
tests_status=${PIPESTATUS[0]}
echo "exit status $tests_status" >>"$out/tests.txt"

timeout 330 $PY benchmarks/gpu_check.py --skip-tests --out "$out/gpu_check.txt" >"$out/gpu_check.log" 2>&1
echo "gpu_check exit status $?" | tee -a "$out/gpu_check.log"
exit "$tests_status"
