"""Compiled decode with the static FP8 cache (`max_cache_len`), on the CPU path (inductor): `torch.compile`
by hand and generate's own compilation give no graph break, no recompilation per token, and the tokens of the
eager static cache."""

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig

from hf_fp8kv import QuantizedFP8Cache
from hf_fp8kv.compat import cache_kwargs
from hf_fp8kv.kernels import ops
from tests.models import tiny_model

STEPS = 24
WINDOW = dict(recent_tokens=4, sink_tokens=2)


def model_of(model_type: str):
    if model_type == "gemma3_text":  # one sliding (a ring of 8 slots, wrapped) and one full layer
        return tiny_model(model_type, num_hidden_layers=2, sliding_window=8,
                          layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    return tiny_model(model_type, num_hidden_layers=1)


def decode(model, forward, prompt: torch.Tensor, steps: int = STEPS, scales: list | None = None,
           **settings) -> list[int]:
    """Eager prefill, then `steps` greedy steps through `forward` (`settings`: the cache's, besides WINDOW);
    `scales`: given the layers' scale buffers at the end."""
    cache = QuantizedFP8Cache(model, scales="dynamic", max_cache_len=48, **{**WINDOW, **settings})
    tokens = []
    with torch.no_grad():
        out = model(input_ids=prompt, **cache_kwargs(cache))
        position = prompt.shape[1]
        for _ in range(steps):
            token = out.logits[:, -1:].argmax(-1)
            tokens.append(int(token))
            out = forward(input_ids=token, **cache_kwargs(cache), position_ids=torch.tensor([[position]]))
            position += 1
    if scales is not None:
        scales.extend(layer.scale for layer in cache.layers)
    return tokens


SEARCH = dict(scale_search=16, backend="torch")


@pytest.mark.parametrize("model_type, settings", [("llama", {}), ("gemma3_text", {}),
                                                   ("gemma3_text", dict(outlier_tokens=3)), ("llama", SEARCH)],
                         ids=str)  # fmt: skip
def test_compiled_forward_by_hand(model_type, settings):
    """With outlier tokens too: their selection is device tensor ops the graph holds (no host sync); and with
    searched scales: the search and the queries' sums too. The scales written are the eager ones, bit for bit."""
    torch._dynamo.reset()
    model = model_of(model_type)
    prompt = torch.tensor([[5, 17, 42, 8, 99, 3, 64, 11, 23, 7]])
    eager_scales, compiled_scales = [], []
    eager = decode(model, model.forward, prompt, scales=eager_scales, **settings)
    counters.clear()
    compiled = decode(model, torch.compile(model.forward, fullgraph=True), prompt, scales=compiled_scales, **settings)
    assert compiled == eager
    assert all(torch.equal(a, b) for a, b in zip(compiled_scales, eager_scales))
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] <= 2  # no recompilation per token


@pytest.fixture(scope="module")
def opaque_triton_ops():
    """`ops.triton_ops()` behind opaque ops whose fake version only allocates the output, and the calls they run
    (each attention's: whether it wrote the step's token). Dynamo runs a graph's ops on fake tensors, which the
    Triton interpreter cannot do (on a GPU, `wrap_triton` traces the kernels themselves): so on the CPU the graph
    is traced around the registered ops, and `aot_eager` runs them."""
    real, calls = ops.triton_ops(), []
    library = torch.library.Library("hf_fp8kv_cpu", "DEF")
    for name in ("write", "write_settle", "attend"):
        library.define(str(getattr(real, name).default._schema).split("::", 1)[1])

        def run(*args, name=name):
            calls.append(args[14] is not None if name == "attend" else name)  # (attend's 15th: the new key)
            return getattr(real, name)(*args)

        library.impl(name, run, "CPU")
        if name != "attend":
            torch.library.register_fake(f"hf_fp8kv_cpu::{name}", lambda *args: None, lib=library)
    # (the real output's layout: [batch, q_len, heads, head_dim] memory)
    torch.library.register_fake("hf_fp8kv_cpu::attend", lambda query, *args: torch.empty_like(query.transpose(1, 2),
                                memory_format=torch.contiguous_format).transpose(1, 2), lib=library)  # fmt: skip
    yield torch.ops.hf_fp8kv_cpu, calls
    library._destroy()


