"""`hf-fp8kv serve` against a live server on 127.0.0.1, started by this module in a thread (a tiny random Llama
with SmolLM2's tokenizer: fast on 2 CPU cores) and driven by the `openai` client: concurrent streams under
vLLM's top-5 rule, dropped streams, bad requests, a request arriving while the pages are full."""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai", reason="the serving extra: pip install hf-fp8kv[serve]")
pytest.importorskip("fastapi", reason="the serving extra: pip install hf-fp8kv[serve]")
pytest.importorskip("transformers.cli.serve", reason="this transformers has no `transformers serve`")

from hf_fp8kv import QuantizedFP8Cache  # noqa: E402
from hf_fp8kv.evaluate import greedy_with_logits, topk_rule  # noqa: E402
from hf_fp8kv.serving.server import page_state  # noqa: E402
from tests.models import tiny_model  # noqa: E402
from tests.prompts import PROMPTS  # noqa: E402

NAME = "tiny-fp8"
PAGE_SIZE, NUM_BLOCKS = 16, 48  # 768 tokens of pages, below the model's context of 2048
LONG_WORDS = 460  # a long prompt's words: two such chats of 100 new tokens outgrow the pages together, one does not
REQUEST_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """The server, its model and tokenizer, and what each request got: prompt ids and generated ids by id."""

    def __init__(self, server, model, port: int):
        self.server, self.model, self.port = server, model, port
        self.prompts: dict[str, list[int]] = {}
        self.generated: dict[str, list[int]] = {}
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                    timeout=REQUEST_TIMEOUT_S, max_retries=0)  # fmt: skip
        cb = server.manager._cb
        add, register = cb.add_request, cb.register_result_handler

        def add_request(input_ids, request_id=None, **kwargs):
            request_id = add(input_ids, request_id=request_id, **kwargs)
            self.prompts[request_id] = list(input_ids)
            return request_id

        def register_result_handler(request_id, handler):
            def record(output):
                self.generated[request_id] = list(output.generated_tokens)
                handler(output)

            register(request_id, record)

        cb.add_request, cb.register_result_handler = add_request, register_result_handler

    def get(self, path: str) -> tuple[int, dict]:
        return self.request("GET", path)

    def request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, json.loads(response.read())
        finally:
            connection.close()

    def pages(self) -> dict:
        return self.get("/fp8kv/pages")[1]

    def wait_until(self, condition, what: str, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.pages()
            if condition(state):
                return state
            time.sleep(0.05)
        raise AssertionError(f"{what} not reached in {timeout} s: {self.pages()}")

    def chat(self, prompt: str, max_tokens: int) -> tuple[str, str, str]:
        """A streamed greedy chat: (request id, text, finish reason)."""
        stream = self.client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, stream=True
        )
        parts, finish, request_id = [], None, None
        for chunk in stream:
            request_id = chunk.id
            for choice in chunk.choices:
                parts.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        return request_id, "".join(parts), finish

    def check_top5(self, request_id: str) -> None:
        """vLLM's top-5 rule for a served greedy output against `generate` with `QuantizedFP8Cache` (the server's
        configuration: dynamic scales, the default recent and sink tokens) for its prompt alone: where they first
        differ, the served token is among generate's top 5 (they share the prefix up to there)."""
        ids, served = self.prompts[request_id], self.generated[request_id]
        assert served, request_id
        inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        with torch.inference_mode():
            tokens, logits = greedy_with_logits(self.model, inputs, QuantizedFP8Cache(self.model, scales="dynamic"),
                                                len(served))  # fmt: skip
        at, ok = topk_rule(tokens[0], logits[0], torch.tensor(served), logits[0])
        assert ok, f"{request_id}: the served token at {at} is not in generate's top 5"


IDLE = dict(blocks_in_use=0, slots_in_use=0, active_requests=0, waiting_requests=0, stream_handlers=0,
            unclaimed_outputs=0, block_new_requests=False)


def is_idle(state: dict) -> bool:
    return (all(state[key] == value for key, value in IDLE.items()) and state["free_slots"] == state["request_slots"]
            and state["worker_alive"])  # fmt: skip


@pytest.fixture(scope="module")
def served():
    from hf_fp8kv import continuous_batching
    from hf_fp8kv.bundled import smollm2_dir
    from hf_fp8kv.serving import FP8Options, serve_model
    from hf_fp8kv.serving.server import check_transformers_serve
    from transformers import AutoTokenizer

    try:
        check_transformers_serve()
    except RuntimeError as error:  # another transformers: continuous batching's own tests check the error
        pytest.skip(str(error))
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=2048)
    port = free_port()
    server = serve_model(model, tokenizer, NAME, FP8Options(max_requests=16), port=port, cb_block_size=PAGE_SIZE,
                         cb_num_blocks=NUM_BLOCKS)  # fmt: skip
    try:
        served = Served(server, model, port)
        deadline = time.monotonic() + 30
        while True:
            try:
                if served.get("/health")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not answer /health in 30 s"
            time.sleep(0.1)
        yield served
    finally:
        server.kill_server()
        continuous_batching.disable(model)


