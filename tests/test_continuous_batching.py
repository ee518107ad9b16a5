"""Continuous batching over FP8 pages (`hf_fp8kv.continuous_batching`) on SmolLM2-135M-Instruct and tiny models:
agreement with `generate` + `QuantizedFP8Cache` (recent and sink tokens, or pure FP8) under vLLM's top-5 rule and
logit for logit, queueing under a tight page budget or few request slots, preemption, forks, prefix sharing,
cancellation, streaming from the manager, sliding/full layer groups, the memory gain and the errors."""

import math
import pickle
import warnings

import pytest
import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from hf_fp8kv import KVScales, QuantizedFP8Cache, UncalibratedScalesWarning

try:
    from hf_fp8kv import continuous_batching as cb
except ImportError as error:  # transformers before 5.20: test_compat checks the message
    pytest.skip(str(error), allow_module_level=True)
from hf_fp8kv.compat import cache_kwargs
from hf_fp8kv.evaluate import greedy_with_logits, topk_rule
from hf_fp8kv.paged_recent import RequestSlots
from tests.models import PURE_FP8, smollm2, tiny_model
from tests.prompts import PROMPTS

NEW_TOKENS = 5
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels: CUDA, else the interpreter
GREEDY = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=0)


# the dense cache's default (recent and sink tokens), and pure FP8
VARIANTS = {"recent+sinks": {}, "pure": PURE_FP8}
# rotated codes (per-token scales only)
ROTATED = {f"{name}, rotated": dict(settings, rotate=True) for name, settings in VARIANTS.items()}
# request slots for every request of a test at once (the default, an eighth of these tiny page budgets, holds one)
REQUESTS = 8


def pages(**kwargs) -> ContinuousBatchingConfig:
    """Small pages so that prompts span several of them; a fixed capacity (the CPU memory setting is the host's)."""
    return ContinuousBatchingConfig(**{"page_size": 16, "num_blocks": 32, "max_batch_tokens": 256, **kwargs})


@pytest.fixture(scope="module")
def model_and_tokenizer():
    model, tokenizer = smollm2()
    cb.enable(model, scales="dynamic", max_requests=REQUESTS)
    yield model, tokenizer
    cb.disable(model)


def chat_ids(tokenizer, prompt: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)  # fmt: skip
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def last_logits(model, ids: list[int]) -> torch.Tensor:
    """The logits continuous batching gives after `ids` (one request, one new token), captured at the LM head."""
    captured = []
    handle = model.lm_head.register_forward_hook(lambda module, args, out: captured.append(out[0, -1].float()))
    try:
        model.generate_batch([ids], generation_config=GREEDY, continuous_batching_config=pages(), max_new_tokens=1,
                             warmup=False)  # fmt: skip
    finally:
        handle.remove()
    return captured[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_generate_batch_agrees_with_generate_under_top5_rule(model_and_tokenizer, variant):
    model, tokenizer = model_and_tokenizer
    cb.enable(model, scales="dynamic", max_requests=REQUESTS, **VARIANTS[variant])
    inputs = [chat_ids(tokenizer, p) for p in PROMPTS]
    assert len({len(ids) for ids in inputs}) >= 6  # mixed lengths: 1 to 4 pages of 16 tokens
    # no prefix sharing: every request holds its own sink tokens (a shared prefix is read from its codes)
    outputs = model.generate_batch(inputs, generation_config=GREEDY, warmup=False,
                                   continuous_batching_config=pages(allow_block_sharing=False))  # fmt: skip
    assert len(outputs) == len(PROMPTS)
    for ids, output in zip(inputs, outputs.values()):
        assert output.error is None and len(output.generated_tokens) == NEW_TOKENS
        check_top5(model, tokenizer, ids, output.generated_tokens,
                   QuantizedFP8Cache(model, scales="dynamic", **VARIANTS[variant]))  # fmt: skip
    cb.enable(model, scales="dynamic", max_requests=REQUESTS)


def check_top5(model, tokenizer, ids: list[int], generated: list[int], cache) -> None:
    """vLLM's top-5 rule: `generated` (greedy, continuous batching) against `generate` with `cache` for `ids` alone;
    at a divergence, the batch's own logits."""
    tokens = torch.tensor(generated)
    prompt = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    with torch.inference_mode():
        ref_tokens, ref_logits = greedy_with_logits(model, prompt, cache, len(generated))
    at, _ = topk_rule(ref_tokens[0], ref_logits[0], tokens, ref_logits[0])
    if at is not None:
        logits = torch.zeros_like(ref_logits[0])
        logits[at] = last_logits(model, ids + generated[:at])
        at, ok = topk_rule(ref_tokens[0], ref_logits[0], tokens, logits)
        assert ok, f"{tokenizer.decode(ids)!r}: diverges from generate at {at} outside the top 5"


def test_a_prefix_from_the_prefix_cache_passes_the_top5_rule(model_and_tokenizer):
    """The same prompt twice, one after the other: the second takes the first's complete blocks from transformers'
    prefix cache (read from their codes, but for the sink tokens, copied from the first's) and still passes the
    top-5 rule."""
    model, tokenizer = model_and_tokenizer
    ids = chat_ids(tokenizer, PROMPTS[6])
    manager = model.init_continuous_batching(generation_config=GREEDY, continuous_batching_config=pages())
    manager.start()
    try:
        results, matched = {}, []
        for name in ("one", "two"):
            manager.add_request(ids, request_id=name, max_new_tokens=NEW_TOKENS)
            results[name] = manager.get_result(request_id=name, timeout=120)
            cache = manager.batch_processor.cache
            search = cache.search_prefix_match
            cache.search_prefix_match = lambda *args: matched.append(search(*args)) or matched[-1]
    finally:
        manager.stop(block=True, timeout=30)
        model.destroy_cached_continuous_batching_manager()
    assert matched and matched[0] >= 16  # at least one block of 16 tokens
    for name in ("one", "two"):
        check_top5(model, tokenizer, ids, results[name].generated_tokens, QuantizedFP8Cache(model, scales="dynamic"))


@pytest.mark.parametrize("blocks, requests", [(8, REQUESTS), (32, 2)])
def test_tight_budget_queues_and_completes_every_request(model_and_tokenizer, blocks, requests):
    """8 blocks of 16 tokens (with 16 recent tokens, whose pages take no block: two or three of these requests at
    a time), or 2 request slots for the recent and sink tokens: the others wait, and every request gets the tokens
    of a roomy run. No prefix sharing: which request computes the shared chat-template prefix (and so holds its
    sink tokens) depends on the order the scheduler admits them, and a shared prefix is read from its codes (enough
    to flip a close first token)."""
    model, tokenizer = model_and_tokenizer
    inputs = [chat_ids(tokenizer, p) for p in PROMPTS[:6]]
    cb.enable(model, scales="dynamic", max_requests=REQUESTS, recent_tokens=16)
    roomy = model.generate_batch(inputs, generation_config=GREEDY, warmup=False,
                                 continuous_batching_config=pages(allow_block_sharing=False))  # fmt: skip
    cb.enable(model, scales="dynamic", max_requests=requests, recent_tokens=16)
    batch_sizes = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: batch_sizes.append(len(kwargs["cu_seq_lens_q"]) - 1), with_kwargs=True
    )
    try:
        tight = model.generate_batch(inputs, generation_config=GREEDY, warmup=False,
                                     continuous_batching_config=pages(num_blocks=blocks, allow_block_sharing=False))  # fmt: skip
    finally:
        hook.remove()
        cb.enable(model, scales="dynamic", max_requests=REQUESTS)
    assert max(batch_sizes) <= min(requests, len(inputs) - 1)
    assert [o.error for o in tight.values()] == [None] * len(inputs)
    assert [o.generated_tokens for o in tight.values()] == [o.generated_tokens for o in roomy.values()]


