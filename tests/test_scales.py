"""Scale schemes in the cache: KVScales and paths as `scales=`, e4m3fnuz, ROCm, static per-channel key scales."""

import pickle
from types import SimpleNamespace

import pytest
import torch

from hf_fp8kv import KVScales, QuantizedFP8Cache, calibrate
from hf_fp8kv import continuous_batching as cb
from hf_fp8kv.kernels import targets
from hf_fp8kv.kernels.formats import get_format
from hf_fp8kv.compat import cache_kwargs
from tests.models import PURE_FP8, tiny_model

KV_HEADS, HEAD_DIM = 2, 16


def states(seed, tokens=12, magnitude=5.0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, KV_HEADS, tokens, HEAD_DIM, generator=generator) * magnitude


def test_kv_scales_object_and_its_file_serve_as_scales(tmp_path):
    scales = KVScales(key={0: torch.tensor([0.5]), 1: torch.tensor([0.25, 0.125])},
                      value={0: torch.tensor([2.0]), 1: torch.tensor([1.0, 3.0])})  # fmt: skip
    path = scales.save(tmp_path / "scales.safetensors")
    rows = QuantizedFP8Cache(tiny_model(), scales=scales).summary()
    assert [(r["k_scale"], r["v_scale"]) for r in rows] == [("0.5", "2"), ("[0.25, 0.125]", "[1, 3]")]
    for given in (str(path), path):  # the file declares strategy attn_head: layer 0's scale is stored per head
        rows = QuantizedFP8Cache(tiny_model(), scales=given).summary()
        assert [(r["k_scale"], r["v_scale"]) for r in rows] == [("[0.5, 0.5]", "[2, 2]"), ("[0.25, 0.125]", "[1, 3]")]
    assert rows[0]["source"] == f"calibration file {path}"
    with pytest.raises(ValueError, match="expected 'auto', 'dynamic'.*path of a scales file"):
        QuantizedFP8Cache(tiny_model(), scales="no/such/file.safetensors")


def test_fnuz_codes_decode_like_e4m3fn_with_doubled_scale():
    """The same bits mean half the value in e4m3fnuz: with the OCP scale doubled (as checkpoints are
    converted), both formats store the same bit patterns and decode to the same values."""
    model = tiny_model()
    keys, values = states(0), states(1)
    layers = {}
    for name in ("fp8_e4m3", "fp8_e4m3fnuz"):
        cache = QuantizedFP8Cache(model, kv_cache_dtype=name, scales=0.05, **PURE_FP8)  # |x| / 0.05 < 448 for these states
        cache.layers[0].update(keys, values)
        layers[name] = cache.layers[0]
    ocp, fnuz = layers["fp8_e4m3"], layers["fp8_e4m3fnuz"]
    assert fnuz.key_scale.flatten().tolist() == pytest.approx([0.1, 0.1]) and fnuz.fmt.max == 240
    for name in ("key_codes", "value_codes"):  # the stored tokens of buffers that hold a whole block
        bits = [getattr(layer, name)[:, :, : layer.length].view(torch.uint8) for layer in (ocp, fnuz)]
        assert torch.equal(*bits)
    for a, b in zip(ocp.dequantized(), fnuz.dequantized()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # and both are within the format's precision (3 mantissa bits: half an ulp is 2^-4 relative) of the input
    torch.testing.assert_close(fnuz.dequantized()[0], keys, rtol=2**-4, atol=0.05 * 2**-9)


def test_fnuz_checks_the_doubled_scales():
    """A finite scale whose double is not (2e38 -> inf) is refused naming the tensor and the adjustment, before a
    single step could give non-finite logits."""
    for scales in (2e38, {0: (1.0, 1.0), 1: (1.0, 2e38)}):
        with pytest.raises(ValueError, match=r"k_scale x2 \(fp8_e4m3fnuz doubles|layer 1 v_scale x2"):
            QuantizedFP8Cache(tiny_model(), kv_cache_dtype="fp8_e4m3fnuz", scales=scales)
    QuantizedFP8Cache(tiny_model(), kv_cache_dtype="fp8_e4m3", scales=2e38)  # fine where nothing is doubled


def test_rocm_picks_the_gpus_fp8_for_fp8(monkeypatch):
    """"fp8" on ROCm: e4m3fnuz on MI300 (gfx942) and where no GPU is visible, e4m3fn on MI355 (gfx950), as vLLM."""
    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    assert QuantizedFP8Cache(tiny_model(), scales="dynamic").fmt is get_format("fp8_e4m3fnuz")
    assert QuantizedFP8Cache(tiny_model(), kv_cache_dtype="fp8_e4m3", scales="dynamic").fmt.name == "fp8_e4m3"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for arch, fmt in (("gfx942", "fp8_e4m3fnuz"), ("gfx950", "fp8_e4m3")):
        props = SimpleNamespace(name=f"AMD {arch}", gcnArchName=f"{arch}:sramecc+:xnack-", multi_processor_count=256)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index, props=props: props)
        targets._read_target.cache_clear()
        assert QuantizedFP8Cache(tiny_model(), scales="dynamic").fmt.name == fmt, arch
    targets._read_target.cache_clear()
    monkeypatch.setattr(torch.version, "hip", None)
    assert QuantizedFP8Cache(tiny_model(), scales="dynamic").fmt.name == "fp8_e4m3"


