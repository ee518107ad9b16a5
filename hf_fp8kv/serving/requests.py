"""Requests that could never complete get a 400 naming the problem, before they reach the scheduler; `stop` is
honoured and every other field the server ignores is logged.

transformers' server passes `max_tokens` through `int(...)` (a string is a 500, a negative number reaches the
scheduler), reads `messages` unchecked (a 500), and queues a prompt longer than the KV pages, whose scheduling
then fails and stops the continuous-batching worker for every later request (503). Here:
- `max_tokens` (`max_completion_tokens`, `max_output_tokens`) must be a positive integer;
- `stop` must be a non-empty string or a list of them;
- a chat needs a non-empty list of message objects;
- a prompt must be shorter than the model's context and the pages; with an explicit `max_tokens`, the prompt
  plus it must fit both (vLLM's rule); without one, transformers' default is cut to what fits.
Continuous batching serves every request with one generation config and reads only `max_tokens` of a request's:
the fields an endpoint accepts beyond `HONOURED` (sampling settings among them) are logged as ignored, each once
per endpoint (transformers logs those it knows it does not support itself, its handlers' `_unused_fields`).
(A dropped stream's result handler is removed by the manager, `continuous_batching._settle_cancellations`.)
"""

from __future__ import annotations

import functools
import logging

from hf_fp8kv.serving.stop import StopStream, stop_strings

MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
EXPLICIT = "_fp8kv_explicit_max_tokens"  # set on the generation config of a request that gave max_tokens
HONOURED = {  # by endpoint: the request fields the server acts on
    "/v1/chat/completions": frozenset({"model", "messages", "stream", "max_tokens", "max_completion_tokens", "stop",
                                       "tools", "chat_template_kwargs"}),
    "/v1/completions": frozenset({"model", "prompt", "stream", "max_tokens", "stop", "suffix"}),
    "/v1/responses": frozenset({"model", "input", "instructions", "stream", "max_output_tokens", "tools",
                                "chat_template_kwargs"}),
}  # fmt: skip
logger = logging.getLogger("uvicorn.error")  # the server's log


def _bad_request(detail: str):
    from fastapi import HTTPException

    return HTTPException(status_code=400, detail=detail)


def checked_generation_config(build):
    """A handler's `_build_generation_config` that answers 400 to a max_tokens that is not a positive integer
    and to a stop that is not a non-empty string or a list of them."""

    @functools.wraps(build)
    def checked(body: dict, model_generation_config, use_cb: bool = False):
        explicit = None
        for field in MAX_TOKENS_FIELDS:
            value = body.get(field)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _bad_request(f"{field} must be a positive integer, got {value!r}")
            explicit = value if explicit is None else explicit
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop
        if stop is not None and not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
            raise _bad_request(f"stop must be a non-empty string or a list of them, got {stop!r:.80}")
        config = build(body, model_generation_config, use_cb=use_cb)
        setattr(config, EXPLICIT, explicit is not None)
        return config

    return checked


def checked_messages(validate):
    """The chat handler's `_validate_request` that also answers 400 to a request without a list of messages."""

    @functools.wraps(validate)
    def checked(body: dict) -> None:
        validate(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise _bad_request(f"messages must be a non-empty list of message objects, got {messages!r:.80}")

    return checked


def ignored_fields(handler, endpoint: str) -> frozenset[str]:
    """The request fields `handler` accepts and the server ignores, beyond those transformers logs itself."""
    accepted = frozenset(getattr(handler._valid_params_class, "__mutable_keys__", ()))
    return accepted - HONOURED[endpoint] - frozenset(handler._unused_fields)


def logging_ignored(validate, endpoint: str, ignored: frozenset[str]):
    """A handler's `_validate_request` that logs the `ignored` fields a request gives, each once (this handler
    serves one endpoint)."""
    logged: set[str] = set()

    @functools.wraps(validate)
    def checked(body: dict) -> None:
        validate(body)
        new = sorted((body.keys() & ignored) - logged)
        if new:
            logged.update(new)
            logger.warning(f"[hf-fp8kv] {endpoint} ignores {', '.join(new)}: continuous batching serves every "
                           "request with the server's generation config (docs/serving.md)")  # fmt: skip

    return checked


def wrap_generation(manager, model, page_tokens: int) -> None:
    """Wrap `manager`'s `generate_streaming` / `generate_non_streaming` (instance attributes): lengths checked
    against the model's context and the `page_tokens` the pages hold, and the text cut at the first stop
    string (a non-streamed request with stop strings runs as a stream)."""
    context = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    limits = {"the model's context": context, "the KV pages": page_tokens}

    def fit(inputs: dict, config) -> None:
        prompt = len(inputs["input_ids"])
        for what, limit in limits.items():
            if limit is None:
                continue
            if prompt >= limit:
                raise _bad_request(f"the prompt has {prompt} tokens; {what} holds {limit}")
            if prompt + config.max_new_tokens > limit:
                if getattr(config, EXPLICIT, False):
                    raise _bad_request(f"the prompt ({prompt} tokens) plus max_tokens ({config.max_new_tokens}) "
                                       f"exceeds {what}: {limit} tokens")  # fmt: skip
                config.max_new_tokens = limit - prompt

    streaming, non_streaming = manager.generate_streaming, manager.generate_non_streaming

    def start(model, processor, inputs, gen_config, *args, **kwargs):
        """The stream of a request that fits, and its stop strings' cut (None without any)."""
        fit(inputs, gen_config)
        queue, streamer = streaming(model, processor, inputs, gen_config, *args, **kwargs)
        stops = stop_strings(gen_config)
        return queue, streamer, StopStream(streamer, stops, gen_config) if stops else None

    @functools.wraps(streaming)
    def generate_streaming(*args, **kwargs):
        queue, streamer, _ = start(*args, **kwargs)
        return queue, streamer

    @functools.wraps(non_streaming)
    async def generate_non_streaming(model, processor, inputs, gen_config, request_id: str):
        if not stop_strings(gen_config):
            fit(inputs, gen_config)
            return await non_streaming(model, processor, inputs, gen_config, request_id=request_id)
        _, _, stop = start(model, processor, inputs, gen_config, request_id=request_id)
        return await stop.text_to_end(request_id), len(inputs["input_ids"]), stop.generated

    manager.generate_streaming, manager.generate_non_streaming = generate_streaming, generate_non_streaming
