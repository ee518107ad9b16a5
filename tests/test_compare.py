"""`hf_fp8kv.compare`: the A/B report on a tiny random model and on SmolLM2, its figures and its input errors."""

import dataclasses
import functools
import html
import subprocess
import sys
import warnings

import pytest
import torch
from transformers import AutoTokenizer, DynamicCache

from hf_fp8kv import compare
from hf_fp8kv.bundled import smollm2_dir
from hf_fp8kv.comparison import (
    BUILTIN_VARIANTS,
    HF_FP8,
    RECOMMENDED,
    PasskeyProbe,
    RaisedWarning,
    builtin_text,
    kv_bytes,
    resolve_variants,
)
from hf_fp8kv.comparison.break_even import BreakEven
from hf_fp8kv.comparison.report import relative
from hf_fp8kv.compat import HAS_FP8_QUANTIZED_CACHE, cache_kwargs
from tests.models import PURE_FP8, smollm2, tiny_model

PROMPTS = ["Name three colours of the sea.", "Write one line about a lighthouse."]
BROKEN = {"scales": 1e-6, **PURE_FP8}  # every K/V value saturates: a variant that must be flagged

# transformers' own fp8 cache is compared against where it exists (5.21 on)
THEIRS = {HF_FP8: HF_FP8} if HAS_FP8_QUANTIZED_CACHE else {}


@functools.lru_cache(maxsize=None)
def tokenizer():
    return AutoTokenizer.from_pretrained(smollm2_dir())


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", vocab_size=len(tokenizer()))


@pytest.fixture(scope="module")
def tiny_run(tiny):
    """The comparison, and the warnings that escaped it."""
    with warnings.catch_warnings(record=True) as escaped:
        warnings.simplefilter("always")
        result = compare(
            tiny,
            tokenizer(),
            prompts=PROMPTS,
            variants={"again": lambda model: DynamicCache(config=model.config), "broken": BROKEN, "fp8": {"kv_cache_dtype": "fp8_e4m3", **PURE_FP8},
                      RECOMMENDED: RECOMMENDED, **THEIRS},
            max_new_tokens=6,
            prefill=16,
            eval_tokens=40,
            contexts=(24, 200),
            decode_steps=2,
            retrieval=PasskeyProbe(lengths=(200,), depths=(0.0, 1.0), trials=1, max_new_tokens=4),
            progress=False,
        )
    return result, escaped


@pytest.fixture(scope="module")
def tiny_result(tiny_run):
    return tiny_run[0]


def by_variant(rows):
    return {row["variant"]: row for row in rows}


def test_tables_have_a_row_per_variant_prompt_bucket_and_context(tiny_result):
    names = ["native", "again", "broken", "fp8", RECOMMENDED, *THEIRS]
    assert [row["variant"] for row in tiny_result.summary_rows()] == names
    assert [(r["prompt"], r["variant"]) for r in tiny_result.generation_rows()] == [(p, n) for p in (1, 2) for n in names]
    quality = tiny_result.quality_rows()
    assert [r["context"] for r in quality[:: len(names)]] == ["all", "16-31", "32-55"]
    assert sum(r["tokens"] for r in quality if r["context"] != "all" and r["variant"] == "fp8") == 40
    assert [(r["variant"], r["context"]) for r in tiny_result.cost_rows()] == [(n, c) for n in names for c in (24, 200)]
    retrieval = tiny_result.tables()["Passkey retrieval (keys found / trials, by context length and key depth)"]
    assert [(r["length"], r["depth_%"], r["trials"]) for r in retrieval] == [(200, 0, 1), (200, 100, 1), ("all", "", 2)]
    assert list(retrieval[0])[3:] == names


def test_reference_against_itself_is_exact(tiny_result):
    again = by_variant(tiny_result.summary_rows())["again"]
    assert (again["verdict"], again["diverged"]) == ("identical", "0/2")
    assert again["kl_mean"] == 0.0 and again["ppl_delta_%"] == 0.0 and again["top1_%"] == 100.0
    assert all(g.diverges_at is None for g in tiny_result.generations if g.variant == "again")


def test_broken_variant_is_flagged_and_sane_variants_are_close(tiny_result):
    summary = by_variant(tiny_result.summary_rows())
    assert summary["broken"]["verdict"] in ("FAILS top-k rule", "diverges, top-k ok")
    assert summary["broken"]["diverged"] == "2/2"
    assert summary["broken"]["kl_mean"] > 100 * summary["fp8"]["kl_mean"]
    assert summary["fp8"]["kl_mean"] < 1e-3 and summary["fp8"]["top1_%"] > 90