@pytest.mark.parametrize("model_type, settings, step_calls", [
    ("llama", {}, [True]),  # the attention op writes the step's token
    ("gemma3_text", {}, [True, True]),  # a sliding layer's ring, a full layer
    ("gemma3_text", dict(outlier_tokens=3), ["write_settle", False] * 2),  # the write judges the outlier tokens
    ("gemma3_text", dict(rotate=True, sink_tokens=0), ["write", False] * 2),  # rotated codes: a write op of its own
])  # fmt: skip
def test_compiled_static_decode_on_the_triton_path(opaque_triton_ops, monkeypatch, model_type, settings, step_calls):
    """The Triton path's compiled decode step (the registered ops in one graph, no break) decodes the eager static
    cache's tokens, with the eager step's launches: each step's token written by its attention op where the eager
    step writes it in the attention launch, else by a write op (which judges the outlier tokens too)."""
    namespace, calls = opaque_triton_ops
    monkeypatch.setattr(ops, "triton_ops", lambda: namespace)  # (the layers' kernels take it when made)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    torch._dynamo.reset()
    model = model_of(model_type)
    prompt = torch.tensor([[5, 17, 42, 8, 99, 3, 64, 11, 23, 7]])
    steps = 6  # (the interpreter's steps: past the recent tokens, every layer's ring wrapped by the prompt)
    eager = decode(model, model.forward, prompt, steps, backend="triton", **settings)
    counters.clear()
    calls.clear()
    compiled = decode(model, torch.compile(model.forward, fullgraph=True, backend="aot_eager"), prompt, steps,
                      backend="triton", **settings)  # fmt: skip
    assert compiled == eager
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1
    assert calls == step_calls * steps


def test_generate_compiles_the_decode_step_itself():
    torch._dynamo.reset()
    model = model_of("llama")
    prompt = torch.tensor([[5, 17, 42, 8, 99, 3, 64, 11, 23, 7]])

    def generate(**kwargs):
        cache = QuantizedFP8Cache(model, scales="dynamic", max_cache_len=40, **WINDOW)
        return model.generate(input_ids=prompt, max_new_tokens=STEPS, do_sample=False, **cache_kwargs(cache), **kwargs)

    eager = generate(disable_compile=True)
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True  # generate compiles on CUDA by itself; on the CPU only when asked
    counters.clear()
    compiled = generate(compile_config=config)
    assert torch.equal(compiled, eager)
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]  # it did compile, whole


def test_prompt_longer_than_the_static_cache_is_refused_before_the_model_runs():
    model = model_of("llama")
    cache = QuantizedFP8Cache(model, max_cache_len=8)
    with pytest.raises(ValueError, match="max_cache_len=8"):
        model.generate(input_ids=torch.arange(3, 13)[None], max_new_tokens=2, **cache_kwargs(cache))
    assert cache.get_seq_length() == 0


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_eager_turn_after_compiled_steps(model_type):
    """Compiled steps move the positions on the device only; the next eager update (a chat turn) reads them back,
    so it sees what it would after eager steps: sinks of a prompt shorter than them, a sliding ring's copy."""
    torch._dynamo.reset()
    model = model_of(model_type)
    turn = torch.tensor([[7, 31, 12, 55, 90]])

    def run(forward) -> torch.Tensor:
        cache = QuantizedFP8Cache(model, scales="dynamic", max_cache_len=48, **WINDOW)
        with torch.no_grad():
            out = model(input_ids=torch.tensor([[5]]), **cache_kwargs(cache))  # fewer tokens than the sinks
            for position in range(1, STEPS // 2):  # past the ring of 8
                token = out.logits[:, -1:].argmax(-1)
                out = forward(input_ids=token, **cache_kwargs(cache), position_ids=torch.tensor([[position]]))
            positions = torch.arange(STEPS // 2, STEPS // 2 + turn.shape[1])[None]
            return model(input_ids=turn, **cache_kwargs(cache), position_ids=positions).logits

    # inductor's own drift on these logits (max 0.5) is ~1e-3; stale positions gave 0.04 (llama), 0.37 (gemma3)
    eager = run(model.forward)
    torch.testing.assert_close(run(torch.compile(model.forward, fullgraph=True)), eager, atol=5e-3, rtol=0)


def test_compiled_forward_with_the_dynamic_cache():
    """`torch.compile(model.forward)` over the dynamic cache decodes the eager tokens: its update and attention run
    eagerly (Python positions cannot be traced: a graph break each), the model's other ops compiled where dynamo
    keeps them (the static cache is the compiled path: one graph, no break)."""
    torch._dynamo.reset()
    model = model_of("llama")
    prompt = torch.tensor([[5, 17, 42, 8, 99, 3, 64, 11, 23, 7]])

    def run(forward) -> list[int]:
        cache = QuantizedFP8Cache(model, scales="dynamic", recent_tokens=4, sink_tokens=2)
        tokens = []
        with torch.no_grad():
            out = forward(input_ids=prompt, **cache_kwargs(cache))
            for _ in range(12):  # past the recent tokens
                token = out.logits[:, -1:].argmax(-1)
                tokens.append(int(token))
                out = forward(input_ids=token, **cache_kwargs(cache))
        return tokens

    counters.clear()
    try:
        assert run(torch.compile(model.forward)) == run(model.forward)
        assert counters["stats"]["unique_graphs"] >= 1 and counters["graph_break"]  # compiled, broken at the cache
    finally:
        torch._dynamo.reset()  # its recompiles of transformers' shared decorator code must not reach other tests
