"""A model's KV cache scales (`KVScales`) and their files: read every checkpoint convention, write llm-compressor's,
export a model for vLLM.

Read from safetensors only (never unpickled), single or sharded (`model.safetensors.index.json`), in a local
directory or a model of the local Hugging Face cache (never downloaded). Tensor names, after
`...layers.N.<attention module>.`:

| suffix                                  | convention                                | used for |
|-----------------------------------------|-------------------------------------------|----------|
| `k_scale`, `v_scale`                    | llm-compressor / compressed-tensors       | K, V     |
| `attn.k_scale`, `attn.v_scale`          | vLLM's own module names                   | K, V     |
| `kv_scale`                              | legacy single scale                       | K and V  |
| `k_proj.k_scale`, `v_proj.v_scale`      | NVIDIA ModelOpt (`hf_quant_config.json`)  | K, V     |
| `k_proj.output_scale`, `v_proj...`      | AMD Quark, older compressed-tensors       | K, V     |
| `qkv_proj.k_scale`, `qkv_proj.v_scale`  | fused QKV projections                     | K, V     |
| `qkv_proj.output_scale`                 | fused QKV, one output scale               | K and V  |

q and prob scales are read and reported (unused: queries and probabilities stay in full precision). vLLM's
rules apply per layer: K and V both present -> used; only one (a lone `k_scale`, the legacy `kv_scale`) -> used
for both (vLLM's `max(k, v)` with -1 for "missing"), except under compressed-tensors (a `kv_cache_scheme` is
declared), where vLLM keeps the missing one at 1.0 (`kv_scale` counts as K there): so do we, with a warning.

Only the files transformers loads are read: those of `model.safetensors.index.json`'s `weight_map`, else
`model.safetensors` (plus hf_fp8kv's own `kv_cache_scales.safetensors`). When several towers have decoder
layers (a multimodal checkpoint's vision and text towers), only the text decoder's scales are used: the tower
beside `embed_tokens`, else the only one, else the one named `language_model`/`text_model`. The old
vLLM/SGLang JSON (`{"kv_cache": {"dtype", "scaling_factor": {rank: {layer: scale}}}}`) is read from
`kv_cache_scales.json` in the directory or an explicit path.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import struct
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SCALES_FILE = "kv_cache_scales.safetensors"
LEGACY_JSON = "kv_cache_scales.json"
DEFAULT_MODULE = "model.layers.{}.self_attn"
_ATTENTION = re.compile(
    r"^(?P<module>(?P<tower>(?:.*\.)?(?:layers|h|blocks))\.(?P<layer>\d+)\."
    r"(?:self_attn|self_attention|attention|attn))\.(?P<suffix>.+)$"
)
TEXT_TOWER_NAMES = ("language_model", "text_model")
OTHER_TOWER_MARKERS = ("vision", "visual", "image", "audio", "speech")  # in the name of a tower that is not text
# suffix after the attention module -> which scale it is ("kv": one scale for both)
SCALE_SUFFIXES = {
    "k_scale": "k", "v_scale": "v", "attn.k_scale": "k", "attn.v_scale": "v", "kv_scale": "kv",
    "k_proj.k_scale": "k", "v_proj.v_scale": "v", "k_proj.output_scale": "k", "v_proj.output_scale": "v",
    "qkv_proj.k_scale": "k", "qkv_proj.v_scale": "v", "qkv_proj.output_scale": "kv",
}  # fmt: skip
UNUSED_SUFFIXES = frozenset(
    {"q_scale", "prob_scale", "attn.q_scale", "attn.prob_scale", "q_proj.output_scale", "qkv_proj.q_scale",
     "prob_output_scale"}
)  # fmt: skip
CHANNEL_SUFFIX = "k_channel_scale"  # hf_fp8kv's static per-channel key scale (not read by vLLM)


# --- the scales of a model ----------------------------------------------------------------------------------
@dataclass
class KVScales:
    """Static K/V scales of a model's layers (OCP e4m3 convention), as a checkpoint or `calibrate` gives them.

    `key` / `value`: `{layer: fp32 tensor of 1 value (per tensor) or one per KV head}`; `key_channel`:
    `{layer: [kv_heads, head_dim]}` static per-channel key scales (optional); `names`: `{layer: (K name, V
    name)}`, the tensors they came from, used in error messages; `sources`: `{layer: text}` for
    `cache.summary()`; `unused`: names of q/prob scales found in a checkpoint, which the cache does not use;
    `dynamic`: the checkpoint asks for dynamic (per-token) scales instead.
    """

    key: dict[int, torch.Tensor] = field(default_factory=dict)
    value: dict[int, torch.Tensor] = field(default_factory=dict)
    sources: dict[int, str] = field(default_factory=dict)
    names: dict[int, tuple[str, str]] = field(default_factory=dict)
    key_channel: dict[int, torch.Tensor] = field(default_factory=dict)
    unused: list[str] = field(default_factory=list)
    dynamic: bool = False

    @property
    def layers(self) -> list[int]:
        return sorted(self.key)

    @property
    def strategy(self) -> str:
        """compressed-tensors' name of the granularity: "tensor" or "attn_head"."""
        per_head = any(t.numel() > 1 for t in [*self.key.values(), *self.value.values()])
        return "attn_head" if per_head else "tensor"

    @property
    def kv_cache_scheme(self) -> dict[str, Any]:
        """The `quantization_config.kv_cache_scheme` entry that declares these scales (compressed-tensors)."""
        return {"num_bits": 8, "type": "float", "strategy": self.strategy, "dynamic": self.dynamic,
                "symmetric": True}

    def save(self, path: str | os.PathLike) -> Path:
        """Write a safetensors file with llm-compressor's tensor names and the `kv_cache_scheme` in its
        metadata (a directory gets `kv_cache_scales.safetensors`); returns the file's path."""
        return save_scales(self, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "KVScales":
        """Scales from a file written by `save`, any safetensors file or old vLLM JSON, or a model directory."""
        return load_scales_file(path)

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, revision: str | None = None) -> "KVScales":
        """Scales from a local model directory or a model in the local Hugging Face cache (no download)."""
        found = load_checkpoint_scales(name_or_path, revision=revision)
        if found is None:
            raise FileNotFoundError(f"{name_or_path} has no KV cache scales under any known name")
        return found

    def export_for_vllm(self, model: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
        """Write a copy of `model` (a local directory or cached model) with these scales, for `vllm serve`."""
        return export_for_vllm(self, model, out_dir)


def check_scale_values(tensor: torch.Tensor, layer: int | None, name: str) -> torch.Tensor:
    """`tensor` if every value is finite and > 0, else an error naming the layer and tensor."""
    bad = [v for v in tensor.flatten().tolist() if not (math.isfinite(v) and v > 0)]
    if bad:
        where = f"layer {layer} {name}" if layer is not None else name
        raise ValueError(f"{where} must be finite and > 0, got {bad[0]}")
    return tensor


# --- reading -------------------------------------------------------------------------------------------------
def local_model_dir(name_or_path: str | os.PathLike, revision: str | None = None) -> Path | None:
    """The local directory of a model: the path itself, or its snapshot in the local HF cache (no download)."""
    path = Path(name_or_path)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(str(name_or_path), revision=revision, local_files_only=True))
    except (ValueError, OSError):  # not a repo id, or not in the local cache
        return None


