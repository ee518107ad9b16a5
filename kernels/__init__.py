"""Kernels of hf-fp8kv, imported as `hf_fp8kv.kernels`: storage formats, the torch reference and the Triton kernels.
No transformers here.

Imported as the top-level `kernels` instead, this directory is shadowing Hugging Face's `kernels` package (which
transformers >= 5.25 requires and imports): Python is running from the checkout's root, which `python -m ...`,
`python -c` and pytest put first on `sys.path`. The name is then handed over to that package where it is
installed, as if the root were not on the path; where it is not, this module stays, empty and without a version,
which transformers' check of the package (an import, for want of its metadata) reads as unavailable.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module  # (what the import statement returns, once this module has run)
        _spec.loader.exec_module(_module)