def test_preempted_requests_complete_with_the_same_tokens():
    """Requests that outgrow a tiny page budget while decoding are preempted (freed and recomputed: the CPU swap
    pool needs pinned memory, a GPU) and still give the tokens of a roomy run."""
    model = tiny_model("llama")
    cb.enable(model, scales="dynamic", max_requests=4, recent_tokens=4, sink_tokens=2)
    generator = torch.Generator().manual_seed(2)
    inputs = [torch.randint(3, 128, (6,), generator=generator).tolist() for _ in range(4)]
    greedy = GenerationConfig(max_new_tokens=14, do_sample=False, eos_token_id=-1, pad_token_id=0)

    def run(**config):
        manager = model.init_continuous_batching(generation_config=greedy, continuous_batching_config=pages(
            page_size=4, allow_block_sharing=False, **config))  # fmt: skip
        manager.warmup()  # builds the batch processor before the loop starts
        offloads = []
        offloading = manager.batch_processor.offloading_manager
        offload_requests = offloading.offload_requests
        offloading.offload_requests = lambda: offloads.append(1) or offload_requests()
        manager.start()
        try:
            ids = manager.add_requests(inputs)
            results = {}
            while len(results) < len(ids):
                result = manager.get_result(timeout=60)
                assert result is not None, "the manager stopped before every request finished"
                if result.is_finished():
                    results[result.request_id] = result
        finally:
            manager.stop(block=True, timeout=30)
            model.destroy_cached_continuous_batching_manager()
        return [results[i].generated_tokens for i in ids], len(offloads)

    roomy, _ = run()
    tight, preemptions = run(num_blocks=9)  # 4 blocks per finished request (its 4 recent tokens in none): 2 at a time
    cb.disable(model)
    assert preemptions > 0
    assert tight == roomy