def per_channel_scales(keys, channel):
    """Per-tensor K/V scales covering the states, with `channel` as the static per-channel key scale."""
    amax = keys.abs().amax() / 448
    return KVScales(key={i: amax.reshape(1) for i in range(2)}, value={i: amax.reshape(1) for i in range(2)},
                    key_channel={i: channel for i in range(2)})  # fmt: skip


def test_per_channel_key_scale_keeps_small_channels_precise():
    """KIVI-style keys: one outlier channel at ~400 and channels at ~0.001, which a per-tensor scale pushes
    into e4m3's subnormals; a per-channel scale keeps them at full relative precision."""
    keys = states(2, magnitude=0.001)
    keys[..., 0] = 400.0
    channel_amax = keys.abs().amax(dim=(0, 2))
    model = tiny_model()
    errors = {}
    for name, channel in (("tensor", torch.ones(KV_HEADS, HEAD_DIM)), ("channel", channel_amax / channel_amax.amax())):
        cache = QuantizedFP8Cache(model, scales=per_channel_scales(keys, channel), **PURE_FP8)
        cache.layers[0].update(keys, keys)
        stored, _ = cache.layers[0].dequantized()
        errors[name] = ((stored - keys)[..., 1:].abs() / keys[..., 1:].abs()).mean().item()
    assert errors["channel"] < 2**-4 < 0.1 < errors["tensor"]


def test_per_channel_key_scale_folds_into_the_query_exactly():
    """The FP8 attention (channel scale folded into the query) matches sdpa over the dequantized keys, and a
    cache with channel scales runs generate to the same tokens as without when the scales are all one."""
    model = tiny_model()
    channel = torch.linspace(0.05, 1.0, KV_HEADS * HEAD_DIM).reshape(KV_HEADS, HEAD_DIM)
    keys, values = states(3), states(4)
    cache = QuantizedFP8Cache(model, scales=per_channel_scales(keys, channel), **PURE_FP8)
    view, _ = cache.layers[0].update(keys, values)
    query = torch.randn(1, 4, 3, HEAD_DIM, generator=torch.Generator().manual_seed(5))
    out = view.attend(query, scaling=0.25)
    k, v = view.dequantized()
    reference = torch.nn.functional.scaled_dot_product_attention(
        query, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), scale=0.25,
        attn_mask=torch.ones(3, 12, dtype=torch.bool).tril(diagonal=9),
    )  # fmt: skip
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    assert cache.summary()[0]["granularity"] == "per-tensor + key channels"

    ids = torch.tensor([[5, 17, 42, 8, 99, 23]])
    ones = per_channel_scales(keys, torch.ones(KV_HEADS, HEAD_DIM))
    plain = KVScales(key=ones.key, value=ones.value)
    runs = [model.generate(ids, max_new_tokens=6, do_sample=False, **cache_kwargs(QuantizedFP8Cache(model, scales=s)))
            for s in (ones, plain)]  # fmt: skip
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize(
    "channel,match",
    [
        (torch.ones(3, HEAD_DIM), r"key channel scale has shape \(3, 16\): expected \[kv_heads=2"),
        (torch.ones(KV_HEADS, 8), r"key channel scales have shape \(2, 8\), keys have 2 KV heads x 16 channels"),
        (torch.zeros(KV_HEADS, HEAD_DIM), "key channel scale must be finite and > 0"),
    ],
)
def test_bad_channel_scales_are_refused(channel, match):
    with pytest.raises(ValueError, match=match):
        cache = QuantizedFP8Cache(tiny_model(), scales=per_channel_scales(torch.ones(1), channel))
        cache.layers[0].update(states(0), states(1))


