"""Kernels of hf-fp8kv, imported as `hf_fp8kv.kernels`: storage formats, the torch reference and the Triton kernels.
No transformers here.

Imported as the top-level `kernels` instead, this directory is shadowing Hugging Face's `kernels` package (which
transformers >= 5.25 requires and imports): Python is running from the checkout's root, which `python -m ...`,
`python -c` and pytest put first on `sys.path`. The name is then handed over to that package, as if the root were
not on the path.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None:
        raise ModuleNotFoundError(f"{os.path.dirname(__file__)} is hf_fp8kv.kernels, not a top-level `kernels` "
                                  "package (and Hugging Face's `kernels` package is not installed)", name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module  # (what the import statement returns, once this module has run)
    _spec.loader.exec_module(_module)