def test_cancelled_request_releases_its_pages(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    manager = model.init_continuous_batching(generation_config=GREEDY, continuous_batching_config=pages())
    manager.start()
    try:
        long_id = manager.add_request(chat_ids(tokenizer, PROMPTS[2]), request_id="long", max_new_tokens=10_000)
        manager.cancel_request(long_id)
        manager.add_request(chat_ids(tokenizer, PROMPTS[0]), request_id="short", max_new_tokens=3)
        result = manager.get_result(request_id="short", timeout=120)
        while result is None or not result.is_finished():
            result = manager.get_result(request_id="short", timeout=120)
        assert result.error is None and len(result.generated_tokens) == 3
        cache = manager.batch_processor.cache
        assert all("long" not in allocator.block_table for allocator in cache.cache_allocators.values())
        assert "long" not in manager.batch_processor.scheduler.active_requests
    finally:
        manager.stop(block=True, timeout=30)
        model.destroy_cached_continuous_batching_manager()


def test_streaming_from_the_manager(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    ids = chat_ids(tokenizer, PROMPTS[0])
    expected = model.generate_batch([ids], generation_config=GREEDY, continuous_batching_config=pages(), warmup=False)
    manager = model.init_continuous_batching(generation_config=GREEDY, continuous_batching_config=pages())
    assert isinstance(manager, cb.FP8ContinuousBatchingManager)
    manager.start()
    try:
        manager.add_request(ids, request_id="streamed", max_new_tokens=NEW_TOKENS, streaming=True)
        seen = []
        for output in manager.request_id_iter("streamed"):
            seen.append(list(output.generated_tokens))
            if output.is_finished():
                break
        cache = manager.batch_processor.cache
    finally:
        manager.stop(block=True, timeout=30)
        model.destroy_cached_continuous_batching_manager()
    assert isinstance(cache, cb.FP8PagedAttentionCache)
    summary = cache.layer_summary()
    assert len(summary) == model.config.num_hidden_layers and summary[0]["storage"] == "fp8_e4m3"
    # 3 KV heads x (64 codes + a 4-byte scale), padded to 16 bytes; the dense cache's recent and sink tokens
    assert summary[0]["row_bytes"] == 208 and summary[0]["clipped"] == 0
    assert summary[0]["recent+sinks"] == cb.dense_default("recent_tokens") + cb.dense_default("sink_tokens")
    assert len(seen) > 1 and all(len(a) < len(b) for a, b in zip(seen, seen[1:]))
    assert seen[-1] == next(iter(expected.values())).generated_tokens


@pytest.mark.parametrize("scales, skip, variant", [("dynamic", (), "recent+sinks"), ("dynamic", (), "pure"),
                                                   (0.05, [1], "recent+sinks")])  # fmt: skip
def test_sliding_and_full_groups_match_generate(scales, skip, variant):
    """A tiny Qwen2 with a sliding layer (window 8, shorter than the prompts: the ring wraps) and a full layer."""
    model = tiny_model("qwen2", layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                       use_sliding_window=True, max_window_layers=0)  # fmt: skip
    assert model.config.layer_types == ["sliding_attention", "full_attention"]
    cb.enable(model, scales=scales, skip_layers=skip, max_requests=4, **VARIANTS[variant])
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (5, 13, 21)]
    outputs = model.generate_batch(inputs, generation_config=GREEDY, continuous_batching_config=pages(page_size=4),
                                   warmup=False)  # fmt: skip
    for ids, output in zip(inputs, outputs.values()):
        prompt = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        with torch.inference_mode():
            ref = model.generate(**prompt, max_new_tokens=NEW_TOKENS, do_sample=False, **cache_kwargs(QuantizedFP8Cache(
                model, scales=scales, skip_layers=skip, **VARIANTS[variant])))  # fmt: skip
        expected = ref[0, len(ids) :].tolist()  # generate stops at EOS, the batch (eos -1) goes on
        assert output.generated_tokens[: len(expected)] == expected
    cb.disable(model)


def in_turn(model, requests: dict[str, list[int]], new_tokens: dict[str, int] | None = None,
            **config) -> tuple[dict, dict, dict]:  # fmt: skip
    """Run `requests` one after the other through one manager (4-token pages; `new_tokens`: a request's, else
    NEW_TOKENS): each one's step logits `[new tokens, vocab]`, full-attention block table and prefix-cache match."""
    manager = model.init_continuous_batching(generation_config=GREEDY,
                                             continuous_batching_config=pages(page_size=4, **config))  # fmt: skip
    manager.warmup()  # builds the cache before the loop starts
    cache = manager.batch_processor.cache
    tables, matched, steps = {}, {}, []
    free, search = cache.free_blocks, cache.search_prefix_match
    blocks = cache.cache_allocators["full_attention"].block_table

    def free_blocks(request_id: str, *args) -> None:
        tables.setdefault(request_id, list(blocks.get(request_id, ())))
        free(request_id, *args)

    cache.free_blocks = free_blocks
    cache.search_prefix_match = lambda request_id, ids: matched.setdefault(request_id, search(request_id, ids))
    hook = model.lm_head.register_forward_hook(lambda module, args, out: steps.append(out[0, -1].float()))
    manager.start()
    logits = {}
    try:
        for request_id, ids in requests.items():
            steps.clear()
            count = (new_tokens or {}).get(request_id, NEW_TOKENS)
            manager.add_request(ids, request_id=request_id, max_new_tokens=count)
            assert manager.get_result(request_id=request_id, timeout=60).error is None
            logits[request_id] = torch.stack(steps)
    finally:
        hook.remove()
        manager.stop(block=True, timeout=30)
        model.destroy_cached_continuous_batching_manager()
    return logits, tables, matched


def generate_logits(model, ids: list[int], settings: dict) -> torch.Tensor:
    """`generate`'s logits for `ids` with `QuantizedFP8Cache(**settings)`, `[NEW_TOKENS, vocab]`."""
    with torch.inference_mode():
        ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             **cache_kwargs(QuantizedFP8Cache(model, **settings)), max_new_tokens=NEW_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, eos_token_id=None)  # fmt: skip
    return torch.stack(ref.logits)[:, 0].float()


HELD = dict(scales="dynamic", recent_tokens=4, sink_tokens=2)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_prefix_from_the_prefix_cache_keeps_its_sink_tokens(backend):
    """A second conversation over a cached prefix (2 whole pages of the first's prompt, then 6 tokens of its own,
    more than its 4 recent ones) reads the prefix's sink tokens in the model's dtype, copied from the first's: its
    logits are generate's with QuantizedFP8Cache, step by step (from their codes: 2e-3 off)."""
    model = tiny_model("llama").to(DEVICE)
    generator = torch.Generator().manual_seed(5)
    first = torch.randint(3, 128, (13,), generator=generator).tolist()
    second = first[:8] + torch.randint(3, 128, (6,), generator=generator).tolist()
    cb.enable(model, backend=backend, max_requests=2, **HELD)
    try:
        logits, _, matched = in_turn(model, {"first": first, "second": second})
    finally:
        cb.disable(model)
    assert matched == {"first": 0, "second": 8}
    torch.testing.assert_close(logits["second"], generate_logits(model, second, HELD), rtol=0, atol=1e-5)


def test_kept_sink_tokens_follow_the_prompt_not_the_block():
    """The kept sink tokens are those of the prompt's first tokens, not of a block: a block that held another
    prompt's first page (its first token encoded, the page never whole: freed, not cached), reused for a new
    prompt, gives a later conversation over that new prompt its own sink tokens (generate's logits), not the
    other prompt's."""
    model = tiny_model("llama")
    generator = torch.Generator().manual_seed(5)
    other = torch.randint(3, 128, (5,), generator=generator).tolist()
    first = torch.randint(3, 128, (13,), generator=generator).tolist()
    second = first[:8] + torch.randint(3, 128, (6,), generator=generator).tolist()
    cb.enable(model, max_requests=2, **HELD)
    try:
        # 6 blocks, one token for the other prompt: the first prompt's first page goes to the block of the other's
        logits, tables, matched = in_turn(model, {"other": other, "first": first, "second": second}, {"other": 1},
                                          num_blocks=6)  # fmt: skip
    finally:
        cb.disable(model)
    assert tables["other"][0] == tables["first"][0] == tables["second"][0] and matched["second"] == 8
    torch.testing.assert_close(logits["second"], generate_logits(model, second, HELD), rtol=0, atol=1e-5)