def load_checkpoint_scales(name_or_path: str | os.PathLike, revision: str | None = None) -> KVScales | None:
    """The KV scales of a local model directory or cached model, in any convention; None when it has none."""
    directory = local_model_dir(name_or_path, revision)
    if directory is None:
        return None
    scheme = _declared_scheme(directory)
    if scheme.get("dynamic"):
        return KVScales(dynamic=True)
    tensors = _scale_tensors(directory)
    if tensors:
        return _collect(tensors, scheme)
    if (directory / LEGACY_JSON).is_file():
        return _load_legacy_json(directory / LEGACY_JSON)
    if scheme:
        warnings.warn(
            f"{directory}: config declares a KV cache scheme ({scheme}), but no scale tensors were found under any "
            "known name (see hf_fp8kv.checkpoint)"
        )
    return None


def load_scales_file(path: str | os.PathLike) -> KVScales:
    """Scales from a safetensors file (any convention; `KVScales.save` output), an old vLLM JSON, or a model
    directory."""
    path = Path(path)
    if path.is_dir():
        found = load_checkpoint_scales(path)
        if found is None:
            raise FileNotFoundError(f"{path} has no KV cache scales under any known name")
        return found
    if path.suffix == ".json":
        return _load_legacy_json(path)
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: scales are read from .safetensors or the old vLLM .json (never unpickled)")
    metadata, names = _safetensors_header(path)
    tensors = _read_tensors(path, _text_scale_names(names, path))
    scheme = metadata.get("kv_cache_scheme")
    scheme = _parse_json(scheme, f"{path} metadata kv_cache_scheme") if scheme else {}
    found = _collect(tensors, scheme)
    if found is None:
        raise ValueError(f"{path} holds no KV cache scale tensors under any known name")
    if metadata.get("hf_fp8kv") == "kv_scales":
        found.sources = {layer: f"calibration file {path}" for layer in found.sources}
    return found


