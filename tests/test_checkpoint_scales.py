"""Checkpoint scales in every convention: hand-built directories of a tiny random Llama (2 layers, 2 KV heads)."""

import json
import shutil
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from hf_fp8kv import KVScales, QuantizedFP8Cache, UncalibratedScalesWarning
from hf_fp8kv.checkpoint import SCALES_FILE
from hf_fp8kv.compat import cache_kwargs
from tests.models import tiny_model

ATTN = "model.layers.{}.self_attn"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny model saved once as a single file and once sharded."""
    model = tiny_model()
    single, sharded = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("sharded")
    model.save_pretrained(single)
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    return {"single": single, "sharded": sharded}


def checkpoint(saved, tmp_path, tensors=(), sharded=False, config=None, files=None):
    """A copy of the saved model with `tensors` ({name: tensor}) added to its weights, `config` merged into
    config.json and extra `files` ({name: json content}) written beside them."""
    directory = tmp_path / "ckpt"
    shutil.copytree(saved["sharded" if sharded else "single"], directory)
    tensors = dict(tensors)
    if tensors:
        if sharded:
            index = json.loads((directory / "model.safetensors.index.json").read_text())
            shard = sorted(set(index["weight_map"].values()))[-1]
            index["weight_map"].update({name: shard for name in tensors})
            (directory / "model.safetensors.index.json").write_text(json.dumps(index))
        else:
            shard = "model.safetensors"
        weights = load_file(directory / shard)
        save_file({**weights, **tensors}, directory / shard, metadata={"format": "pt"})
    if config:
        merged = {**json.loads((directory / "config.json").read_text()), **config}
        (directory / "config.json").write_text(json.dumps(merged))
    for name, content in (files or {}).items():
        (directory / name).write_text(json.dumps(content))
    return directory


def cache_for(directory, **kwargs):
    return QuantizedFP8Cache(config=AutoConfig.from_pretrained(directory), **kwargs)


def scale(value, shape=(1,), dtype=torch.bfloat16):
    return torch.full(shape, value, dtype=dtype) if shape else torch.tensor(value, dtype=dtype)


def both_layers(k_suffix, v_suffix, k, v):
    tensors = {}
    for i in range(2):
        tensors[f"{ATTN.format(i)}.{k_suffix}"] = k.clone()
        if v_suffix:
            tensors[f"{ATTN.format(i)}.{v_suffix}"] = v.clone()
    return tensors


@pytest.mark.parametrize(
    "k_suffix,v_suffix,shape,dtype,expected_k,expected_v,source",
    [
        ("k_scale", "v_scale", (1,), torch.bfloat16, "0.125", "0.25", "self_attn.k_scale + v_scale"),
        ("k_scale", "v_scale", (), torch.float16, "0.125", "0.25", "self_attn.k_scale + v_scale"),
        ("k_scale", "v_scale", (2,), torch.float32, "[0.125, 0.125]", "[0.25, 0.25]", "self_attn.k_scale"),
        ("k_scale", "v_scale", (2, 1, 1), torch.bfloat16, "[0.125, 0.125]", "[0.25, 0.25]", "self_attn.k_scale"),
        ("kv_scale", None, (1,), torch.float32, "0.125", "0.125", "self_attn.kv_scale (K and V)"),
        ("k_scale", None, (1,), torch.float32, "0.125", "0.125", "self_attn.k_scale (K and V)"),
        ("k_proj.k_scale", "v_proj.v_scale", (1,), torch.float32, "0.125", "0.25", "k_proj.k_scale + "),
        ("k_proj.output_scale", "v_proj.output_scale", (), torch.bfloat16, "0.125", "0.25", "k_proj.output_scale"),
        ("qkv_proj.k_scale", "qkv_proj.v_scale", (1,), torch.float32, "0.125", "0.25", "qkv_proj.k_scale + v_scale"),
        ("qkv_proj.output_scale", None, (1,), torch.float32, "0.125", "0.125", "qkv_proj.output_scale (K and V)"),
        ("attn.k_scale", "attn.v_scale", (1,), torch.float32, "0.125", "0.25", "attn.k_scale + v_scale"),
    ],
)
def test_every_convention_loads_with_values_and_source(saved, tmp_path, k_suffix, v_suffix, shape, dtype,
                                                       expected_k, expected_v, source):  # fmt: skip
    tensors = both_layers(k_suffix, v_suffix, scale(0.125, shape, dtype), scale(0.25, shape, dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UncalibratedScalesWarning)
        rows = cache_for(checkpoint(saved, tmp_path, tensors)).summary()
    assert [(r["k_scale"], r["v_scale"]) for r in rows] == [(expected_k, expected_v)] * 2
    assert rows[1]["source"].startswith("model.layers.1.") and source in rows[1]["source"]
    assert rows[0]["granularity"] == ("per-tensor" if len(shape) < 1 or shape == (1,) else "per-head")


def test_modelopt_config_and_sharded_index(saved, tmp_path):
    tensors = both_layers("k_proj.k_scale", "v_proj.v_scale", scale(0.5), scale(0.75))
    quant = {"quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}}
    directory = checkpoint(saved, tmp_path, tensors, sharded=True, files={"hf_quant_config.json": quant})
    rows = cache_for(directory).summary()
    assert [(r["k_scale"], r["v_scale"]) for r in rows] == [("0.5", "0.75")] * 2


def test_model_from_pretrained_uses_its_scales_in_generate(saved, tmp_path):
    tensors = {f"{ATTN.format(i)}.{w}_scale": scale(0.01 * (i + 1), (2, 1, 1), torch.float32) for i in range(2)
               for w in "kv"}  # fmt: skip
    scheme = {"num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": False, "symmetric": True}
    config = {"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {},
                                      "kv_cache_scheme": scheme}}  # fmt: skip
    directory = checkpoint(saved, tmp_path, tensors, config=config)
    model = AutoModelForCausalLM.from_pretrained(directory, quantization_config=None).eval()
    cache = QuantizedFP8Cache(model)
    out = model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=3, do_sample=False, **cache_kwargs(cache))
    assert out.shape == (1, 6)
    assert cache.layers[1].value_scale.flatten().tolist() == pytest.approx([0.02, 0.02])


def test_old_vllm_json_and_tensor_parallel_ranks(saved, tmp_path):
    legacy = {"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": {"0": 0.5, "1": 0.25},
                                                                        "1": {"0": 0.75, "1": 0.125}}}}  # fmt: skip
    directory = checkpoint(saved, tmp_path, files={"kv_cache_scales.json": legacy})
    with pytest.warns(UserWarning, match="2 tensor-parallel ranks"):
        rows = cache_for(directory).summary()
    assert [(r["k_scale"], r["v_scale"]) for r in rows] == [("0.75", "0.75"), ("0.25", "0.25")]
    assert "kv_cache.scaling_factor[0]" in rows[0]["source"]


def test_q_and_prob_scales_are_reported_unused(saved, tmp_path):
    tensors = {**both_layers("k_scale", "v_scale", scale(0.5), scale(0.5)),
               **both_layers("q_scale", "prob_scale", scale(0.1), scale(0.1))}  # fmt: skip
    with pytest.warns(UserWarning, match="4 q/prob scales.*not used"):
        found = KVScales.from_pretrained(checkpoint(saved, tmp_path, tensors))
    assert found.unused[0] == "model.layers.0.self_attn.prob_scale" and found.layers == [0, 1]


def test_dynamic_scheme_gives_dynamic_scales(saved, tmp_path):
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": True, "symmetric": True}
    directory = checkpoint(saved, tmp_path, config={"quantization_config": {"kv_cache_scheme": scheme}})
    assert {r["granularity"] for r in cache_for(directory).summary()} == {"per-token-head"}


def test_no_scales_warns_once_per_cache_with_the_remedy(saved, tmp_path):
    directory = checkpoint(saved, tmp_path)
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cache = cache_for(directory)
        messages = [str(w.message) for w in caught if issubclass(w.category, UncalibratedScalesWarning)]
        assert len(messages) == 1 and "scales='dynamic'" in messages[0] and "calibrate" in messages[0]
    assert {r["source"] for r in cache.summary()} == {"default 1.0"}


def test_pickle_only_checkpoint_is_not_unpickled(tmp_path):
    (tmp_path / "config.json").write_text(tiny_model().config.to_json_string())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle: reading it would fail")
    with pytest.warns(UserWarning, match="no unpickling"), pytest.warns(UncalibratedScalesWarning):
        cache_for(tmp_path)


def test_local_hf_cache_without_network(saved, tmp_path, monkeypatch):
    import huggingface_hub.constants as hub

    commit = "0" * 40
    repo = tmp_path / "hub" / "models--someone--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    checkpoint_dir = checkpoint(saved, tmp_path, both_layers("kv_scale", None, scale(0.5), None))
    shutil.copytree(checkpoint_dir, repo / "snapshots" / commit)
    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert KVScales.from_pretrained("someone/tiny").key[1].item() == 0.5
    with pytest.raises(FileNotFoundError, match="no KV cache scales"):
        KVScales.from_pretrained("someone/not-cached")


BAD = [
    ({f"{ATTN.format(0)}.k_scale": scale(-1.0)}, "model.layers.0.self_attn.k_scale must be finite and > 0, got -1"),
    ({f"{ATTN.format(0)}.v_scale": scale(0.0)}, "model.layers.0.self_attn.v_scale must be finite and > 0, got 0"),
    ({f"{ATTN.format(1)}.k_scale": scale(float("nan"))}, "layers.1.self_attn.k_scale must be finite and > 0, got nan"),
    ({f"{ATTN.format(1)}.v_scale": scale(float("inf"))}, "layers.1.self_attn.v_scale must be finite and > 0, got inf"),
    ({f"{ATTN.format(0)}.k_scale": scale(0.5, (3,))}, r"layer 0 model.layers.0.self_attn.k_scale has shape \(3,\)"),
    ({f"{ATTN.format(0)}.k_scale": scale(0.5, (2, 2))}, r"self_attn.k_scale has shape \(2, 2\)"),
    ({f"{ATTN.format(5)}.k_scale": scale(0.5)}, r"layers \[5\] \(model.layers.5.self_attn.k_scale\)"),
    ({f"{ATTN.format(0)}.k_scale": scale(0.5), f"{ATTN.format(0)}.kv_scale": scale(0.5)}, "two K scales"),
]


@pytest.mark.parametrize("bad,match", BAD)
def test_bad_scales_raise_naming_the_tensor(saved, tmp_path, bad, match):
    tensors = {**both_layers("k_scale", "v_scale", scale(0.5), scale(0.5)), **bad}
    with pytest.raises(ValueError, match=match):
        cache_for(checkpoint(saved, tmp_path, tensors))


def test_partial_coverage_is_an_error_unless_skipped(saved, tmp_path):
    directory = checkpoint(saved, tmp_path, {f"{ATTN.format(1)}.k_scale": scale(0.5),
                                             f"{ATTN.format(1)}.v_scale": scale(0.5)})  # fmt: skip
    with pytest.raises(ValueError, match=r"missing for layers \[0\].*skip_layers=\[0\]"):
        cache_for(directory)
    assert cache_for(directory, skip_layers=[0]).summary()[1]["k_scale"] == "0.5"


@pytest.mark.parametrize(
    "config,files,match",
    [
        ({"kv_cache_scheme": {"num_bits": 8, "type": "int", "strategy": "tensor"}}, {}, "is not FP8"),
        ({"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "token"}}, {}, "strategy must be"),
        ({"kv_cache_scheme": {"num_bits": 8, "type": "float", "symmetric": False}}, {}, "asymmetric"),
        ({"kv_cache_quant_algo": "NVFP4"}, {}, "kv_cache_quant_algo='NVFP4'"),
        ({}, {"hf_quant_config.json": {"quantization": {"kv_cache_quant_algo": "INT8"}}}, "'INT8'"),
    ],
)
def test_declared_schemes_we_cannot_serve_are_refused(saved, tmp_path, config, files, match):
    tensors = both_layers("k_scale", "v_scale", scale(0.5), scale(0.5))
    directory = checkpoint(saved, tmp_path, tensors, config={"quantization_config": config}, files=files)
    with pytest.raises(ValueError, match=match):
        cache_for(directory)


def test_per_head_tensors_under_a_per_tensor_scheme_are_refused(saved, tmp_path):
    tensors = both_layers("k_scale", "v_scale", scale(0.5, (2,)), scale(0.5, (2,)))
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}
    directory = checkpoint(saved, tmp_path, tensors, config={"quantization_config": {"kv_cache_scheme": scheme}})
    with pytest.raises(ValueError, match="layers.0.self_attn.k_scale has 2 values.*'tensor'"):
        cache_for(directory)


@pytest.mark.parametrize("sharded", [False, True])
def test_export_for_vllm_round_trips(saved, tmp_path, sharded):
    scales = KVScales(key={0: torch.tensor([0.5, 0.25]), 1: torch.tensor([0.125, 1.5])},
                      value={0: torch.tensor([2.0, 3.0]), 1: torch.tensor([0.5, 0.5])})  # fmt: skip
    out = scales.export_for_vllm(saved["sharded" if sharded else "single"], tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["kv_cache_scheme"]["strategy"] == "attn_head"
    exported = load_file(out / SCALES_FILE)
    assert sorted(exported) == [f"{ATTN.format(i)}.{w}_scale" for i in range(2) for w in "kv"]
    assert exported[f"{ATTN.format(1)}.k_scale"].shape == (2, 1, 1)
    if sharded:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert index["weight_map"][f"{ATTN.format(0)}.v_scale"] == SCALES_FILE
    reloaded = KVScales.from_pretrained(out)
    for layer in (0, 1):
        assert torch.equal(reloaded.key[layer].flatten(), scales.key[layer])
        assert torch.equal(reloaded.value[layer].flatten(), scales.value[layer])
    with pytest.raises(FileExistsError, match="not empty"):
        scales.export_for_vllm(saved["single"], out)
    with pytest.raises(ValueError, match="already has KV scales"):
        scales.export_for_vllm(out, tmp_path / "again")


def test_export_for_vllm_is_self_contained_with_a_true_index(saved, tmp_path):
    """No symlinks (the export can be moved), an index for a single-file model too, and `total_size` counted."""
    scales = KVScales(key={0: torch.tensor([0.5]), 1: torch.tensor([0.25])},
                      value={0: torch.tensor([2.0]), 1: torch.tensor([0.5])})  # fmt: skip
    out = scales.export_for_vllm(saved["single"], tmp_path / "out")
    assert not [item for item in out.iterdir() if item.is_symlink()]
    moved = shutil.move(out, tmp_path / "moved")
    index = json.loads((moved / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert files == {"model.safetensors", SCALES_FILE}
    assert index["metadata"]["total_size"] == sum(t.nbytes for file in files for t in load_file(moved / file).values())
    assert KVScales.from_pretrained(moved).key[1].item() == 0.25
    AutoModelForCausalLM.from_pretrained(moved, quantization_config=None)  # the weights load from the moved copy


def test_lone_k_scale_under_compressed_tensors_leaves_v_at_one(saved, tmp_path):
    """vLLM's compressed-tensors loader keeps a missing V scale at 1.0 (its placeholders start at ones); the other
    conventions (ModelOpt, fp8, Quark) duplicate the lone scale, vLLM's max(k, -1)."""
    scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    for suffix in ("k_scale", "kv_scale"):
        tensors = both_layers(suffix, None, scale(0.5), None)
        directory = checkpoint(saved, tmp_path / suffix, tensors,
                               config={"quantization_config": {"kv_cache_scheme": scheme}})  # fmt: skip
        with pytest.warns(UserWarning, match="missing one is 1.0"):
            found = KVScales.from_pretrained(directory)
        assert (found.key[0].item(), found.value[0].item()) == (0.5, 1.0)
    dense = KVScales.from_pretrained(checkpoint(saved, tmp_path / "dense", both_layers("k_scale", None, scale(0.5), None)))
    assert (dense.key[0].item(), dense.value[0].item()) == (0.5, 0.5)