def test_per_token_key_channels_even_out_int8_keys():
    """Per-token int8 keys with one channel at ~400 and the rest at ~1: the row's step (400 / 127) swamps the
    small channels; divided by per-channel key scales first (`KVScales(dynamic=True, key_channel=...)`), each
    channel keeps about int8's resolution of its own range."""
    keys = states(2, magnitude=1.0)
    keys[..., 0] = 400.0
    channel_amax = keys.abs().amax(dim=2)[0]  # [kv_heads, head_dim]
    errors = {}
    for name, scales in (("dynamic", "dynamic"), ("channels", KVScales(dynamic=True, key_channel={
            i: channel_amax / channel_amax.amax(-1, keepdim=True) for i in range(2)}))):  # fmt: skip
        cache = QuantizedFP8Cache(tiny_model(), kv_cache_dtype="int8_per_token_head", scales=scales, **PURE_FP8)
        cache.layers[0].update(keys, keys)
        stored, _ = cache.layers[0].dequantized()
        errors[name] = ((stored - keys)[..., 1:].abs().mean() / keys[..., 1:].abs().mean()).item()
    assert errors["channels"] < 0.02 < 0.3 < errors["dynamic"]


def test_int8_takes_per_token_scales_only():
    with pytest.raises(ValueError, match="kv_cache_dtype='int8_per_token_head' computes its scales per token and "
                                         "head: use scales='dynamic' \\(or calibrate"):  # fmt: skip
        QuantizedFP8Cache(tiny_model(), kv_cache_dtype="int8_per_token_head", scales=0.5)


def test_per_token_key_channels_for_unknown_layers_or_heads_are_refused():
    channel = torch.ones(KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match=r"key channel scales given for layers \[5\], but the model has layers 0..1"):
        QuantizedFP8Cache(tiny_model(), scales=KVScales(dynamic=True, key_channel={0: channel, 5: channel}))
    with pytest.raises(ValueError, match=r"layer 1 key channel scale has shape \(3, 16\)"):
        QuantizedFP8Cache(tiny_model(), scales=KVScales(dynamic=True, key_channel={1: torch.ones(3, HEAD_DIM)}))


@pytest.mark.parametrize("kv_cache_dtype", ["int8_per_token_head", "fp8_e4m3"])
def test_per_token_key_channels_on_every_path(kv_cache_dtype):
    """Per-token scales with per-channel key scales, a window of recent and sink tokens, a left-padded batch:
    the Triton backend (the interpreter) gives the torch path's logits, prefill and decode; generate gives the
    same tokens through the dynamic and the static cache, in fp32, bf16 and fp16."""
    generator = torch.Generator().manual_seed(7)
    channel = torch.rand(KV_HEADS, HEAD_DIM, generator=generator) * 0.9 + 0.1
    scales = KVScales(dynamic=True, key_channel={0: channel, 1: channel.flip(-1)})
    settings = dict(kv_cache_dtype=kv_cache_dtype, scales=scales, recent_tokens=3, sink_tokens=1)
    ids = torch.randint(3, 128, (2, 9), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        model = tiny_model().to(dtype)
        logits = {}
        for backend in ("torch", "triton"):
            cache = QuantizedFP8Cache(model, backend=backend, **settings)
            with torch.inference_mode():
                first = model(input_ids=ids, attention_mask=mask, **cache_kwargs(cache)).logits
                step = model(input_ids=ids[:, :1], attention_mask=torch.cat([mask, mask[:, :1]], 1),
                             **cache_kwargs(cache)).logits  # fmt: skip
            logits[backend] = (first.float(), step.float())
        tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)
        for got, want in zip(logits["triton"], logits["torch"]):
            torch.testing.assert_close(got, want, **tolerance)
        runs = [
            model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                           **cache_kwargs(QuantizedFP8Cache(model, **settings, **static)))
            for static in ({}, dict(max_cache_len=16, max_batch_size=2))
        ]  # fmt: skip
        assert torch.equal(runs[0], runs[1]), dtype