def _is_scale_name(name: str) -> bool:
    match = _ATTENTION.match(name)
    return bool(match) and match["suffix"] in (SCALE_SUFFIXES.keys() | UNUSED_SUFFIXES | {CHANNEL_SUFFIX})


def _parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where} is not valid JSON: {error}") from None


def _read_json(path: Path) -> Any:
    return _parse_json(path.read_text(), str(path))


@contextlib.contextmanager
def _open_safetensors(file: Path) -> Iterator:
    """`safe_open(file)`; a missing or corrupt file is an error naming it."""
    try:
        with safe_open(str(file), framework="pt") as handle:
            yield handle
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{file}: cannot read it as safetensors ({error})") from None


def _safetensors_header(file: Path) -> tuple[dict[str, str], list[str]]:
    """A safetensors file's metadata and tensor names."""
    with _open_safetensors(file) as handle:
        return handle.metadata() or {}, list(handle.keys())


def _read_tensors(file: Path, names: Iterable[str]) -> dict[str, torch.Tensor]:
    with _open_safetensors(file) as handle:
        return {name: handle.get_tensor(name) for name in names}


def _weight_names(directory: Path) -> dict[str, Path]:
    """The tensor names of the files transformers loads (the index's `weight_map`, else `model.safetensors`), and
    of our own `kv_cache_scales.safetensors`, each with the file that holds it."""
    index, single, own = directory / INDEX, directory / SINGLE_FILE, directory / SCALES_FILE
    names: dict[str, Path] = {}
    if index.is_file():
        content = _read_json(index)
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map' (tensor name -> file): its weight files are unknown")
        names = {name: directory / file for name, file in weight_map.items()}
    elif single.is_file():
        names = dict.fromkeys(_safetensors_header(single)[1], single)
    if own.is_file() and own not in names.values():
        names.update(dict.fromkeys(_safetensors_header(own)[1], own))
    if not names and (any(directory.glob("*.bin")) or any(directory.glob("*.pt"))):
        warnings.warn(f"{directory}: only pickle checkpoints (.bin/.pt); their KV scales are not read (no unpickling)")
    return names


def _text_tower(names: Iterable[str], where: str) -> str | None:
    """The layer stack (e.g. `model.language_model.layers`) of the text decoder among the towers of `names`: the
    one beside the token embeddings, else the one named as a language model, else the only one, unless its name
    says it is another modality's or the token embeddings lie elsewhere (then none: no tower's scales are the
    text decoder's)."""
    names = list(names)
    towers = sorted({match["tower"] for match in map(_ATTENTION.match, names) if match})
    embeddings = [n for n in names if ".embed_tokens." in f".{n}"]
    beside_embeddings = [t for t in towers if any(n.startswith(t.rsplit(".", 1)[0] + ".embed_tokens.") for n in names)]
    if len(beside_embeddings) == 1:
        return beside_embeddings[0]
    named = [t for t in towers if any(part in t.split(".") for part in TEXT_TOWER_NAMES)]
    if len(named) == 1:
        return named[0]
    if len(towers) == 1:
        other_modality = any(marker in part for part in towers[0].split(".") for marker in OTHER_TOWER_MARKERS)
        return None if other_modality or embeddings else towers[0]
    if not towers:
        return None
    raise ValueError(f"{where}: decoder layers in several towers ({', '.join(towers)}); cannot tell the text model's")


def _text_scale_names(names: Iterable[str], where: Path) -> list[str]:
    """The scale tensor names of the text decoder (other towers' scales, e.g. a vision encoder's, are ignored)."""
    names = list(names)
    scale_names = [name for name in names if _is_scale_name(name)]
    if not scale_names:
        return []
    tower = _text_tower(names, str(where))
    kept = [name for name in scale_names if _ATTENTION.match(name)["tower"] == tower]
    if len(kept) < len(scale_names):
        other = next(name for name in scale_names if name not in kept)
        decoder = f"the text decoder {tower}" if tower else "the text decoder (not found among the layer stacks)"
        warnings.warn(f"{where}: {len(scale_names) - len(kept)} scales outside {decoder} (e.g. {other}) are "
                      "ignored")  # fmt: skip
    return kept