def test_the_server_reports_its_fp8_pages(served):
    state = served.pages()
    assert state["kv_format"] == "fp8_e4m3" and state["page_size"] == PAGE_SIZE
    assert state["num_blocks"] == NUM_BLOCKS and state["request_slots"] == 16
    # the same bytes in pages of the model's dtype (fp32): 48 FP8 blocks of 3072 bytes (2 layers x K, V x 16 rows
    # of 2 heads x (16 codes + a 4-byte scale), padded to 48) and 16 requests' 132 recent and sink tokens and 16
    # prompts' 4 kept sink tokens in fp32 (512 bytes each: 2 layers x K, V x 2 heads x 16 x 4 bytes), in fp32 blocks
    # of 8192 bytes; at this toy head_dim the held tokens outweigh the pages
    assert state["native_num_blocks"] == (48 * 3072 + 16 * (132 + 4) * 512) // 8192
    assert [m.id for m in served.client.models.list().data] == [NAME]


def test_the_default_pages_hold_over_1_72x_the_tokens_of_bf16_pages():
    """`hf-fp8kv serve --dtype bfloat16 --kv-memory-mib 256` (the CPU's default) on the bundled SmolLM2, every
    other option its default (recent 128 + sinks 4, 16-token pages): blocks and the requests' rows together hold
    >= 1.72x the tokens of bf16 pages in the same memory, each token once, as the startup line says."""
    from types import SimpleNamespace

    from hf_fp8kv import continuous_batching
    from hf_fp8kv.bundled import load_smollm2
    from hf_fp8kv.serving import FP8Options
    from hf_fp8kv.serving.server import CPU_KV_MEMORY_MIB, DEFAULT_PAGE_SIZE, FP8Serve, describe
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    model, _ = load_smollm2(dtype=torch.bfloat16)
    settings = continuous_batching.enable(model, scales="dynamic")
    try:
        config = ContinuousBatchingConfig(max_batch_tokens=16, max_memory_percent=0.9)
        options = FP8Options(kv_memory_mib=CPU_KV_MEMORY_MIB)
        server = SimpleNamespace(options=options, default_page_size=True,
                                 _generation_state=SimpleNamespace(_cb_config=config))  # fmt: skip
        FP8Serve._set_page_budget(server, model, settings)
        helper = DistributedHelper(device_mesh=None, cpu_group_timeout=None)
        cache = continuous_batching.FP8PagedAttentionCache(settings, model.config, config, "cpu", helper,
                                                           dtype=torch.bfloat16)  # fmt: skip
        cache.page_size = config.page_size
        line = describe(cache, settings)
    finally:
        continuous_batching.disable(model)
    bf16_tokens = CPU_KV_MEMORY_MIB * 2**20 // (30 * 2 * 3 * 64 * 2)  # 30 layers x K, V x 3 heads x 64 in bf16
    held = cache.num_blocks * DEFAULT_PAGE_SIZE + cache.request_slots.slots * 128
    assert config.page_size == DEFAULT_PAGE_SIZE == 16
    assert cache.capacity_ratio >= 1.72 and held >= 1.72 * bf16_tokens
    assert f"+ {cache.request_slots.slots * 128} recent tokens in the requests' rows, each token stored once" in line
    assert line.endswith(f"{cache.capacity_ratio:.2f}x the tokens")


def test_concurrent_streams_complete_and_pass_the_top5_rule(served):
    """16 streamed chats of mixed prompt and output lengths at once (more than the pages hold together: some
    wait); every one completes, and each greedy output passes the top-5 rule against `generate`."""
    prompts = PROMPTS + [p + " Please answer carefully." for p in PROMPTS]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda i: served.chat(prompts[i], 4 + i % 5), range(len(prompts))))
    assert len({len(served.prompts[request_id]) for request_id, _, _ in results}) >= 8
    for i, (request_id, text, finish) in enumerate(results):
        assert finish in ("length", "stop") and text, (prompts[i], text, finish)
        assert len(served.generated[request_id]) <= 4 + i % 5
    for request_id, _, _ in results:
        served.check_top5(request_id)
    served.wait_until(is_idle, "idle after the streams")


