"""Kernels of hf-fp8kv: storage formats, the torch reference and the Triton kernels. No transformers here."""

from .formats import FORMATS, StorageFormat, get_format

__all__ = ["FORMATS", "StorageFormat", "get_format"]