def _scale_tensors(directory: Path) -> dict[str, torch.Tensor]:
    weights = _weight_names(directory)
    by_file: dict[Path, list[str]] = {}
    for name in _text_scale_names(weights, directory):
        by_file.setdefault(weights[name], []).append(name)
    tensors = {}
    for file, names in by_file.items():
        tensors.update(_read_tensors(file, names))
    return tensors


def _collect(tensors: dict[str, torch.Tensor], scheme: dict) -> KVScales | None:
    """Apply vLLM's per-layer rules to the scale tensors found (name -> tensor). `scheme`: the declared
    compressed-tensors `kv_cache_scheme` ({} when none)."""
    found: dict[int, dict[str, str]] = {}
    scales = KVScales()
    for name in sorted(tensors):
        match = _ATTENTION.match(name)
        layer, suffix = int(match["layer"]), match["suffix"]
        if suffix in UNUSED_SUFFIXES:
            scales.unused.append(name)
            continue
        tensor = check_scale_values(tensors[name].float(), None, name)
        if suffix == CHANNEL_SUFFIX:
            scales.key_channel[layer] = tensor
            continue
        if scheme.get("strategy") == "tensor" and tensor.numel() > 1:
            raise ValueError(f"{name} has {tensor.numel()} values, but kv_cache_scheme declares strategy 'tensor'")
        roles = found.setdefault(layer, {})
        # compressed-tensors loads a single scale as K only (vLLM remaps kv_scale to k_scale)
        single = ("k",) if scheme else ("k", "v")
        for role in single if SCALE_SUFFIXES[suffix] == "kv" else (SCALE_SUFFIXES[suffix],):
            if role in roles:
                raise ValueError(f"layer {layer} has two {role.upper()} scales: {roles[role]} and {name}")
            roles[role] = name
    if scales.unused:
        warnings.warn(
            f"the checkpoint has {len(scales.unused)} q/prob scales (e.g. {scales.unused[0]}): QuantizedFP8Cache "
            "keeps queries and attention probabilities in full precision, so they are not used"
        )
    lone = []
    for layer, roles in found.items():
        k_name, v_name = roles.get("k", roles.get("v")), roles.get("v", roles.get("k"))
        scales.key[layer], scales.value[layer] = tensors[k_name].float(), tensors[v_name].float()
        if scheme and k_name == v_name:  # compressed-tensors: the missing scale keeps its initial 1.0
            lone.append(k_name)
            missing = "value" if "k" in roles else "key"
            getattr(scales, missing)[layer] = torch.ones_like(scales.key[layer])
            k_name, v_name = (k_name, "1.0") if missing == "value" else ("1.0", v_name)
        scales.names[layer] = (k_name, v_name)
        scales.sources[layer] = _source(k_name, v_name)
    if lone:
        warnings.warn(
            f"{len(lone)} layers have a K or V scale but not both (e.g. {lone[0]}) under compressed-tensors: as in "
            "vLLM, the missing one is 1.0 (other conventions use the lone scale for both)"
        )
    if scheme.get("dynamic"):  # per-token scales: only per-channel key scales have tensors (`calibrate`'s "token")
        scales.dynamic = True
        return scales if scales.key_channel else None
    unknown = sorted(set(scales.key_channel) - set(scales.key))
    if unknown:
        raise ValueError(f"key channel scales for layers {unknown} have no K scale")
    return scales if scales.key else None


def _source(k_name: str, v_name: str) -> str:
    if k_name == v_name:
        return f"{k_name} (K and V)"
    k_module, v_module = k_name.rsplit(".", 1)[0], v_name.rsplit(".", 1)[0]
    return f"{k_name} + {v_name.rsplit('.', 1)[1]}" if k_module == v_module else f"{k_name} + {v_name}"


