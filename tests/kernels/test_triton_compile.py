"""The Triton kernels compile for a Hopper GPU (sm_90) without one: catches what the interpreter never sees
(constexpr specialization, layouts, unsupported conversions). Run as a script, it compiles and exits."""

import os
import subprocess
import sys

import pytest

TARGET = ("cuda", 90, 32)


def compile_kernels() -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hf_fp8kv.kernels.formats import FORMATS
    from hf_fp8kv.kernels.triton_attention import _attention_kernel, _reduce_kernel
    from hf_fp8kv.kernels.triton_write import _write_kernel, encoding

    def build(kernel, pointers: dict, floats: tuple, constexprs: dict, **options) -> None:
        names = kernel.arg_names
        signature = {
            name: "constexpr" if name in constexprs else pointers.get(name, "fp32" if name in floats else "i32")
            for name in names
        }
        source = ASTSource(kernel, signature, {(names.index(k),): v for k, v in constexprs.items()})
        triton.compile(source, target=GPUTarget(*TARGET), options=options)

    fmt = FORMATS["fp8_e4m3"]
    build(
        _write_kernel,
        dict(key_ptr="*bf16", value_ptr="*bf16", key_codes_ptr="*u8", value_codes_ptr="*u8", key_scale_ptr="*fp32",
             value_scale_ptr="*fp32", clipped_ptr="*i64"),
        (),
        dict(DYNAMIC=True, CLIP=fmt.clip_bound, BLOCK_T=32, BLOCK_D=128, k_sd=1, **encoding(fmt)),
    )  # fmt: skip
    pointers = dict(q_ptr="*bf16", k_ptr="*i8", v_ptr="*i8", k_scale_ptr="*fp32", v_scale_ptr="*fp32",
                    mask_ptr="*u8", sinks_ptr="*bf16", channel_ptr="*fp32", out_ptr="*bf16", part_acc_ptr="*fp32",
                    part_stats_ptr="*fp32")  # fmt: skip
    every_option = dict(HAS_MASK=True, HAS_WINDOW=True, HAS_SOFTCAP=True, HAS_SINKS=True, HAS_CHANNEL_SCALE=True)
    build(
        _attention_kernel,
        pointers,
        ("score_scale", "value_boost", "out_factor", "softcap"),
        dict(GROUP=8, BLOCK_M=16, BLOCK_N=64, BLOCK_D=128, IS_FLOAT=True, FP16_SHIFT=7, PER_TOKEN_K=True,
             PER_TOKEN_V=True, SPLIT=True, PRECISION="tf32", **every_option),
        num_warps=8, num_stages=2,
    )  # fmt: skip
    build(
        _reduce_kernel,
        dict(part_acc_ptr="*fp32", part_stats_ptr="*fp32", v_scale_ptr="*fp32", sinks_ptr="*bf16", out_ptr="*bf16"),
        ("out_factor",),
        dict(GROUP=8, BLOCK_R=1, BLOCK_S=32, BLOCK_D=128, PER_TOKEN_V=False, HAS_SINKS=True),
    )


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    if "ptxas" in result.stderr and "not found" in result.stderr:
        pytest.skip("no ptxas in this Triton install")
    assert result.returncode == 0, result.stderr[-3000:]


if __name__ == "__main__":
    compile_kernels()