def test_sink_rows_come_from_a_live_or_kept_request_with_the_same_first_tokens():
    """A request starting past position 0 gets its sink rows from a live request with its first tokens, else from
    those kept at release (as many prompts as slots, least recently used first out), else none (its codes)."""
    slots = RequestSlots(recent=2, sinks=2, slots=2)
    rows = torch.zeros(2 * 4, 2, 1, 1)
    slots.add_layer(rows, sinks=2)
    slots.add_layer(torch.zeros(2 * 2, 2, 1, 1), sinks=0)  # a sliding layer: no sink rows

    def computed(request_id: str, tokens: list[int], value: float) -> None:
        """Admit a request at position 0 and run its first step (its sink rows: `value`)."""
        assert slots.admit(request_id, tokens, 0)
        slots.schedule(request_id, 0, len(tokens), object())
        slots.start_step()
        base = slots.held[request_id].slot * 4 + 2
        rows[base : base + 2] = value

    def sinks_of(request_id: str, tokens: list[int]) -> list[float] | None:
        """Admit a request past position 0: its sink rows, None when it got none."""
        assert slots.admit(request_id, tokens, 8)
        base = slots.held[request_id].slot * 4 + 2
        return rows[base : base + 2, 0, 0, 0].tolist() if slots.held[request_id].sinks else None

    computed("a", [5, 6, 7], 1.0)
    assert sinks_of("b", [5, 6, 9]) == [1.0, 1.0]  # from live "a"
    slots.release("a"), slots.release("b")
    computed("c", [1, 2], 3.0)
    slots.release("c")  # kept: [5, 6] and [1, 2]
    assert sinks_of("d", [5, 6]) == [1.0, 1.0]  # kept ([5, 6] now the most recently used)
    slots.release("d")
    computed("e", [8, 8], 4.0)
    slots.release("e")  # [1, 2] makes room
    assert sinks_of("f", [1, 2, 3]) is None and sinks_of("g", [8, 8]) == [4.0, 4.0]


@pytest.mark.parametrize("kind, dtype", [
    ("static", torch.float32), ("per-token", torch.float32), ("per-token int8", torch.bfloat16),
    ("per-token sliding", torch.float32), ("per-token sliding", torch.bfloat16),
])  # fmt: skip
def test_per_channel_key_scales_match_generate(kind, dtype):
    """Per-channel key scales with calibrated static scales or per-token ones (keys stored divided by them, read
    back multiplied; with recent tokens, divided when they leave them: the same bits, the scales being powers of
    two), on a sliding layer too (window 8, the ring wrapping): the batch's logits are generate's with
    QuantizedFP8Cache, step by step."""
    model = tiny_model("llama") if "sliding" not in kind else tiny_model(
        "qwen2", layer_types=["sliding_attention", "full_attention"], sliding_window=8, use_sliding_window=True,
        max_window_layers=0,
    )  # fmt: skip
    model = model.to(dtype)
    generator = torch.Generator().manual_seed(4)
    # [kv_heads, head_dim], powers of two as calibrate writes them: the dense layers' recent keys, held divided by
    # them, are the pages' (held as they came) to the bit
    channel = 2.0 ** torch.randint(-2, 1, (2, 16), generator=generator)
    scales = KVScales(key={0: torch.tensor(0.02), 1: torch.tensor(0.03)}, value={0: torch.tensor(0.01),
                      1: torch.tensor(0.02)}, key_channel={0: channel, 1: channel * 2})  # fmt: skip
    settings = dict(scales=scales)
    if kind != "static":
        settings = dict(scales=KVScales(dynamic=True, key_channel=scales.key_channel))
        if kind.endswith("int8"):
            settings["kv_cache_dtype"] = "int8_per_token_head"
    ids = torch.randint(3, 128, (9,), generator=generator).tolist()
    for held in (PURE_FP8, dict(recent_tokens=4, sink_tokens=2)):
        batch, ref = batch_and_generate_logits(model, ids, dict(settings, **held))
        assert torch.allclose(batch, ref, atol=1e-5 if dtype == torch.float32 else 0.02, rtol=0)


@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("kind", ["llama", "sliding"])
def test_recent_and_sink_tokens_give_generates_logits(kind, rotate):
    """Recent and sink tokens on the pages (4 + 2, a 13-token prompt and 8 more: tokens leave the recent ones
    while decoding; on the sliding layer (window 8) the ring wraps): the batch's logits are generate's with
    QuantizedFP8Cache of the same recent and sink tokens (and rotated codes or not: up to fp32 rounding), step by
    step; pure FP8 pages give others."""
    model = tiny_model("llama") if kind == "llama" else tiny_model(
        "qwen2", layer_types=["sliding_attention", "full_attention"], sliding_window=8, use_sliding_window=True,
        max_window_layers=0,
    )  # fmt: skip
    ids = torch.randint(3, 128, (13,), generator=torch.Generator().manual_seed(5)).tolist()
    held = dict(scales="dynamic", recent_tokens=4, sink_tokens=2, rotate=rotate)
    batch, ref = batch_and_generate_logits(model, ids, held)
    if rotate:  # the dense cache's torch path attends in the rotated space, the pages' rotates their codes back
        torch.testing.assert_close(batch, ref, rtol=0, atol=1e-5)
    else:
        assert torch.equal(batch, ref)
    pure, _ = batch_and_generate_logits(model, ids, dict(scales="dynamic", rotate=rotate, **PURE_FP8))
    assert (pure - ref).abs().max() > 1e-3