def _two_tower_checkpoint(directory, text="model.language_model", vision="model.vision_tower.encoder", text_scales=True,
                          text_layers=True):  # fmt: skip
    """A fabricated multimodal safetensors checkpoint: a text decoder beside its embeddings, and a vision encoder
    with more layers; both towers carry k/v scales (`text_layers=False`: the text decoder's layers hold no
    attention tensor, so only the vision tower's layer names are found)."""
    directory.mkdir(parents=True)
    tensors = {f"{text}.embed_tokens.weight": torch.zeros(8, 4), f"{vision}.patch_embedding.weight": torch.zeros(4, 4)}
    for i in range(3):
        tensors[f"{vision}.layers.{i}.self_attn.k_scale"] = scale(9.0, dtype=torch.float32)
        tensors[f"{vision}.layers.{i}.self_attn.v_scale"] = scale(9.0, dtype=torch.float32)
    for i in range(2 if text_layers else 0):
        tensors[f"{text}.layers.{i}.self_attn.q_proj.weight"] = torch.zeros(4, 4)
    for i in range(2 if text_scales else 0):
        tensors[f"{text}.layers.{i}.self_attn.k_scale"] = scale(0.5 + i, dtype=torch.float32)
        tensors[f"{text}.layers.{i}.self_attn.v_scale"] = scale(0.25, dtype=torch.float32)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory


