import os

import pytest
import torch

# The Triton kernels run on the CPU interpreter when no GPU is present; the flag must be set before
# any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# HF_FP8KV_SKIP_MISSING_MODELS=1 (scripts/gpu_acceptance.sh, on a machine the bundled models' packages cannot reach):
# a test that needs one of them is skipped, naming it; everywhere else it fails
@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _skip_missing_models())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _skip_missing_models())


def _skip_missing_models():
    from hf_fp8kv.bundled import BundledModelMissing

    try:
        return (yield)
    except BundledModelMissing as missing:
        if os.environ.get("HF_FP8KV_SKIP_MISSING_MODELS") == "1":
            pytest.skip(str(missing))
        raise