def batch_and_generate_logits(model, ids: list[int], settings: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The last-position logits of each step of `generate_batch` (FP8 pages with `settings`) and of `generate`
    with `QuantizedFP8Cache(**settings)`, `[NEW_TOKENS, vocab]` each."""
    return batch_logits(model, ids, settings), generate_logits(model, ids, settings)


def batch_logits(model, ids: list[int], settings: dict) -> torch.Tensor:
    """The last-position logits of each step of `generate_batch` (FP8 pages with `settings`), `[NEW_TOKENS, vocab]`."""
    cb.enable(model, max_requests=1, **settings)
    logits = []
    hook = model.lm_head.register_forward_hook(lambda module, args, out: logits.append(out[0, -1].float()))
    try:
        model.generate_batch([ids], generation_config=GREEDY, continuous_batching_config=pages(page_size=4),
                             warmup=False)  # fmt: skip
    finally:
        hook.remove()
        cb.disable(model)
    return torch.stack(logits[:NEW_TOKENS])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_rotation_leaves_a_window_over_every_token_unchanged(backend):
    """Every token among the held ones (recent 32 + sinks 2 over a 9-token prompt and its new tokens): no code is
    read, and rotated pages give the unrotated ones' logits, bit for bit."""
    model = tiny_model("llama").to(DEVICE)
    ids = torch.randint(3, 128, (9,), generator=torch.Generator().manual_seed(6)).tolist()
    held = dict(scales="dynamic", recent_tokens=32, sink_tokens=2, backend=backend)
    assert torch.equal(*(batch_logits(model, ids, dict(held, rotate=rotate)) for rotate in (False, True)))


@pytest.mark.parametrize("backend, scales, dtype", [
    ("torch", "dynamic", torch.float32), ("triton", "dynamic", torch.float32), ("torch", 0.05, torch.bfloat16),
    ("triton", 0.05, torch.float32),
])  # fmt: skip
def test_each_token_is_stored_once(backend, scales, dtype):
    """Recent and sink tokens on the pages (4 + 2, 4-token pages): at every step a request holds a block from the
    pool only for the pages with a token older than its 4 newest (the others are VIRTUAL_BLOCK, after them), nothing
    is written to the never-allocated block behind them, and the logits are generate's with QuantizedFP8Cache,
    step by step, prompts shorter and longer than the recent tokens."""
    model = tiny_model("llama").to(DEVICE, dtype)
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (3, 13)]
    held = dict(scales=scales, recent_tokens=4, sink_tokens=2)
    cb.enable(model, backend=backend, max_requests=2, **held)
    manager = model.init_continuous_batching(generation_config=GREEDY, continuous_batching_config=pages(page_size=4))
    manager.warmup()
    cache = manager.batch_processor.cache
    allocator = cache.cache_allocators["full_attention"]
    allocate, tables = allocator.allocate_cache_to_request, []

    def recorded(request_id: str, past: int, new: int) -> None:
        allocate(request_id, past, new)
        tables.append((past + new, list(allocator.block_table[request_id])))

    allocator.allocate_cache_to_request = recorded
    manager.start()
    try:
        for i, ids in enumerate(inputs):
            logits = []
            hook = model.lm_head.register_forward_hook(lambda module, args, out: logits.append(out[0, -1].float()))
            manager.add_request(ids, request_id=str(i), max_new_tokens=NEW_TOKENS)
            assert manager.get_result(request_id=str(i), timeout=60).error is None
            hook.remove()
            torch.testing.assert_close(torch.stack(logits), generate_logits(model, ids, held).to(DEVICE), rtol=0,
                                       atol=1e-5)  # fmt: skip
        trash = cache.cache_tensor[: cache.bytes_per_sector]
        assert not trash.any()
    finally:
        manager.stop(block=True, timeout=30)
        model.destroy_cached_continuous_batching_manager()
        cb.disable(model)
    assert len(tables) == 2 * NEW_TOKENS
    for end, table in tables:
        coded = -(-max(end - 4, 0) // 4)  # pages with a token older than the 4 newest
        assert len(table) == -(-end // 4) and table[coded:] == [cb.VIRTUAL_BLOCK] * (len(table) - coded)
        assert cb.VIRTUAL_BLOCK not in table[:coded], (end, table)


def test_forked_requests_copy_the_recent_and_sink_tokens():
    """Parallel sampling (3 sequences per prompt, top-1 sampling): forked children get a copy of their parent's recent
    and sink tokens, children beyond the free slots are prefilled anew; every sequence is the single run's."""
    model = tiny_model("llama")
    generator = torch.Generator().manual_seed(6)
    inputs = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (7, 10)]
    cb.enable(model, scales="dynamic", recent_tokens=4, sink_tokens=2, max_requests=4)
    try:
        single = model.generate_batch(inputs, generation_config=GREEDY, warmup=False,
                                      continuous_batching_config=pages(page_size=4))  # fmt: skip
        # sampling from the top token only: greedy, which GenerationConfig refuses with several sequences
        three = GenerationConfig(**{**GREEDY.to_diff_dict(), "num_return_sequences": 3, "do_sample": True, "top_k": 1})
        forked = model.generate_batch(inputs, generation_config=three, warmup=False,
                                      continuous_batching_config=pages(page_size=4))  # fmt: skip
    finally:
        cb.disable(model)
    expected = {request_id: output.generated_tokens for request_id, output in single.items()}
    assert len(forked) == 6
    for request_id, output in forked.items():
        assert output.generated_tokens == expected[request_id.split("__child#")[0]], request_id


OUTLIERS = dict(scales="dynamic", recent_tokens=4, sink_tokens=2, outlier_tokens=2)


def llama_or_hybrid(kind: str):
    """A tiny Llama, or ("sliding") a hybrid Qwen2 whose first layer slides over 8 tokens, on the test device."""
    model = tiny_model("llama") if kind == "llama" else tiny_model(
        "qwen2", layer_types=["sliding_attention", "full_attention"], sliding_window=8, use_sliding_window=True,
        max_window_layers=0,
    )  # fmt: skip
    return model.to(DEVICE)


@pytest.mark.parametrize("backend, kind, rotate", [("torch", "llama", False), ("triton", "llama", False),
                                                   ("torch", "llama", True), ("torch", "sliding", False),
                                                   ("triton", "sliding", False)])  # fmt: skip
def test_outlier_tokens_give_generates_logits(backend, kind, rotate):
    """Outlier tokens on the pages (2 per KV head beside recent 4 + sinks 2; a 13-token prompt and 8 more: tokens
    get codes in the prefill and while decoding; the hybrid model's sliding layer, window 8, drops those a window
    behind): the batch's logits are generate's with QuantizedFP8Cache of the same settings, step by step (the
    torch path's bit for bit; rotated codes, the Triton kernel: up to fp32 rounding), and not those without
    outlier tokens."""
    model = llama_or_hybrid(kind)
    ids = torch.randint(3, 128, (13,), generator=torch.Generator().manual_seed(5)).tolist()
    settings = dict(OUTLIERS, backend=backend, rotate=rotate)
    batch, ref = batch_and_generate_logits(model, ids, settings)
    if backend == "torch" and not rotate:
        assert torch.equal(batch, ref.to(batch.device))
    else:
        torch.testing.assert_close(batch, ref.to(batch.device), rtol=0, atol=1e-5)
    plain = generate_logits(model, ids, dict(settings, outlier_tokens=0))
    assert (plain - ref).abs().max() > 1e-3


SEARCHED = dict(scales="dynamic", scale_search=16)


@pytest.mark.parametrize("backend, held, kind", [
    ("torch", PURE_FP8, "llama"), ("torch", HELD, "llama"), ("triton", HELD, "llama"),
    ("torch", dict(HELD, rotate=True, outlier_tokens=2), "llama"), ("triton", HELD, "sliding"),
], ids=str)  # fmt: skip
def test_searched_scales_give_generates_logits(backend, held, kind):
    """Per-token scales searched among 16 on the pages (pure FP8, the window, rotated with outlier tokens, a hybrid
    model's sliding layer of window 8; a 13-token prompt and its new tokens): one request's logits are generate's
    with QuantizedFP8Cache of the same settings, step by step (the layer's query sums are that request's alone;
    the torch path bit for bit, the Triton kernels to fp32 rounding), and not those without the search."""
    model = llama_or_hybrid(kind)
    ids = torch.randint(3, 128, (13,), generator=torch.Generator().manual_seed(9)).tolist()
    settings = dict(held, **SEARCHED, backend=backend)
    batch, ref = batch_and_generate_logits(model, ids, settings)
    if backend == "torch":
        assert torch.equal(batch, ref.to(batch.device))
    else:  # (a query an fp32 rounding apart can move a channel's weight, so a token's scale: 3e-5 seen)
        torch.testing.assert_close(batch, ref.to(batch.device), rtol=0, atol=1e-4)
    assert (generate_logits(model, ids, dict(settings, scale_search=0)) - ref).abs().max() > 1e-3


def kept_outliers(monkeypatch) -> dict[str, list]:
    """Record, as each request releases its slot, its outlier positions: request id -> per layer with outlier
    tokens, per KV head, the set of positions kept."""
    kept, release = {}, RequestSlots.release

    def released(self, request_id: str) -> None:
        held = self.held.get(request_id)
        if held is not None:
            kept[request_id] = [[{t for t in head.tolist() if t >= 0} for head in layer.outliers.positions[held.slot]]
                                for layer in self.layers if layer.outliers is not None]  # fmt: skip
        release(self, request_id)

    monkeypatch.setattr(RequestSlots, "release", released)
    return kept


def test_kept_outlier_tokens_are_the_dense_caches(monkeypatch):
    """Two requests of different lengths in one batch (4-token pages): each keeps, per layer and KV head, the
    positions QuantizedFP8Cache keeps for its prompt alone."""
    model = tiny_model("llama")
    generator = torch.Generator().manual_seed(7)
    inputs = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (13, 21)]
    kept = kept_outliers(monkeypatch)
    cb.enable(model, max_requests=2, **OUTLIERS)
    try:
        outputs = model.generate_batch(inputs, generation_config=GREEDY,
                                       continuous_batching_config=pages(page_size=4), warmup=False)  # fmt: skip
    finally:
        cb.disable(model)
    assert len(kept) == len(outputs) == 2
    for request_id, output in outputs.items():
        ids = output.prompt_ids
        cache = QuantizedFP8Cache(model, **OUTLIERS)
        with torch.inference_mode():
            model.generate(torch.tensor([ids]), **cache_kwargs(cache), max_new_tokens=NEW_TOKENS, do_sample=False,
                           eos_token_id=None)  # fmt: skip
        dense = [[{t for t in head.tolist() if t >= 0} for head in layer.outlier_pos[0, 0]] for layer in cache.layers]
        assert kept[request_id] == dense and all(len(head) == 2 for layer in dense for head in layer)