def _declared_scheme(directory: Path) -> dict:
    """The KV cache scheme the configs declare (compressed-tensors, ModelOpt), validated; {} when none."""
    config_file, modelopt_file = directory / "config.json", directory / "hf_quant_config.json"
    config = _read_json(config_file) if config_file.is_file() else {}
    quantization = config.get("quantization_config") or {}
    if not isinstance(quantization, dict):
        raise ValueError(f"{config_file}: quantization_config must be an object, got {quantization!r}")
    algorithm = quantization.get("kv_cache_quant_algo")
    if modelopt_file.is_file():
        algorithm = _read_json(modelopt_file).get("quantization", {}).get("kv_cache_quant_algo")
    if algorithm is not None and str(algorithm).upper() != "FP8":
        raise ValueError(f"{directory}: kv_cache_quant_algo={algorithm!r}; QuantizedFP8Cache reads FP8 KV scales")
    scheme = quantization.get("kv_cache_scheme") or {}
    if not isinstance(scheme, dict):
        raise ValueError(
            f"{config_file}: quantization_config.kv_cache_scheme must be an object such as {{'num_bits': 8, 'type': "
            f"'float', 'strategy': 'tensor', 'dynamic': false, 'symmetric': true}}, got {scheme!r}"
        )
    if scheme:
        where = f"{config_file}: quantization_config.kv_cache_scheme {scheme}"
        if scheme.get("num_bits") != 8 or scheme.get("type") != "float":
            raise ValueError(f"{where} is not FP8 (num_bits 8, type float): QuantizedFP8Cache cannot use it")
        if scheme.get("symmetric") is False:
            raise ValueError(f"{where} is asymmetric: FP8 KV scales are symmetric")
        if scheme.get("strategy", "tensor") not in ("tensor", "attn_head"):
            raise ValueError(f"{where}: strategy must be 'tensor' or 'attn_head'")
    return scheme


def _load_legacy_json(path: Path) -> KVScales:
    """The old vLLM/SGLang `--quantization-param-path` JSON: one scale per layer and tensor-parallel rank."""
    content = _read_json(path)
    kv_cache = content.get("kv_cache") if isinstance(content, dict) else None
    if not isinstance(kv_cache, dict) or not isinstance(kv_cache.get("scaling_factor"), dict):
        raise ValueError(f"{path}: expected {{'kv_cache': {{'dtype': ..., 'scaling_factor': {{rank: {{layer: scale}}}}}}}}")
    if kv_cache.get("dtype", "float8_e4m3fn") not in ("float8_e4m3fn", "fp8", "fp8_e4m3"):
        raise ValueError(f"{path}: scales are for kv_cache dtype {kv_cache['dtype']!r}, not float8_e4m3fn")
    ranks = kv_cache["scaling_factor"]
    if len(ranks) > 1:
        warnings.warn(f"{path}: scales of {len(ranks)} tensor-parallel ranks; using the max over ranks per layer")
    per_layer: dict[int, list[float]] = {}
    for rank_scales in ranks.values():
        for layer, value in rank_scales.items():
            per_layer.setdefault(int(layer), []).append(float(value))
    scales = KVScales()
    for layer, values in per_layer.items():
        name = f"{path.name}: kv_cache.scaling_factor[{layer}]"
        tensor = check_scale_values(torch.tensor([max(values)], dtype=torch.float32), None, name)
        scales.key[layer], scales.value[layer] = tensor, tensor.clone()
        scales.names[layer], scales.sources[layer] = (name, name), f"{name} (K and V)"
    return scales


# --- writing -------------------------------------------------------------------------------------------------
def _vllm_tensors(scales: KVScales, modules: dict[int, str] | None = None) -> dict[str, torch.Tensor]:
    """k_scale / v_scale under llm-compressor's names: `[1]` per tensor, `[kv_heads, 1, 1]` per head (fp32)."""
    if scales.dynamic:
        if modules is not None or not scales.key_channel:  # (vLLM computes per-token scales itself, and has no
            # per-channel key scales)
            raise ValueError("dynamic scales have no tensors for vLLM: they are computed per token")
        return {}
    kv_heads = max(t.numel() for t in [*scales.key.values(), *scales.value.values()])
    shape = (1,) if scales.strategy == "tensor" else (kv_heads, 1, 1)
    tensors = {}
    for layer in scales.layers:
        module = (modules or {}).get(layer, DEFAULT_MODULE.format(layer))
        for which, values in (("k", scales.key[layer]), ("v", scales.value[layer])):
            tensors[f"{module}.{which}_scale"] = values.float().flatten().expand(shape[0]).reshape(shape).clone()
    return tensors


