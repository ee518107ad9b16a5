"""`kernels/` stands alone: no module there imports transformers or any part of hf_fp8kv outside `kernels`, so the
Triton ops and their torch references can be carried to another project (the boundary the README promises)."""

import ast
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


def test_the_kernels_import_without_transformers():
    """Every kernel module imported as a package of its own, in a fresh interpreter: neither transformers nor
    hf_fp8kv gets loaded."""
    names = ", ".join(f"kernels.{path.stem}" for path in MODULES if path.stem != "__init__")
    code = (
        f"import sys; sys.path.insert(0, {str(KERNELS.parent)!r}); import {names}; "
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('transformers', 'hf_fp8kv')]; print(loaded)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout + result.stderr