def test_a_slot_taken_again_or_over_a_cached_prefix_starts_with_no_outlier_tokens(monkeypatch):
    """One slot, three conversations in turn: the second (another prompt) gets generate's logits, none of the
    first's outlier tokens; the third, over 2 cached pages of the second's prompt, keeps only tokens it computed."""
    model = tiny_model("llama")
    generator = torch.Generator().manual_seed(8)
    first = torch.randint(3, 128, (13,), generator=generator).tolist()
    second = torch.randint(3, 128, (15,), generator=generator).tolist()
    third = second[:8] + torch.randint(3, 128, (9,), generator=generator).tolist()
    kept = kept_outliers(monkeypatch)
    cb.enable(model, max_requests=1, **OUTLIERS)
    try:
        logits, _, matched = in_turn(model, {"first": first, "second": second, "third": third})
    finally:
        cb.disable(model)
    assert matched == {"first": 0, "second": 0, "third": 8}
    assert torch.equal(logits["second"], generate_logits(model, second, OUTLIERS))
    assert kept["third"] and all(t >= 8 for layer in kept["third"] for head in layer for t in head)


def test_outlier_sets_follow_their_slot():
    """A slot's outlier set (rows, positions, scores, norm sums) is copied to a forked child's slot, and a request
    taking a released slot starts with an empty one."""
    slots = RequestSlots(recent=2, sinks=0, slots=2)
    rows = torch.zeros(2 * 4, 2, 1, 1)
    outliers = slots.add_layer(rows, sinks=0, outliers=2).outliers
    assert slots.admit("a", [1], 0)
    a = slots.held["a"].slot
    outliers.positions[a], outliers.scores[a], outliers.norms[:, a] = 5, 1.0, 3.0
    rows[a * 4 + 2 : a * 4 + 4] = 7.0
    assert slots.fork("a", ["b"]) == ["b"]
    b = slots.held["b"].slot
    assert (outliers.positions[b] == 5).all() and (outliers.scores[b] == 1).all() and (outliers.norms[:, b] == 3).all()
    assert (rows[b * 4 + 2 : b * 4 + 4] == 7).all()
    slots.release("a")
    assert slots.admit("c", [2], 0) and slots.held["c"].slot == a
    assert (outliers.positions[a] == -1).all() and (outliers.scores[a] == -math.inf).all()
    assert (outliers.norms[:, a] == 0).all() and (outliers.positions[b] == 5).all()