def save_scales(scales: KVScales, path: str | os.PathLike) -> Path:
    """Write `scales` as safetensors (see `KVScales.save`); returns the file's path."""
    path = Path(path)
    if path.suffix != ".safetensors":
        path.mkdir(parents=True, exist_ok=True)
        path = path / SCALES_FILE
    tensors = _vllm_tensors(scales)
    for layer, channel in scales.key_channel.items():
        tensors[f"{DEFAULT_MODULE.format(layer)}.{CHANNEL_SUFFIX}"] = channel.float().contiguous()
    metadata = {"format": "pt", "hf_fp8kv": "kv_scales", "kv_cache_scheme": json.dumps(scales.kv_cache_scheme)}
    save_file(tensors, str(path), metadata=metadata)
    return path


def export_for_vllm(scales: KVScales, model: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """A self-contained copy of `model` (weights hard-linked, or copied across file systems, so the directory can
    be moved) with `scales` added as vLLM loads them: llm-compressor tensor names in
    `kv_cache_scales.safetensors`, listed in `model.safetensors.index.json` (written for a single-file model
    too, with `total_size` counted), and `quantization_config.kv_cache_scheme` in config.json
    (compressed-tensors). Run `vllm serve <out_dir> --kv-cache-dtype fp8`."""
    source = local_model_dir(model)
    if source is None:
        raise FileNotFoundError(f"{model} is neither a local directory nor a model in the local Hugging Face cache")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty: export_for_vllm writes a fresh directory")
    existing = _scale_tensors(source)
    if existing:
        raise ValueError(f"{source} already has KV scales ({next(iter(existing))}...): vLLM would load both")
    config = _read_json(source / "config.json")
    quantization = config.get("quantization_config") or {
        "quant_method": "compressed-tensors", "format": "dense", "quantization_status": "frozen",
        "config_groups": {}, "ignore": [],
    }  # fmt: skip
    if quantization.get("quant_method") != "compressed-tensors":
        raise ValueError(
            f"{source} is quantized with {quantization.get('quant_method')!r}: only compressed-tensors checkpoints "
            "(or unquantized ones) can declare a kv_cache_scheme"
        )
    if scales.key_channel:
        warnings.warn("vLLM has no per-channel key scales: exporting the per-tensor/per-head K scales only")
    quantization["kv_cache_scheme"] = scales.kv_cache_scheme
    config["quantization_config"] = quantization
    names = _weight_names(source)
    if not names:
        raise FileNotFoundError(f"{source} has neither {INDEX} nor {SINGLE_FILE}: no safetensors weights to export")
    tensors = _vllm_tensors(scales, _attention_modules(names, source))
    out.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name in ("config.json", INDEX) or item.name.startswith("."):
            continue
        if item.is_dir():
            shutil.copytree(item, out / item.name)
        else:
            _link_or_copy(item.resolve(), out / item.name)
    save_file(tensors, str(out / SCALES_FILE), metadata={"format": "pt"})
    index = _read_json(source / INDEX) if (source / INDEX).is_file() else {}
    weight_map = {name: str(file.relative_to(source)) for name, file in names.items()}
    weight_map.update({name: SCALES_FILE for name in tensors})
    total = sum(_data_bytes(out / file) for file in set(weight_map.values()))
    index["metadata"] = {**index.get("metadata", {}), "total_size": total}
    index["weight_map"] = weight_map
    (out / INDEX).write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _link_or_copy(source: Path, target: Path) -> None:
    """A hard link (no copy, and the export stays valid when moved), or a copy across file systems."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _data_bytes(file: Path) -> int:
    """The bytes of a safetensors file's tensors (what an index's `total_size` sums), from its header."""
    with open(file, "rb") as handle:
        header = _parse_json(handle.read(struct.unpack("<Q", handle.read(8))[0]), str(file))
    offsets = [entry["data_offsets"] for name, entry in header.items() if name != "__metadata__"]
    return sum(end - start for start, end in offsets)


def _attention_modules(names: dict[str, Path], where: Path) -> dict[int, str]:
    """The attention module of each layer of the text decoder, from the weight names."""
    tower = _text_tower(names, str(where))
    modules = {}
    for match in map(_ATTENTION.match, names):
        if match and match["tower"] == tower:
            modules[int(match["layer"])] = match["module"]
    return modules