def test_dropped_streams_free_their_pages(served):
    """30 streams dropped by the client after their first chunks: the server cancels them and frees their
    blocks, request slots and stream handlers, and the next request is correct."""

    def drop(i: int) -> None:
        stream = served.client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} ({i})"}], max_tokens=64,
            stream=True,
        )  # fmt: skip
        for n, _ in enumerate(stream):
            if n == 1 + i % 3:
                break
        stream.close()

    with ThreadPoolExecutor(30) as pool:
        list(pool.map(drop, range(30)))
    served.wait_until(is_idle, "idle after 30 dropped streams")
    request_id, text, finish = served.chat(PROMPTS[0], 6)
    assert finish == "length" and text
    served.check_top5(request_id)


def long_prompt(tokens: int) -> str:
    return " ".join(["word"] * tokens)


@pytest.mark.parametrize(
    "body, status, named",
    [
        ({"messages": [{"role": "user", "content": long_prompt(1000)}], "max_tokens": 4}, 400, "the KV pages"),
        ({"messages": [{"role": "user", "content": long_prompt(2100)}], "max_tokens": 4}, 400, "the model's context"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "model": "no/such-model"}, 400,
         "no/such-model"),
        ({"max_tokens": 4}, 400, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stop": 5}, 400, "stop"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stop": [".", ""]}, 400, "stop"),
        ("{not json", 422, "json"),
    ],
)  # fmt: skip
def test_bad_requests_get_a_4xx_naming_the_problem(served, body, status, named):
    data = body.encode() if isinstance(body, str) else json.dumps({"model": NAME, "stream": True, **body}).encode()
    got, error = served.request("POST", "/v1/chat/completions", data)
    assert got == status and named in json.dumps(error), error
    assert served.get("/health")[0] == 200
    assert served.pages()["worker_alive"]


@contextmanager
def holding_after_a_step(served, condition):
    """The generation thread holds after the first step whose page state meets `condition`, until `release` is
    set (at the latest when the block exits): yields the events (`held`, `release`). A state that lasts a few
    decode steps (the tiny model's take milliseconds) is shorter than a poll of `/fp8kv/pages` on a busy
    machine."""
    processor = served.server.manager._cb.batch_processor
    held, release = threading.Event(), threading.Event()
    update_batch = processor.update_batch

    def update_then_hold():
        update_batch()
        if not held.is_set() and condition(page_state(served.server.manager)):
            held.set()
            release.wait(REQUEST_TIMEOUT_S)  # (the test fails on its side if it never releases)

    processor.update_batch = update_then_hold
    try:
        yield held, release
    finally:
        release.set()
        processor.update_batch = update_batch


def test_a_request_arriving_while_the_pages_are_full_waits_and_completes(served):
    """Two long requests outgrow the pages together (one is preempted and recomputed); a short one sent while
    every block is taken waits for room, and all three complete."""
    served.wait_until(is_idle, "idle")
    every_block_taken = holding_after_a_step(served, lambda s: s["blocks_in_use"] == NUM_BLOCKS)
    with ThreadPoolExecutor(3) as pool, every_block_taken as (held, release):  # (released before the pool waits)
        # ~480 prompt tokens + 100 new, the newest 128 in no block: 2 x 29 blocks against 48
        long_ones = [pool.submit(served.chat, f"{n} " + long_prompt(LONG_WORDS), 100) for n in (1, 2)]
        assert held.wait(60), f"every block taken not reached in 60 s: {served.pages()}"
        full = served.pages()  # (a still picture while the generation thread holds)
        assert full["blocks_in_use"] == NUM_BLOCKS and full["active_requests"] + full["waiting_requests"] == 2
        short_one = pool.submit(served.chat, PROMPTS[3], 5)
        served.wait_until(lambda s: s["waiting_requests"] > full["waiting_requests"], "the short request queued")
        release.set()
        request_id, text, finish = short_one.result(timeout=REQUEST_TIMEOUT_S)
        results = [future.result(timeout=REQUEST_TIMEOUT_S) for future in long_ones]
    assert finish == "length" and text
    assert [r[2] for r in results] == ["length", "length"]
    assert [len(served.generated[r[0]]) for r in results] == [100, 100]
    served.check_top5(request_id)
    served.wait_until(is_idle, "idle after the full pages")