def test_per_channel_key_scale_on_the_triton_backend_matches_torch():
    """The same cache on the Triton kernels (the interpreter on CPU): prefill and one decode step."""
    model = tiny_model()
    scales = per_channel_scales(states(3), torch.linspace(0.05, 1.0, KV_HEADS * HEAD_DIM).reshape(KV_HEADS, HEAD_DIM))
    ids = torch.tensor([[5, 17, 42, 8, 99, 23]])
    logits = {}
    for backend in ("torch", "triton"):
        cache = QuantizedFP8Cache(model, scales=scales, backend=backend)
        with torch.inference_mode():
            logits[backend] = [model(input_ids=ids, **cache_kwargs(cache)).logits, model(input_ids=ids[:, :1], **cache_kwargs(cache)).logits]
    for torch_logits, triton_logits in zip(logits["torch"], logits["triton"]):
        torch.testing.assert_close(triton_logits, torch_logits, rtol=1e-5, atol=1e-5)


def uneven_keys(model):
    """`model` with its key channels spread over 2^0..2^-7 (each RoPE pair alike), as a real model's are."""
    head_dim = model.config.head_dim
    spread = 2.0 ** -(torch.arange(head_dim) % (head_dim // 2) % 8)
    with torch.no_grad():
        for layer in model.model.layers:
            weight = layer.self_attn.k_proj.weight
            weight *= spread.repeat(weight.shape[0] // head_dim)[:, None].to(weight.dtype)
    return model


def measured_settings(**overrides):
    return {**dict(kv_cache_dtype="int8_per_token_head", scales="dynamic_key_channels", recent_tokens=64,
                   sink_tokens=2), **overrides}  # fmt: skip


# (the Triton interpreter at two crossings: 13 s each)
@pytest.mark.parametrize("backend, dtype, model_type", [
    *(("torch", dtype, model_type) for dtype in (torch.float32, torch.bfloat16, torch.float16)
      for model_type in ("llama", "gemma3_text")),
    ("triton", torch.bfloat16, "llama"), ("triton", torch.float16, "gemma3_text"),
])  # fmt: skip
def test_measured_key_channels_are_calibrated_ones_over_the_keys_held_at_the_first_code(backend, dtype, model_type):
    """`scales="dynamic_key_channels"`: until a token is coded the layer holds its keys as they came; the update
    that codes the first (here the second decode step after a 63-token prefill, 65 tokens seen) sets the channel
    scales `calibrate(strategy="token", key_channels=True)` gives over those 65 tokens, and from then on the cache is
    that calibrated cache, logits equal at every step (powers of two: the held keys divided are the same bits),
    a sliding layer too. (One layer: a second's keys would follow the first's attention, not sdpa's to the bit.)"""
    extra = dict(sliding_window=48, layer_types=["sliding_attention"]) if model_type != "llama" else {}
    model = uneven_keys(tiny_model(model_type, num_hidden_layers=1, **extra)).to(dtype)
    ids = torch.randint(3, 128, (1, 67), generator=torch.Generator().manual_seed(3))
    calibrated = calibrate(model, [ids[:, :65]], strategy="token", key_channels=True, progress=False)
    caches = {name: QuantizedFP8Cache(model, backend=backend, **measured_settings(**scales))
              for name, scales in (("measured", {}), ("calibrated", dict(scales=calibrated)))}  # fmt: skip
    logits = {}
    for name, cache in caches.items():
        with torch.inference_mode():
            steps = [model(input_ids=ids[:, :63], **cache_kwargs(cache)).logits[:, -1]]
            for t in range(63, 67):
                steps.append(model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache)).logits[:, -1])
                if name == "measured":
                    measured = [layer.key_channel_scale is not None for layer in cache.layers]
                    assert measured == [t >= 64], t
                    shown = "per token x measured channel" if t >= 64 else "per token x channel (not measured yet)"
                    assert cache.summary()[0]["k_scale"] == shown, t
        logits[name] = torch.stack(steps)
    for i, layer in enumerate(caches["measured"].layers):
        assert torch.equal(layer.key_channel_scale, calibrated.key_channel[i]), i
        assert int(layer.stats[:, 1].sum()) == 0
    assert not torch.equal(calibrated.key_channel[0], torch.ones_like(calibrated.key_channel[0]))
    assert torch.equal(logits["measured"], logits["calibrated"])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_measured_key_channels_under_searched_scales_and_outlier_tokens_are_the_calibrated_ones(backend):
    """The queries' energy a scale search (of e4m3 scales) gathered before the channels were measured is carried
    into their space (times c^2, exact for powers of two): searched scales and outlier tokens then follow as with
    calibrated channels, logits equal at every step."""
    model = uneven_keys(tiny_model(num_hidden_layers=1))
    ids = torch.randint(3, 128, (1, 70), generator=torch.Generator().manual_seed(4))
    calibrated = calibrate(model, [ids[:, :65]], strategy="token", key_channels=True, progress=False)
    logits = {}
    for name, scales in (("measured", {}), ("calibrated", dict(scales=calibrated))):
        settings = measured_settings(kv_cache_dtype="fp8_e4m3", scale_search=4, outlier_tokens=2, **scales)
        cache = QuantizedFP8Cache(model, backend=backend, **settings)
        with torch.inference_mode():
            steps = [model(input_ids=ids[:, :63], **cache_kwargs(cache)).logits[:, -1]]
            steps += [model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache)).logits[:, -1] for t in range(63, 67)]
        logits[name] = torch.stack(steps)
    assert torch.equal(cache.layers[0].key_channel_scale, calibrated.key_channel[0])
    assert torch.equal(logits["measured"], logits["calibrated"])


