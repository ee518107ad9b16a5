"""Requests that could never complete get a 400 naming the problem, before they reach the scheduler.

transformers' server passes `max_tokens` through `int(...)` (a string is a 500, a negative number reaches the
scheduler), reads `messages` unchecked (a 500), and queues a prompt longer than the KV pages, whose scheduling
then fails and stops the continuous-batching worker for every later request (503). Here:
- `max_tokens` (`max_completion_tokens`, `max_output_tokens`) must be a positive integer;
- a chat needs a non-empty list of message objects;
- a prompt must be shorter than the model's context and the pages; with an explicit `max_tokens`, the prompt
  plus it must fit both (vLLM's rule); without one, transformers' default is cut to what fits.
(A dropped stream's result handler is removed by the manager, `continuous_batching._settle_cancellations`.)
"""

from __future__ import annotations

import functools

MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
EXPLICIT = "_fp8kv_explicit_max_tokens"  # set on the generation config of a request that gave max_tokens


def _bad_request(detail: str):
    from fastapi import HTTPException

    return HTTPException(status_code=400, detail=detail)


def checked_max_tokens(build):
    """A handler's `_build_generation_config` that answers 400 to a max_tokens that is not a positive integer."""

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


def check_lengths(manager, model, page_tokens: int) -> None:
    """Wrap `manager`'s `generate_streaming` / `generate_non_streaming` (instance attributes): lengths checked
    against the model's context and the `page_tokens` the pages hold."""
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

    @functools.wraps(streaming)
    def generate_streaming(model, processor, inputs, gen_config, *args, **kwargs):
        fit(inputs, gen_config)
        return streaming(model, processor, inputs, gen_config, *args, **kwargs)

    @functools.wraps(non_streaming)
    async def generate_non_streaming(model, processor, inputs, gen_config, *args, **kwargs):
        fit(inputs, gen_config)
        return await non_streaming(model, processor, inputs, gen_config, *args, **kwargs)

    manager.generate_streaming, manager.generate_non_streaming = generate_streaming, generate_non_streaming
