"""Detects a filled cache reused for an unrelated prompt, which transformers would silently continue.

The rule: a `QuantizedFP8Cache` holds one sequence per batch row. A `generate` call with a non-empty cache
must pass input ids that start with the tokens already cached (a continuation of the same conversation);
anything else raises `CacheReuseError` before the model runs. The check needs the token ids, so it is active
when the cache was built from the model (`QuantizedFP8Cache(model)`); with `config=` only, it is not.
"""

from __future__ import annotations

import functools

import torch


class CacheReuseError(ValueError):
    """A filled cache was passed to `generate` with input ids that do not continue its tokens."""


class TokenHistory:
    """The token ids that went into the cache, kept in step with crop / reorder / batch operations."""

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None

    def clear(self) -> None:
        self.ids = None

    def record(self, input_ids: torch.Tensor, new_tokens: int | None, cached: int, first_iteration: bool) -> None:
        """Check a generate step's `input_ids` against the cached tokens and log its new tokens."""
        if cached == 0:
            self.ids = None
        elif self.ids is None or self.ids.shape[1] != cached:
            return  # filled outside generate (a direct forward): nothing to compare with
        if new_tokens is None:
            if cached:  # only the new tokens were passed (continuation through the attention mask)
                self.ids = None
                return
            new_tokens = input_ids.shape[1]
        if cached and first_iteration:
            self.check(input_ids, cached)
        new = input_ids[:, input_ids.shape[1] - new_tokens :]
        self.ids = new.clone() if self.ids is None else torch.cat([self.ids, new], dim=1)

    def check(self, input_ids: torch.Tensor, cached: int) -> None:
        problem = None
        if input_ids.shape[0] != self.ids.shape[0]:
            problem = f"a batch of {input_ids.shape[0]} rows, but the cache holds {self.ids.shape[0]}"
        elif input_ids.shape[1] < cached:
            problem = f"{input_ids.shape[1]} input tokens, fewer than the {cached} already cached"
        elif not torch.equal(input_ids[:, :cached].to(self.ids.device), self.ids):
            problem = f"input ids that do not start with the {cached} tokens already cached"
        if problem:
            raise CacheReuseError(
                f"This QuantizedFP8Cache already holds another sequence: generate got {problem}. A cache holds one "
                "conversation: pass a fresh QuantizedFP8Cache(model) for each new prompt (or call cache.reset()); "
                "to continue, pass the previous output ids followed by the new ones."
            )

    def crop(self, length: int) -> None:
        if self.ids is not None:
            self.ids = self.ids[:, :length]

    def map(self, fn) -> None:
        if self.ids is not None:
            self.ids = fn(self.ids)


def install_generation_guard(model: torch.nn.Module) -> None:
    """Wrap `model.prepare_inputs_for_generation` (this instance only) to feed our caches' token histories."""
    if getattr(model, "_fp8kv_guarded", False):
        return
    original = model.prepare_inputs_for_generation

    @functools.wraps(original)
    def guarded(input_ids, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        history = getattr(cache, "token_history", None)
        if history is not None and input_ids is not None and kwargs.get("inputs_embeds") is None:
            history.record(
                input_ids,
                kwargs.get("next_sequence_length"),
                cache.get_seq_length(),
                bool(kwargs.get("is_first_iteration")),
            )
        return original(input_ids, *args, **kwargs)

    model.prepare_inputs_for_generation = guarded
    model._fp8kv_guarded = True