@pytest.mark.parametrize("text", ["model.language_model", "language_model.model", "model"])
def test_multimodal_checkpoint_uses_the_text_decoders_scales_only(tmp_path, text):
    with pytest.warns(UserWarning, match=r"6 scales outside the text decoder .*vision_tower.*ignored"):
        found = KVScales.from_pretrained(_two_tower_checkpoint(tmp_path / "both", text))
    assert found.layers == [0, 1] and [found.key[i].item() for i in (0, 1)] == [0.5, 1.5]
    assert found.names[0][0] == f"{text}.layers.0.self_attn.k_scale"
    with pytest.warns(UserWarning, match="ignored"):
        vision_only = _two_tower_checkpoint(tmp_path / "vision", text, text_scales=False)
        with pytest.raises(FileNotFoundError, match="no KV cache scales"):
            KVScales.from_pretrained(vision_only)
    exported = KVScales(key={0: torch.tensor([0.5]), 1: torch.tensor([0.5])},
                        value={0: torch.tensor([0.5]), 1: torch.tensor([0.5])})  # fmt: skip
    (vision_only / "config.json").write_text("{}")
    with pytest.warns(UserWarning, match="ignored"):
        out = exported.export_for_vllm(vision_only, tmp_path / "out")
    assert sorted(load_file(out / SCALES_FILE))[0] == f"{text}.layers.0.self_attn.k_scale"