@pytest.mark.parametrize("page_size, window", [(4, 8), (16, 16)])
@pytest.mark.parametrize("scales, variant", [(scales, variant) for scales in ("dynamic", 0.05) for variant in VARIANTS]
                         + [("dynamic", variant) for variant in ROTATED])  # fmt: skip
def test_triton_backend_reads_the_same_pages(scales, page_size, window, variant):
    """The Triton paged kernel (the interpreter here, CUDA on a GPU) through the whole batch: the torch path's
    logits at every step, on a sliding layer (its ring of slots wraps: pure FP8 reads it from the codes) and a
    full layer; 4-token pages read token by token, 16-token ones in tiles of consecutive slots; rotated codes."""
    model = tiny_model("qwen2", layer_types=["sliding_attention", "full_attention"], sliding_window=window,
                       use_sliding_window=True, max_window_layers=0).to(DEVICE)  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (3, 11, 19, 37)]
    logits = {}
    for backend in ("torch", "triton"):
        cb.enable(model, scales=scales, backend=backend, max_requests=4, **{**VARIANTS, **ROTATED}[variant])
        steps = []
        hook = model.lm_head.register_forward_hook(lambda module, args, out: steps.append(out[0].float().cpu()))
        try:
            model.generate_batch(inputs, generation_config=GREEDY,
                                 continuous_batching_config=pages(page_size=page_size), warmup=False)  # fmt: skip
        finally:
            hook.remove()
        logits[backend] = torch.cat(steps)
    cb.disable(model)
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("settings", [dict(recent_tokens=8, sink_tokens=2), dict(ROTATED["pure, rotated"])], ids=str)
def test_split_decode_steps_read_the_same_pages(monkeypatch, settings):
    """Decode steps split over the keys (3 ways: the Triton kernel's flash-decoding, then its reduce) through the
    whole batch give the torch path's logits; every call's `max_k_len` (transformers' `max_length_k`, which the
    split rule reads on a GPU) covers each request's keys."""
    from hf_fp8kv.kernels import triton_paged

    plain, bounds = triton_paged.paged_attention, []

    def split_three_ways(query, pages, new_rows, read_index, cu_q, k_first, past, *, max_k_len=None, **kwargs):
        bounds.append((max_k_len, int((past + cu_q[1:] - cu_q[:-1]).max())))
        return plain(query, pages, new_rows, read_index, cu_q, k_first, past, max_k_len=max_k_len, num_splits=3,
                     **kwargs)  # fmt: skip

    model = tiny_model("qwen2", layer_types=["sliding_attention", "full_attention"], sliding_window=16,
                       use_sliding_window=True, max_window_layers=0).to(DEVICE)  # fmt: skip
    generator = torch.Generator().manual_seed(2)
    inputs = [torch.randint(3, 128, (n,), generator=generator).tolist() for n in (5, 40, 70)]
    logits = {}
    for backend in ("torch", "triton"):
        cb.enable(model, scales="dynamic", backend=backend, max_requests=4, **settings)
        steps = []
        hook = model.lm_head.register_forward_hook(lambda module, args, out: steps.append(out[0].float().cpu()))
        try:
            with monkeypatch.context() as patch:
                patch.setattr(triton_paged, "paged_attention", split_three_ways)
                model.generate_batch(inputs, generation_config=GREEDY,
                                     continuous_batching_config=pages(page_size=16), warmup=False)  # fmt: skip
        finally:
            hook.remove()
        logits[backend] = torch.cat(steps)
    cb.disable(model)
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=1e-4, atol=1e-4)
    assert bounds and all(bound is not None and bound >= keys for bound, keys in bounds)


