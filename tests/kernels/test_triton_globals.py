"""Every Triton function reads module-level numbers only as `tl.constexpr`: the interpreter the tests run under
reads a plain Python number, the CUDA compiler refuses it (the paged row writer's per-token scale floor did not
compile for CUDA until this test)."""

import importlib
import inspect

import pytest
import triton.language as tl

MODULES = ["triton_common", "triton_attention", "triton_write", "triton_paged", "triton_outliers", "triton_search"]


@pytest.mark.parametrize("module", MODULES)
def test_kernels_read_no_plain_python_numbers(module):
    mod = importlib.import_module(f"hf_fp8kv.kernels.{module}")
    # (`triton.jit` functions, or the interpreter's wrappers of them: each keeps the Python function as `fn`)
    functions = {name: obj for name, obj in vars(mod).items() if inspect.isfunction(getattr(obj, "fn", None))}
    assert functions
    plain = [
        f"{name} reads {global_name} = {value!r}"
        for name, function in functions.items()
        for global_name in function.fn.__code__.co_names
        if isinstance(value := function.fn.__globals__.get(global_name), (bool, int, float))
        and not isinstance(value, tl.constexpr)
    ]
    assert not plain, plain