def test_measured_key_channels_in_generate_through_padding_beams_and_reset():
    """A left-padded batch (padding's keys are measured too: they are keys the layer holds), beam search: the
    Triton backend gives the torch path's tokens. Then the cache reset and reused for another prompt, which it
    measures anew; a prompt longer than the recent tokens is measured at its prefill."""
    model = uneven_keys(tiny_model())
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 128, (2, 70), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :9] = 0
    caches = {name: QuantizedFP8Cache(model, backend=name, **measured_settings()) for name in ("torch", "triton")}
    out = {backend: model.generate(ids, attention_mask=mask, max_new_tokens=4, num_beams=2, do_sample=False,
                                   **cache_kwargs(cache)) for backend, cache in caches.items()}  # fmt: skip
    assert torch.equal(out["torch"], out["triton"])
    cache = caches["torch"]
    first = [layer.key_channel_scale.clone() for layer in cache.layers]
    cache.reset()
    assert all(layer.key_channel_scale is None for layer in cache.layers)
    other = (torch.arange(80) % 125 + 3)[None]
    again = model.generate(other, max_new_tokens=3, do_sample=False, **cache_kwargs(cache))
    expected = calibrate(model, [other], strategy="token", key_channels=True, progress=False)
    assert all(torch.equal(layer.key_channel_scale, expected.key_channel[i]) for i, layer in enumerate(cache.layers))
    assert not torch.equal(first[0], expected.key_channel[0])
    assert again.shape == (1, 83)