def test_fp8_pages_hold_twice_the_blocks_of_bf16_pages(monkeypatch, caplog):
    """Under one memory setting (transformers' max_memory_percent), FP8 pages give >= 1.9x the blocks of
    transformers' bf16 pages, and the scheduler admits correspondingly more requests."""
    from transformers.generation.continuous_batching import cache
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    model, _ = smollm2()
    config = model.config
    # a fixed host (the process's own memory moves as caches are allocated): 256 MiB for the cache, where the fixed
    # reservations (activations of 16 batch tokens, one request's fp32 read) stay small
    monkeypatch.setattr(cache, "get_device_and_memory_breakdown", lambda: (torch.device("cpu"), 2**30, 0, 0))
    setting = dict(page_size=16, max_batch_tokens=16, max_memory_percent=0.25)
    helper = DistributedHelper(device_mesh=None, cpu_group_timeout=None)
    native = cache.PagedAttentionCache(config, ContinuousBatchingConfig(**setting), "cpu", helper, dtype=torch.bfloat16)
    for scales, least in (("dynamic", 1.9), (0.05, 2.0)):
        settings = cb.enable(model, scales=scales, **PURE_FP8)
        with caplog.at_level("INFO", logger="hf_fp8kv.continuous_batching"):
            fp8 = cb.FP8PagedAttentionCache(settings, config, ContinuousBatchingConfig(**setting), "cpu", helper,
                                            dtype=torch.bfloat16)  # fmt: skip
        assert f"{fp8.capacity_ratio:.2f}x the tokens" in caplog.text
        assert fp8.num_blocks >= least * native.num_blocks
        assert fp8.native_num_blocks == native.num_blocks and fp8.capacity_ratio == fp8.num_blocks / native.num_blocks
        request = {name: 4 for name in fp8.cache_allocators}  # 64-token requests
        admitted = fp8.count_storable_requests([request] * 10_000)
        assert admitted >= least * native.count_storable_requests([request] * 10_000)
        del fp8
    # with the recent and sink tokens of the requests in flight (an eighth of the memory) still 1.7x
    settings = cb.enable(model, scales="dynamic")
    fp8 = cb.FP8PagedAttentionCache(settings, config, ContinuousBatchingConfig(**setting), "cpu", helper,
                                    dtype=torch.bfloat16)  # fmt: skip
    assert fp8.num_blocks >= 1.7 * native.num_blocks
    # an eighth of the 256 MiB in requests of 128 + 4 tokens x 30 layers x K, V x 3 heads x 64 in the model's fp32
    assert fp8.request_slots.slots == 2**28 // 8 // (132 * 30 * 2 * 3 * 64 * 4) == 5
    # each token once: a request in flight holds its 128 recent tokens (8 pages) in its rows and in no block
    assert fp8.stored_once_blocks == 5 * 8
    assert fp8.capacity_ratio == (fp8.num_blocks + 40) / native.num_blocks
    cb.disable(model)


def test_cpu_swap_is_turned_off_where_each_token_is_stored_once():
    """A CPU swap of a request's pages would lose its recent tokens, held in its rows only: asked for with them,
    it is turned off with a warning (preempted requests are computed again); pure FP8 pages keep it."""
    model = tiny_model("llama")
    cb.enable(model, scales="dynamic")
    with pytest.warns(UserWarning, match=r"cpu_offload_space=1.0 is turned off: FP8 pages with recent tokens"):
        manager = model.init_continuous_batching(continuous_batching_config=pages(cpu_offload_space=1.0))
    assert manager.continuous_batching_config.cpu_offload_space == 0
    model.destroy_cached_continuous_batching_manager()
    cb.enable(model, scales="dynamic", **PURE_FP8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        manager = model.init_continuous_batching(continuous_batching_config=pages(cpu_offload_space=1.0))
    assert manager.continuous_batching_config.cpu_offload_space == 1.0
    cb.disable(model)


def test_enabled_model_pickles_and_serves_after_loading():
    model = tiny_model("llama")
    cb.enable(model, scales="dynamic")
    loaded = pickle.loads(pickle.dumps(model))
    assert isinstance(loaded.init_continuous_batching, cb.FP8InitContinuousBatching)
    assert loaded.init_continuous_batching.model is loaded
    ids = torch.randint(3, 128, (7,), generator=torch.Generator().manual_seed(1)).tolist()
    outputs = [m.generate_batch([ids], generation_config=GREEDY, continuous_batching_config=pages(page_size=4),
                                warmup=False) for m in (model, loaded)]  # fmt: skip
    assert [o.generated_tokens for o in outputs[0].values()] == [o.generated_tokens for o in outputs[1].values()]
    cb.disable(model)


def test_bad_input_errors(monkeypatch):
    cb.check_transformers_version()  # the installed transformers is one of those verified
    with monkeypatch.context() as patch:  # an internal whose source is not one of those verified
        patch.setitem(cb.VERIFIED_INTERNALS, "PagedAttentionCache.update", set())
        with pytest.raises(RuntimeError, match=r"is installed: its continuous-batching PagedAttentionCache.update"):
            cb.enable(tiny_model("llama"), scales="dynamic")
    model = tiny_model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="flash_attention_2"):
        cb.enable(model, scales="dynamic")
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="recent_tokens=-4"):
        cb.enable(model, scales="dynamic", recent_tokens=-4)
    with pytest.raises(ValueError, match="rotate=True with static scales"):
        cb.enable(model, scales=0.05, rotate=True)
    with pytest.raises(ValueError, match=r"outlier_tokens=4 needs per-token scales \(scales='dynamic'\)"):
        cb.enable(model, scales=0.05, outlier_tokens=4)
    with pytest.raises(ValueError, match="outlier_tokens=4 on FP8 pages needs recent_tokens"):
        cb.enable(model, scales="dynamic", recent_tokens=0, sink_tokens=2, outlier_tokens=4)
    with pytest.raises(ValueError, match=r"scale_search=16 needs per-token scales \(scales='dynamic'\)"):
        cb.enable(model, scales=0.05, scale_search=16)
    with pytest.raises(ValueError, match="scale_search=3"):
        cb.enable(model, scales="dynamic", scale_search=3)
    with pytest.raises(ValueError, match="max_requests=0"):
        cb.enable(model, scales="dynamic", max_requests=0)
    with pytest.raises(ValueError, match="skip_layers"):
        cb.enable(model, scales="dynamic", skip_layers=[7])
    with pytest.raises(ValueError, match="kv_cache_dtype='fp4'"):
        cb.enable(model, kv_cache_dtype="fp4")
    with pytest.warns(UncalibratedScalesWarning):
        cb.enable(model)  # no checkpoint scales: 1.0, as QuantizedFP8Cache warns
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cb.enable(model, scales="dynamic")  # enabling again replaces the settings
    cb.disable(model)
    assert "init_continuous_batching" not in model.__dict__ and model.config._attn_implementation == "sdpa"