def test_memory_and_speed_figures(tiny_result):
    costs = {(p.variant, p.context): p for p in tiny_result.costs}
    native, ours = costs["native", 200], costs["fp8", 200]
    # 2 layers x 2 KV heads x 16 dims x (K + V): 512 bytes a token in fp32, 128 in fp8 (+ block slack for ours)
    assert native.kv_bytes == 512 * native.tokens
    assert 128 * ours.tokens <= ours.kv_bytes <= 128 * (ours.tokens + 64)
    if THEIRS:
        theirs = costs[HF_FP8, 200]
        assert 128 * theirs.tokens <= theirs.kv_bytes < 130 * theirs.tokens
    assert all(p.peak_bytes >= tiny_result.weight_bytes + p.kv_bytes for p in tiny_result.costs)
    assert all(p.step_ms > 0 for p in tiny_result.costs)
    summary = by_variant(tiny_result.summary_rows())
    assert summary["fp8"]["max_batch@200"] > 3 * summary["native"]["max_batch@200"]


def test_report_renders_and_saves_png_plots(tiny_result, tmp_path):
    text, page = str(tiny_result), tiny_result._repr_html_()
    for title in ("Summary", "Greedy outputs", "Decode-mode quality by context length", "Cost (batch 1)"):
        assert title in text and title in page
    assert "[[" in text and "<mark>" in page  # the broken variant's first divergent token is marked
    paths = tiny_result.save(tmp_path / "report")
    pngs = [p for p in paths if p.suffix == ".png"]
    assert {p.stem for p in pngs} == {"kl_vs_position", "memory_vs_context", "step_time_vs_context", "retrieval"}
    for png in pngs:
        data = png.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000
    assert (tmp_path / "report" / "report.txt").read_text() == text + "\n"


def test_report_opens_with_the_recommended_variant_and_its_gains(tiny_result):
    """The first lines name the recommended variant and, in one sentence each, its KV bytes, KL, top-1 and step
    time against the native cache and transformers' fp8 cache, from the same figures as the tables."""
    headline = tiny_result.headline()
    assert headline[0] == f"Recommended: {RECOMMENDED} = QuantizedFP8Cache(model, scales='dynamic'): e4m3, a scale " \
                          "per token and KV head, the newest 128 and first 4 tokens in the model's dtype, the " \
                          "defaults; no calibration."
    summary = by_variant(tiny_result.summary_rows())
    costs = {(p.variant, p.context): p for p in tiny_result.costs}
    ours, native = summary[RECOMMENDED], costs["native", 200]
    ours_cost = costs[RECOMMENDED, 200]
    assert headline[1] == (
        f"Against the native cache (native): {relative(ours_cost.kv_bytes, native.kv_bytes, 'smaller', 'larger')} KV cache, "
        f"mean KL {ours['kl_mean']:.2g} and {ours['top1_%']:.1f}% top-1 agreement with it, "
        f"{relative(ours_cost.step_ms, native.step_ms, 'less', 'more')} time per decode step "
        f"({ours_cost.step_ms:.3g} vs {native.step_ms:.3g} ms; both at 200 tokens, batch 1)."
    )
    assert len(headline) == 4 + len(THEIRS)
    if THEIRS:
        hf, theirs = summary[HF_FP8], costs[HF_FP8, 200]
        assert headline[2].startswith(f"Against transformers' fp8 cache ({HF_FP8}): ")
        assert f"mean KL ({ours['kl_mean']:.2g} vs {hf['kl_mean']:.2g}), top-1 agreement " in headline[2]
        assert f"({ours_cost.step_ms:.3g} vs {theirs.step_ms:.3g} ms; both at 200 tokens, batch 1)." in headline[2]
    break_even_line, retrieval_line = headline[2 + len(THEIRS) :]
    break_even = BreakEven.of(*([p for p in tiny_result.costs if p.variant == v] for v in (RECOMMENDED, "native")))
    assert break_even_line == (
        f"Break-even of decode step time against native on this machine ({tiny_result.machine}, batch 1): "
        f"{RECOMMENDED} {break_even.sentence()}."
    )
    assert tiny_result.machine.endswith(f" CPU, {torch.get_num_threads()} torch threads")
    assert ours["break_even"] == break_even.cell() and summary["native"]["break_even"] == "-"
    found = {name: sum(t.found for t in tiny_result.retrieval if t.variant == name) for name in ("native", RECOMMENDED)}
    assert retrieval_line.startswith(
        f"Passkey retrieval: native found {found['native']} of 2 keys, {RECOMMENDED} {found[RECOMMENDED]}"
    )
    assert ours["retrieval_%"] == 100 * found[RECOMMENDED] / 2
    text = str(tiny_result)
    assert text.startswith("== Summary ==\n" + "\n".join(headline) + "\n")
    assert text.index(headline[-1]) < text.index("verdict") < text.index("variants:\n  native: ")
    assert html.escape(headline[1]) in tiny_result._repr_html_()