def test_measured_key_channels_under_fp8_prefill_measured_by_a_continuation():
    """`fp8_prefill=True` (the prefill's dots on e4m3 operands, the Triton backend): a 40-token prompt codes
    nothing; its 40-token continuation codes the first tokens, so that update measures the channels over all 80
    keys, then its attention runs FP8 dots over the codes. The logits of both chunks and the decode steps after
    are a cache calibrated on those 80 tokens', bit for bit."""
    model = uneven_keys(tiny_model(num_hidden_layers=1)).half()
    ids = torch.randint(3, 128, (1, 83), generator=torch.Generator().manual_seed(7))
    calibrated = calibrate(model, [ids[:, :80]], strategy="token", key_channels=True, progress=False)
    logits = {}
    for name, scales in (("measured", {}), ("calibrated", dict(scales=calibrated))):
        settings = measured_settings(kv_cache_dtype="fp8_e4m3", fp8_prefill=True, **scales)
        cache = QuantizedFP8Cache(model, backend="triton", **settings)
        with torch.inference_mode():
            steps = [model(input_ids=ids[:, :40], **cache_kwargs(cache)).logits[0]]
            assert (cache.layers[0].key_channel_scale is None) == (name == "measured")
            steps.append(model(input_ids=ids[:, 40:80], **cache_kwargs(cache)).logits[0])
            steps += [model(input_ids=ids[:, t : t + 1], **cache_kwargs(cache)).logits[0] for t in range(80, 83)]
        assert cache.layers[0].kernels.fp8_prefill and int(cache.layers[0].stats[:, 1].sum()) == 0
        logits[name] = torch.cat(steps)
    assert torch.equal(cache.layers[0].key_channel_scale, calibrated.key_channel[0])
    assert torch.equal(logits["measured"], logits["calibrated"])


def test_a_cache_pickled_or_cropped_before_its_channels_are_measured_measures_them_as_a_fresh_one():
    """Pickled while its keys are still held as they came, a cache measures the same channels when it codes its
    first token, and gives the same logits. Cropped then (the slots of the tokens cropped poisoned), and given other
    tokens whose update codes the first, it measures the tokens it holds, not the slots: as a fresh cache given the
    same tokens."""
    model = uneven_keys(tiny_model())
    generator = torch.Generator().manual_seed(6)
    ids, other = (torch.randint(3, 128, (1, tokens), generator=generator) for tokens in (70, 30))

    def run(cache, prompts):
        with torch.inference_mode():
            for prompt in prompts:
                if prompt is None:
                    cache.crop(-10)
                    for layer in cache.layers:
                        layer.recent[:, :, :, 40:50] = 1e4
                else:
                    model(input_ids=prompt, **cache_kwargs(cache))
            copy = pickle.loads(pickle.dumps(cache))
            steps = [torch.stack([model(input_ids=ids[:, t : t + 1], **cache_kwargs(c)).logits[:, -1]
                                  for t in range(50, 70)]) for c in (cache, copy)]  # fmt: skip
        return steps, [[layer.key_channel_scale for layer in c.layers] for c in (cache, copy)]

    (original, copied), (channels, copied_channels) = run(QuantizedFP8Cache(model, **measured_settings()),
                                                          [ids[:, :50]])  # fmt: skip
    assert torch.equal(original, copied)
    assert all(torch.equal(a, b) for a, b in zip(channels, copied_channels, strict=True))
    prompts = {"cropped": [ids[:, :50], None, other], "fresh": [ids[:, :40], other]}
    runs = {name: run(QuantizedFP8Cache(model, **measured_settings()), chunks) for name, chunks in prompts.items()}
    torch.testing.assert_close(runs["cropped"][0][0], runs["fresh"][0][0], rtol=1e-5, atol=1e-5)
    assert all(channel is not None for channel in runs["cropped"][1][0])
    assert torch.equal(runs["cropped"][1][0][0], runs["fresh"][1][0][0])  # (layer 0: its keys follow the ids alone)
    assert not torch.equal(runs["cropped"][0][0], original)


def test_measured_key_channels_are_refused_where_they_cannot_be_measured_or_would_be_poor():
    model = tiny_model()
    with pytest.raises(ValueError, match="static cache's compiled step cannot"):
        QuantizedFP8Cache(model, **measured_settings(max_cache_len=32))
    with pytest.raises(ValueError, match="rotate=True"):
        QuantizedFP8Cache(model, **measured_settings(rotate=True))
    with pytest.raises(ValueError, match=r"recent_tokens=32: .* at least 64"):
        QuantizedFP8Cache(model, **measured_settings(recent_tokens=32))
    with pytest.raises(ValueError, match="pages' key channel scales are shared by every request"):
        cb.enable(model, **measured_settings())
    cb.disable(model)