def test_dropping_the_running_stream_after_a_preemption_admits_the_others(served):
    """Two long requests outgrow the pages: transformers preempts one and blocks new requests until a request
    ends. The client of the one still running then drops its stream: the preempted one resumes and completes,
    and so does a request sent after."""
    served.wait_until(is_idle, "idle")
    drop = {}  # request id -> set to make its client drop the stream at its next chunk

    def chat_until_told(n: int) -> tuple[str, str | None]:
        """A long streamed chat: (request id, finish reason), None if its client dropped the stream."""
        stream = served.client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": f"{n} " + long_prompt(LONG_WORDS)}], max_tokens=100,
            stream=True,
        )  # fmt: skip
        finish = None
        for chunk in stream:
            told = drop.setdefault(chunk.id, threading.Event())
            if told.is_set():
                stream.close()
                return chunk.id, None
            finish = chunk.choices[0].finish_reason if chunk.choices else finish
        return chunk.id, finish

    a_preemption = holding_after_a_step(served, lambda s: s["block_new_requests"])
    with ThreadPoolExecutor(2) as pool, a_preemption as (held, release):
        long_ones = [pool.submit(chat_until_told, n) for n in (1, 2)]
        assert held.wait(60), f"no preemption in 60 s: {served.pages()}"
        (running,) = served.server.manager._cb.batch_processor.scheduler.active_requests
        drop.setdefault(running, threading.Event()).set()
        release.set()
        results = dict(future.result(timeout=60) for future in long_ones)
    (preempted,) = set(results) - {running}
    assert results == {running: None, preempted: "length"}
    assert len(served.generated[preempted]) == 100
    request_id, text, finish = served.chat(PROMPTS[2], 5)
    assert finish == "length" and text
    served.wait_until(is_idle, "idle after the preemption and the drop")


def test_stop_ends_the_answer_before_the_first_stop_string(served):
    """OpenAI's `stop`: the answer ends before the first stop string (not returned), streamed or not, chat or
    completion, with finish_reason "stop"; the generation ends there too (fewer tokens than max_tokens)."""
    served.wait_until(is_idle, "idle")
    messages = [{"role": "user", "content": PROMPTS[4]}]
    # the first run leaves the prompt's whole pages in the prefix cache, where the later ones read them from:
    # the same greedy tokens from the second run on
    _, full, _ = [served.chat(PROMPTS[4], 12) for _ in range(2)][-1]
    stop = full[len(full) // 3 :][:2]  # two characters a third of the way in
    stops = ["no such text in the answer", stop]
    assert len(full) >= 6 and stop.strip()
    expected = full[: full.find(stop)]

    streamed, finish, used = [], None, None
    for chunk in served.client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, stop=stops,
                                                       stream=True):  # fmt: skip
        for choice in chunk.choices:
            streamed.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
        used = chunk.usage or used
    assert ("".join(streamed), finish) == (expected, "stop")
    assert used.completion_tokens < 12
    chat = served.client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, stop=stops)
    assert (chat.choices[0].message.content, chat.choices[0].finish_reason) == (expected, "stop")
    assert chat.usage.completion_tokens == used.completion_tokens

    prompt = "The keeper wrote the weather down"  # (less than a page: none of it in the prefix cache)
    whole = served.client.completions.create(model=NAME, prompt=prompt, max_tokens=12).choices[0].text
    stop = whole[len(whole) // 3 :][:2]
    cut = served.client.completions.create(model=NAME, prompt=prompt, max_tokens=12, stop=stop)
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (whole[: whole.find(stop)], "stop")
    served.wait_until(is_idle, "idle after the stopped requests")


def test_ignored_fields_are_logged_once_per_endpoint(served):
    """Fields the server accepts but ignores (per-request sampling settings) are logged, each once per
    endpoint, and listed in docs/serving.md; `stop` is not among them."""
    from hf_fp8kv.serving import requests

    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("uvicorn.error")
    log.addHandler(handler)
    messages = [{"role": "user", "content": "hi"}]
    try:
        for extra in ({"temperature": 0.7, "top_p": 0.9}, {"temperature": 0.5, "seed": 3, "stop": "."}):
            served.client.chat.completions.create(model=NAME, messages=messages, max_tokens=1, **extra)
        served.client.completions.create(model=NAME, prompt="hi", max_tokens=1, temperature=0.7)
    finally:
        log.removeHandler(handler)
    ignored = [line.split(":")[0] for line in lines if " ignores " in line]
    assert ignored == ["[hf-fp8kv] /v1/chat/completions ignores temperature, top_p",
                       "[hf-fp8kv] /v1/chat/completions ignores seed",
                       "[hf-fp8kv] /v1/completions ignores temperature"]  # fmt: skip
    docs = (Path(__file__).parents[2] / "docs" / "serving.md").read_text()
    for endpoint, handler in served.server.handlers().items():
        (row,) = [line for line in docs.splitlines() if line.startswith(f"| `{endpoint}` |")]
        fields = requests.ignored_fields(handler, endpoint)
        assert "temperature" in fields and "stop" not in fields
        assert [f for f in sorted(fields) if f"`{f}`" not in row] == [], endpoint


def test_non_streamed_chat_and_completion(served):
    """After everything above, a non-streamed chat and a completion get their tokens."""
    chat = served.client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": PROMPTS[5]}], max_tokens=3
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 3
    completion = served.client.completions.create(model=NAME, prompt="The sea is", max_tokens=3)
    assert completion.choices[0].text