def test_headline_leaves_out_what_was_not_compared(tiny_result):
    dropped = lambda *names: dataclasses.replace(  # noqa: E731
        tiny_result, variants=[v for v in tiny_result.variants if v.name not in names]
    )
    lines = dropped(HF_FP8).headline()
    assert [line.split(" (")[0] for line in lines[:2]] == [
        f"Recommended: {RECOMMENDED} = QuantizedFP8Cache(model, scales='dynamic'): e4m3, a scale per token and KV "
        "head, the newest 128 and first 4 tokens in the model's dtype, the defaults; no calibration.",
        "Against the native cache",
    ]
    assert lines[2].startswith("Break-even of decode step time against native on this machine (")
    assert lines[3].startswith("Passkey retrieval: native found ") and len(lines) == 4
    assert dropped(RECOMMENDED).headline() == []
    assert "Recommended" not in str(dropped(RECOMMENDED))
    no_costs = dataclasses.replace(tiny_result, costs=[], retrieval=[]).headline()
    assert "KV cache" not in no_costs[1] and "mean KL" in no_costs[1] and len(no_costs) == 2 + len(THEIRS)
    if THEIRS:
        assert "decode step" not in no_costs[2] and "mean KL" in no_costs[2]


@pytest.mark.parametrize(
    "value,other,expected",
    [(1.0, 3.7, "3.7x smaller"), (9.0, 10.0, "10% smaller"), (1.04, 1.0, "4% larger"), (3.0, 1.0, "3.0x larger"),
     (2.0, 2.0, "the same"), (0.0, 1.0, "smaller")],
)
def test_relative_phrasing(value, other, expected):
    assert relative(value, other, "smaller", "larger") == expected


def test_warnings_the_variants_raise_are_reported_once_not_printed(tiny_run):
    result, escaped = tiny_run
    assert [str(w.message)[:60] for w in escaped] == []
    (uncalibrated,) = result.warnings_raised  # fp8_e4m3 on a model without KV scales: scale 1.0, built 4 times
    assert (uncalibrated.category, uncalibrated.variants) == ("UncalibratedScalesWarning", ["fp8"])
    assert uncalibrated.message.startswith("QuantizedFP8Cache: the checkpoint has no KV cache scales")
    line = ("fp8 warned (UncalibratedScalesWarning): QuantizedFP8Cache: the checkpoint has no KV cache scales, so "
            "every layer uses scale 1.0 (uncalibrated).")
    assert uncalibrated.line() == line
    assert str(result).count(line) == 1 and str(result).index(line) < str(result).index("verdict")


def test_warning_line_keeps_the_first_sentence_and_every_variant():
    raised = RaisedWarning("UserWarning", "First part. Second part.", ["a", "b"])
    assert raised.line() == "a, b warned (UserWarning): First part."


def test_kv_bytes_counts_a_dynamic_cache_tensors(tiny):
    cache = DynamicCache(config=tiny.config)
    tiny(input_ids=torch.arange(10)[None], **cache_kwargs(cache), use_cache=True)
    assert kv_bytes(cache) == sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers) == 10 * 512


def test_smollm2_per_token_head_fp8_and_int8_are_close_and_broken_scales_diverge():
    model, tok = smollm2()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = compare(
            model,
            tok,
            prompts=PROMPTS[:1],
            variants={"fp8_per_token_head": "fp8_per_token_head", "int8_per_token_head": "int8_per_token_head",
                      "broken": BROKEN},
            max_new_tokens=6,
            prefill=32,
            eval_tokens=16,
            contexts=(48,),
            decode_steps=1,
            progress=False,
        )
    summary = by_variant(result.summary_rows())
    for name in ("fp8_per_token_head", "int8_per_token_head"):
        assert summary[name]["kl_mean"] < 0.02 and summary[name]["top1_%"] >= 90
    assert summary["broken"]["verdict"] == "FAILS top-k rule" and summary["broken"]["kl_mean"] > 1
    assert 0 < summary["fp8_per_token_head"]["kv_vs_ref_%"] < 60