@pytest.mark.parametrize("embeddings", [True, False])
def test_scales_of_a_vision_tower_alone_are_never_the_text_decoders(tmp_path, embeddings):
    """Only the vision tower's layers are named in the checkpoint: its scales are still not the text decoder's,
    whether or not the text embeddings are there to say so (the tower is named vision)."""
    directory = _two_tower_checkpoint(tmp_path / "vision", text_scales=False, text_layers=False)
    if not embeddings:
        tensors = {n: t for n, t in load_file(directory / "model.safetensors").items() if "embed_tokens" not in n}
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"6 scales outside the text decoder \(not found.*vision_tower.*ignored"):
        with pytest.raises(FileNotFoundError, match="no KV cache scales"):
            KVScales.from_pretrained(directory)


def test_auto_reads_only_the_files_transformers_reads(saved, tmp_path):
    """Stray safetensors (an adapter, Mistral's consolidated.safetensors) beside model.safetensors or a sharded
    index are not opened, even when they hold (other) scales or are not safetensors at all."""
    for sharded in (False, True):
        directory = checkpoint(saved, tmp_path / str(sharded), both_layers("k_scale", "v_scale", scale(0.5), scale(0.5)),
                               sharded=sharded)  # fmt: skip
        save_file(both_layers("k_scale", "v_scale", scale(4.0), scale(4.0)), directory / "consolidated.safetensors")
        (directory / "adapter_model.safetensors").write_bytes(b"\x08partial")
        rows = cache_for(directory).summary()
        assert [(r["k_scale"], r["v_scale"]) for r in rows] == [("0.5", "0.5")] * 2


@pytest.mark.parametrize(
    "damage,match",
    [
        (lambda d: (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json"),
         r"model\.safetensors: cannot read it as safetensors"),
        (lambda d: (d / "model.safetensors.index.json").write_text('{"metadata": {}}'),
         r"model\.safetensors\.index\.json has no 'weight_map'"),
        (lambda d: (d / "model.safetensors.index.json").write_text("{bad json"),
         r"model\.safetensors\.index\.json is not valid JSON"),
        (lambda d: (d / "config.json").write_text("{bad json"), r"config\.json is not valid JSON"),
        (lambda d: (d / "kv_cache_scales.json").write_text("[1,"), r"kv_cache_scales\.json is not valid JSON"),
        (lambda d: (d / "config.json").write_text(json.dumps(
            {**json.loads((d / "config.json").read_text()), "quantization_config": {"kv_cache_scheme": "fp8"}})),
         r"config\.json: quantization_config\.kv_cache_scheme must be an object"),
    ],
)  # fmt: skip
def test_unreadable_files_raise_naming_the_file(saved, tmp_path, damage, match):
    directory = checkpoint(saved, tmp_path)
    damage(directory)
    with pytest.raises(ValueError, match=match):
        KVScales.from_pretrained(directory)
