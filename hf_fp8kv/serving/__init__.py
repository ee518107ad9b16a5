"""`hf-fp8kv serve`: transformers' own OpenAI-compatible server (`transformers serve`) with continuous batching on
FP8 pages. Needs the serving extra: `pip install hf-fp8kv[serve]`."""

from hf_fp8kv.serving.server import FP8Options, FP8Serve, serve_model

__all__ = ["FP8Options", "FP8Serve", "serve_model"]
