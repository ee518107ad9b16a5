"""OpenAI's `stop` for continuous batching: generation ends at the first stop string, which is not returned.

transformers' server maps `stop` to the generation config's `stop_strings`, which continuous batching's
`add_request` never reads. Here the streamer's text is cut at the first stop string and the request cancelled
(its pages freed); a non-streamed request with `stop` runs as a stream, read to its end here.
"""

from __future__ import annotations

from collections.abc import Sequence


def stop_strings(gen_config) -> list[str]:
    """The stop strings of a request's generation config (`stop`: a string or a list of them)."""
    stop = getattr(gen_config, "stop_strings", None)
    return [stop] if isinstance(stop, str) else list(stop or ())


class StopText:
    """Text passed on until the first stop string, which is not; a tail that could begin one is held back until
    the next text shows whether it does."""

    def __init__(self, stops: Sequence[str]):
        self.stops, self.held, self.reached = tuple(stops), "", False

    def feed(self, text: str) -> str:
        """What of `text` (after the held tail) can be passed on; at a stop string, the text before it, and
        `reached` is set."""
        text = self.held + text
        starts = [start for start in (text.find(stop) for stop in self.stops) if start >= 0]
        if starts:
            self.held, self.reached = "", True
            return text[: min(starts)]
        held = max((n for stop in self.stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)
        self.held = text[len(text) - held :]
        return text[: len(text) - held]

    def flush(self) -> str:
        """The held tail, at the end of the text (no stop string came)."""
        held, self.held = self.held, ""
        return held


class StopStream:
    """A continuous-batching streamer (transformers' `CBStreamer`) whose text stops at the first stop string:
    the stream ends there (the end marker, None, follows the text before it) and the request is cancelled.

    The streamer pushes its text through `put_nowait` (it takes this object for its queue); `generated` holds the
    token ids generated up to the stop string."""

    def __init__(self, streamer, stops: Sequence[str], gen_config):
        self.streamer, self.gen_config = streamer, gen_config
        self.text = StopText(stops)
        self.queue, self.put = streamer._queue, streamer.put
        self.generated: list[int] = []
        streamer._queue, streamer.put = self, self.take

    def take(self, output) -> None:
        """The streamer's `put`: outputs after the stop string (the step in flight at the cancel) are dropped."""
        if not self.text.reached:
            self.generated = list(output.generated_tokens)
            self.put(output)

    def put_nowait(self, item) -> None:
        if self.text.reached:
            return
        if type(item) is str:  # content (not reasoning text, a tool call or an error)
            text = self.text.feed(item)
            if text:
                self.queue.put_nowait(text)
            if self.text.reached:
                self.queue.put_nowait(None)
                self.streamer.cancel()
                # transformers' handlers call it "length" when max_new_tokens tokens came: a stop string
                # completed by the last of them is still a stop
                self.gen_config.max_new_tokens = None
            return
        if item is None:
            tail = self.text.flush()
            if tail:
                self.queue.put_nowait(tail)
        self.queue.put_nowait(item)

    async def text_to_end(self, request_id: str) -> str:
        """The whole text of the stream (what a non-streamed request returns)."""
        from transformers.cli.serving.utils import _StreamError

        parts = []
        while (item := await self.queue.get()) is not None:
            if isinstance(item, _StreamError):
                raise RuntimeError(f"CB generation failed for {request_id}: {item.msg}")
            parts.append(item)
        return "".join(parts)
