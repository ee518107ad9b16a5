"""Detects a filled cache reused for an unrelated prompt, which transformers would silently continue.

The rule: a `QuantizedFP8Cache` holds one sequence per batch row. A `generate` call with a non-empty cache
must pass input ids that start with the tokens already cached (a continuation of the same conversation);
anything else raises `CacheReuseError` before the model runs.

Where it applies: the cache was built from the model (`QuantizedFP8Cache(model)`; with `config=` only, nothing
is installed) and every token in it went through that model, by `generate` or by a direct `model(...)` call
(eager: a compiled direct call is not seen), since the cache was empty or `reset()`. Then each token is logged,
including manual decode steps between `generate` calls and chunked prefill (`prefill_chunk_size`: checked
before the first decode step, after the prefill ran). Tokens given as `inputs_embeds` are logged as unknown:
a later `generate` with input ids is compared on the known tokens only. Not checked: a `generate` call that
passes `inputs_embeds` to a filled cache, and one that passes only the new ids (a continuation through the
full attention mask): neither holds the cached tokens' ids. A cache written by anything else (another model,
`model.model(...)`) is no longer tracked until it is reset.
"""

from __future__ import annotations

import inspect

import torch

UNKNOWN_TOKEN = -1  # a token given as an embedding


class CacheReuseError(ValueError):
    """A filled cache was passed to `generate` with input ids that do not continue its tokens."""


class TokenHistory:
    """The token ids that went into the cache (`UNKNOWN_TOKEN` for embeddings), kept in step with crop / reorder /
    batch operations; `ids` is None while the cache is not tracked."""

    def __init__(self) -> None:
        self.ids: torch.Tensor | None = None
        self.unchecked = False  # tokens were written by forwards no generate step prepared

    def clear(self) -> None:
        self.ids = None
        self.unchecked = False

    def _append(self, new: torch.Tensor, cached: int) -> None:
        if cached == 0:
            self.ids = new.clone()
        elif self.ids is not None and self.ids.shape[1] == cached:
            self.ids = torch.cat([self.ids, new.to(self.ids.device)], dim=1)
        else:
            self.ids = None  # written outside the model: not tracked until reset

    def prepare_step(
        self,
        input_ids: torch.Tensor,
        inputs_embeds: torch.Tensor | None,
        next_tokens: int | None,
        cached: int,
        first_iteration: bool,
    ) -> None:
        """A generate step about to run: check its ids against the cached tokens, then log the tokens it adds
        (sliced as transformers' `prepare_inputs_for_generation` slices them)."""
        embeds = inputs_embeds is not None and first_iteration
        tracked = self.ids is not None and self.ids.shape[1] == cached
        if cached and tracked and not embeds and (first_iteration or self.unchecked):
            # the ids line up with the cache when they hold every token; a prefill chunk, or a continuation that
            # passes only the new ids, does not: the check waits for the first step that passes them all
            if next_tokens is not None and input_ids.shape[1] == cached + next_tokens:
                self.check(input_ids, cached)
                self.unchecked = False
            else:
                self.unchecked = True
        if embeds:
            count = next_tokens if next_tokens is not None else inputs_embeds.shape[1]
            new = torch.full((inputs_embeds.shape[0], count), UNKNOWN_TOKEN, dtype=torch.long)
        else:
            new = input_ids[:, -next_tokens:] if next_tokens is not None else input_ids
        self._append(new, cached)

    def record_forward(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, cached: int) -> None:
        """A forward about to write the cache: log its tokens unless the generate step that prepared it did."""
        tokens = input_ids if input_ids is not None else inputs_embeds
        if tokens is None:
            return
        if self.ids is not None and self.ids.shape[1] == cached + tokens.shape[1]:
            return  # logged by `prepare_step`
        new = input_ids if input_ids is not None else torch.full(tokens.shape[:2], UNKNOWN_TOKEN, dtype=torch.long)
        self._append(new, cached)
        self.unchecked = True

    def check(self, input_ids: torch.Tensor, cached: int) -> None:
        problem = None
        if input_ids.shape[0] != self.ids.shape[0]:
            problem = f"a batch of {input_ids.shape[0]} rows, but the cache holds {self.ids.shape[0]}"
        elif input_ids.shape[1] < cached:
            problem = f"{input_ids.shape[1]} input tokens, fewer than the {cached} already cached"
        else:
            known = self.ids != UNKNOWN_TOKEN
            if not torch.equal(input_ids[:, :cached].to(self.ids.device)[known], self.ids[known]):
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


def _history(kwargs: dict) -> tuple[object, TokenHistory | None]:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return cache, getattr(cache, "token_history", None)


class GuardedPrepareInputs:
    """`model.prepare_inputs_for_generation` of a guarded model: feeds our caches' histories, then runs the
    class's method. A plain object (not a closure), so the model still pickles and deep-copies."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @property
    def __signature__(self) -> inspect.Signature:  # generate inspects the method's parameters
        return inspect.signature(type(self.model).prepare_inputs_for_generation.__get__(self.model))

    def __call__(self, input_ids, *args, **kwargs):
        cache, history = _history(kwargs)
        if history is not None and input_ids is not None:
            history.prepare_step(
                input_ids,
                kwargs.get("inputs_embeds"),
                kwargs.get("next_sequence_length"),
                cache.get_seq_length(),
                bool(kwargs.get("is_first_iteration")),
            )
        return type(self.model).prepare_inputs_for_generation(self.model, input_ids, *args, **kwargs)


class RecordForwardTokens:
    """Forward pre-hook (with kwargs) of a guarded model: logs the tokens of forwards that no generate step
    prepared (direct calls, chunked prefill)."""

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.compiler.is_compiling():
            return None
        cache, history = _history(kwargs)
        if history is not None:
            input_ids = kwargs.get("input_ids", args[0] if args else None)
            history.record_forward(input_ids, kwargs.get("inputs_embeds"), cache.get_seq_length())
        return None


class CheckedCachePreparation:
    """`model._prepare_cache_for_generation` of a guarded model: before the first step, a cache of ours checks
    what the generate call will ask of it (`check_generation`: length, batch, rollback), then the class's method
    runs. A plain object, so the model still pickles."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        method = type(self.model)._prepare_cache_for_generation
        call = inspect.signature(method).bind(self.model, *args, **kwargs).arguments
        model_kwargs, config = call.get("model_kwargs") or {}, call.get("generation_config")
        cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
        if hasattr(cache, "check_generation") and config is not None and "max_cache_length" in call:
            mode = call.get("generation_mode")
            sequences = max(config.num_beams or 1, config.num_return_sequences or 1)
            cache.check_generation(
                call["max_cache_length"], call.get("batch_size", 1) * sequences,
                getattr(mode, "value", mode) == "assisted_generation", config.prefill_chunk_size is not None,
            )  # fmt: skip
        return method(self.model, *args, **kwargs)


def install_generation_guard(model: torch.nn.Module) -> None:
    """Feed our caches' token histories from `model`'s generate steps and forwards, and let them check a generate
    call before its first step (once per model)."""
    if isinstance(vars(model).get("prepare_inputs_for_generation"), GuardedPrepareInputs):
        return
    model.prepare_inputs_for_generation = GuardedPrepareInputs(model)
    if hasattr(type(model), "_prepare_cache_for_generation"):
        model._prepare_cache_for_generation = CheckedCachePreparation(model)
    model.register_forward_pre_hook(RecordForwardTokens(), with_kwargs=True)