def test_the_searched_builtin_is_the_recommended_cache_with_searched_scales_and_its_bytes():
    model = tiny_model()
    ids = torch.randint(3, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    caches = {name: BUILTIN_VARIANTS[name].make_cache(model) for name in (RECOMMENDED, "fp8_recent_searched")}
    with torch.no_grad():
        for cache in caches.values():
            model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
    recommended, searched = caches[RECOMMENDED], caches["fp8_recent_searched"]
    assert [layer.scale_search.candidates for layer in searched.layers] == [16] * len(searched.layers)
    assert {layer.scale_search.candidates for layer in recommended.layers} == {0}
    assert searched.nbytes == recommended.nbytes
    assert not torch.equal(searched.layers[0].scale, recommended.layers[0].scale)  # chosen, not the amax ones


def test_the_int8_key_channels_builtin_measures_its_channels_at_int8s_bytes():
    model = tiny_model()
    ids = torch.randint(3, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0))
    caches = {name: BUILTIN_VARIANTS[name].make_cache(model) for name in ("int8_per_token_head", "int8_key_channels")}
    with torch.no_grad():
        for cache in caches.values():
            model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
    plain, measured = caches["int8_per_token_head"], caches["int8_key_channels"]
    assert all(layer.key_channel_scale is None for layer in plain.layers)
    assert all(layer.key_channel_scale.shape == (2, 16) for layer in measured.layers)
    assert measured.nbytes == plain.nbytes


def test_import_hf_fp8kv_loads_the_comparison_only_when_compare_is_used():
    """`import hf_fp8kv` imports neither the comparison package nor matplotlib; `hf_fp8kv.compare` is the function,
    also after `hf_fp8kv.comparison` was imported first."""
    code = (
        "import sys, hf_fp8kv\n"
        "print([m for m in ('matplotlib', 'hf_fp8kv.comparison') if m in sys.modules])\n"
        "import hf_fp8kv.comparison\n"
        "from hf_fp8kv import compare\n"
        "print(hf_fp8kv.compare is compare is hf_fp8kv.comparison.compare, 'compare' in dir(hf_fp8kv))\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["[]", "True True"]


# --- bad input ----------------------------------------------------------------------------------------------


def test_unknown_variant_lists_the_valid_names():
    with pytest.raises(ValueError, match="unknown variant 'fp9'.*fp8_e4m3" + (".*hf_quantized_fp8" if THEIRS else "")):
        resolve_variants(["fp8_e4m3", "fp9"])
    with pytest.raises(TypeError, match="built-in names"):
        resolve_variants([{"scales": 1.0}])


def test_default_variants_put_the_reference_first():
    assert [v.name for v in resolve_variants(None)] == list(BUILTIN_VARIANTS)
    assert list(BUILTIN_VARIANTS)[:4] == ["native", RECOMMENDED, "fp8_per_token_head", "int8_per_token_head"]
    assert (HF_FP8 in BUILTIN_VARIANTS) == HAS_FP8_QUANTIZED_CACHE
    assert [v.name for v in resolve_variants({"mine": {"scales": 2.0}, "native": "native"})] == ["native", "mine"]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(prompts=[]), "prompts is empty"),
        (dict(prompts=["ok", "  "]), "prompts is empty or holds a blank entry"),
        (dict(texts=["A short text."]), r"text 1 has \d+ tokens, no more than prefill=64"),
        (dict(variants={"bad": {"kv_cache_dtype": "fp9"}}), "kv_cache_dtype='fp9'"),
        (dict(contexts=(0, 8)), "contexts"),
        (dict(decode_steps=0), "decode_steps=0 must be at least 1"),
        (dict(memory_budget_gib=-1.0), "memory_budget_gib=-1.0 must be positive"),
    ],
)
def test_bad_input_fails_before_running(tiny, kwargs, message):
    with pytest.raises(ValueError, match=message):
        compare(tiny, tokenizer(), **{"variants": ["fp8_e4m3"], **kwargs})


def test_builtin_text_is_long_enough_for_the_defaults():
    assert len(tokenizer()(builtin_text()).input_ids) > 64 + 256  # prefill + eval_tokens
