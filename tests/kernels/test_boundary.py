"""`kernels/` stands alone: no module there imports transformers or any part of hf_fp8kv outside `kernels`, so the
Triton ops and their torch references can be carried to another project (the boundary the README promises)."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
MODULES = sorted(KERNELS.glob("*.py"))


def test_no_kernel_module_names_transformers_or_the_integration():
    outside = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                root = name.split(".")[0]
                if root == "transformers" or root == "hf_fp8kv" and not name.startswith("hf_fp8kv.kernels"):
                    outside.append(f"{path.name}: {name}")
    assert MODULES and not outside, outside


def test_the_kernels_import_without_transformers(tmp_path):
    """Every kernel module, copied into another project as a package of its own (`carried_kernels`), imported in a
    fresh interpreter: neither transformers nor hf_fp8kv gets loaded."""
    shutil.copytree(KERNELS, tmp_path / "carried_kernels", ignore=shutil.ignore_patterns("__pycache__"))
    names = ", ".join(f"carried_kernels.{path.stem}" for path in MODULES if path.stem != "__init__")
    code = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import {names}; "
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('transformers', 'hf_fp8kv')]; print(loaded)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr


def test_hf_fp8kv_imports_from_the_checkouts_root_with_or_without_hugging_faces_kernels():
    """From the checkout's root (first on `sys.path` under `python -c`, `python -m`, pytest) `import kernels` finds
    this directory first. It hands the name over to Hugging Face's `kernels` (which transformers >= 5.25 imports)
    where that is installed, and otherwise stays an empty package, which transformers reads as no `kernels`: either
    way hf_fp8kv and a model class import from the root."""
    find = "import importlib.util; spec = importlib.util.find_spec('kernels'); print(spec.origin if spec else '')"
    installed = subprocess.run([sys.executable, "-c", find], cwd=KERNELS.anchor, capture_output=True, text=True,
                               check=True).stdout.strip()  # (from a directory that holds no `kernels`)
    code = "import kernels; print(kernels.__file__); import hf_fp8kv; from transformers import LlamaForCausalLM"
    result = subprocess.run([sys.executable, "-c", code], cwd=KERNELS.parent, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (installed or str(KERNELS / "__init__.py"))
