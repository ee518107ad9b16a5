import gc
import os

import pytest
import torch

# The Triton kernels run on the CPU interpreter when no GPU is present; the flag must be set before
# any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    from tests import fast_interpreter

    fast_interpreter.install()

# Under pytest-xdist (scripts/test.sh: -n auto) each worker gets its share of the cores for torch's threads, and so
# do the processes it starts (a notebook's kernel, a script's pytest): the workers do not oversubscribe the cores.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


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


# Everything imported by now (torch, transformers, triton: some 360k objects) is left out of garbage collection:
# transformers' continuous batching runs gc.collect() twice per generate_batch, 0.22 s each over that heap and
# ~0 after the freeze (tests/test_continuous_batching.py on one core: 248 -> 203 s). Unfrozen at the end, so
# that the interpreter's shutdown frees them as usual (else nanobind reports Triton's IR objects as leaked).
def pytest_collection_finish(session):
    gc.freeze()


def pytest_unconfigure(config):
    gc.unfreeze()
