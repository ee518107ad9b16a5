"""Packaging: the sdist, the wheel built from it and the editable wheel build without a warning, and the wheel
ships every module (kernels/ as hf_fp8kv.kernels) and the data files.

The hooks run offline in this environment (torch requires setuptools>=77, the backend's own requirement), the
way pip >= 26 calls them: in a subprocess, reporting every UserWarning the backend raises, which pip prints.
"""

import ast
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import tomllib
import torch
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["pyproject.toml", "README.md", "MANIFEST.in", "hf_fp8kv", "kernels", "scripts"]
HOOK = """
import importlib, json, sys, warnings
backend = importlib.import_module(sys.argv[1])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    name = getattr(backend, sys.argv[2])(sys.argv[3])
print(json.dumps({"name": name, "warnings": [str(w.message) for w in caught if issubclass(w.category, UserWarning)]}))
"""


def run_hook(source: Path, hook: str, out: Path) -> Path:
    """Runs a PEP 517 hook of the project's backend in `source`; fails on any warning; returns the artifact."""
    system = tomllib.loads((source / "pyproject.toml").read_text())["build-system"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(source / p) for p in system.get("backend-path", []))}
    done = subprocess.run([sys.executable, "-c", HOOK, system["build-backend"], hook, str(out)], cwd=source, env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["warnings"] == [], f"{hook} warns:\n" + "\n".join(report["warnings"])
    return out / report["name"]


def expected_wheel_files() -> set[str]:
    package = {f"hf_fp8kv/{p.relative_to(ROOT / 'hf_fp8kv')}" for p in (ROOT / "hf_fp8kv").rglob("*.py")}
    kernels = {f"hf_fp8kv/kernels/{p.relative_to(ROOT / 'kernels')}" for p in (ROOT / "kernels").rglob("*.py")}
    data = {f"hf_fp8kv/data/{p.name}" for p in (ROOT / "hf_fp8kv" / "data").glob("*.txt")}
    return package | kernels | data


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A clean copy of what the build reads (no build/, egg-info or caches from earlier builds)."""
    copy = tmp_path_factory.mktemp("source")
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in SOURCES:
        path = ROOT / name
        (shutil.copytree(path, copy / name, ignore=ignore) if path.is_dir() else shutil.copy(path, copy / name))
    return copy


def test_wheel_from_sdist_ships_the_modules_kernels_and_data(source, tmp_path):
    sdist = run_hook(source, "build_sdist", tmp_path)
    with tarfile.open(sdist) as archive:
        archive.extractall(tmp_path, filter="data")
    unpacked = tmp_path / sdist.name.removesuffix(".tar.gz")
    wheel = run_hook(unpacked, "build_wheel", tmp_path / "wheel")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {n for n in names if not n.startswith("hf_fp8kv-0.1.0.dist-info/")}
    assert shipped == expected_wheel_files()
    assert {"hf_fp8kv/data/prompts.txt", "hf_fp8kv/data/sample_text.txt", "hf_fp8kv/kernels/ops.py"} <= shipped
    entry_points = zipfile.ZipFile(wheel).read("hf_fp8kv-0.1.0.dist-info/entry_points.txt").decode()
    assert "hf-fp8kv = hf_fp8kv.cli:main" in entry_points
    check_triton_only_where_its_wheels_are(zipfile.ZipFile(wheel).read("hf_fp8kv-0.1.0.dist-info/METADATA").decode())


# (pip download --only-binary=:all: --platform ... triton>=3.2, 2026-12-07: 3.9.0 for manylinux x86_64 and aarch64,
# nothing for macOS or Windows)
TRITON_WHEELS = {("Linux", "x86_64"): True, ("Linux", "aarch64"): True, ("Darwin", "arm64"): False,
                 ("Darwin", "x86_64"): False, ("Windows", "AMD64"): False, ("Linux", "ppc64le"): False}


def check_triton_only_where_its_wheels_are(metadata: str) -> None:
    """pip installs triton with the package on the platforms that have its wheels, and nowhere else (where it
    would fail the whole install)."""
    (triton,) = [Requirement(line.removeprefix("Requires-Dist: ")) for line in metadata.splitlines()
                 if line.startswith("Requires-Dist: triton")]  # fmt: skip
    for (system, machine), has_wheels in TRITON_WHEELS.items():
        environment = {"platform_system": system, "platform_machine": machine, "sys_platform": system.lower()}
        assert triton.marker.evaluate(environment) == has_wheels, (system, machine, str(triton))


NO_TRITON = """
import sys
sys.modules["triton"] = None  # as on a machine without it: every `import triton` fails, find_spec finds nothing
import torch
from hf_fp8kv import QuantizedFP8Cache
from hf_fp8kv.compat import cache_kwargs
from tests.models import tiny_model
model = tiny_model()
prompt = torch.tensor([[1, 5, 9, 14, 3, 7]])
cache = QuantizedFP8Cache(model, scales="dynamic")
out = model.generate(prompt, **cache_kwargs(cache), max_new_tokens=8, do_sample=False)
print(out[0].tolist())
try:
    model.generate(prompt, **cache_kwargs(QuantizedFP8Cache(model, backend="triton")), max_new_tokens=1)
except RuntimeError as error:
    print(error)
"""


def test_without_triton_the_cache_runs_the_torch_path():
    """Where Triton is not installed (macOS, Windows: no wheels) the package imports and generates on the torch
    path with the results the torch backend gives here; asking for the Triton backend names what is missing."""
    from hf_fp8kv import QuantizedFP8Cache
    from hf_fp8kv.compat import cache_kwargs
    from tests.models import tiny_model

    run = subprocess.run([sys.executable, "-c", NO_TRITON], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    tokens, error = run.stdout.strip().splitlines()[-2:]
    model = tiny_model()
    cache = QuantizedFP8Cache(model, scales="dynamic", backend="torch")
    with torch.inference_mode():
        expected = model.generate(torch.tensor([[1, 5, 9, 14, 3, 7]]), **cache_kwargs(cache), max_new_tokens=8,
                                  do_sample=False)
    assert ast.literal_eval(tokens) == expected[0].tolist()
    assert error.startswith("backend='triton' needs the triton package, which is not installed here")


def test_editable_wheel_maps_the_kernels_directory(source, tmp_path):
    wheel = run_hook(source, "build_editable", tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        (finder,) = [n for n in archive.namelist() if n.endswith("_finder.py")]
        module = ast.parse(archive.read(finder).decode())
    mapping = next(ast.literal_eval(node.value) for node in module.body
                   if isinstance(node, ast.AnnAssign) and node.target.id == "MAPPING")
    assert mapping == {"hf_fp8kv": str(source / "hf_fp8kv"), "hf_fp8kv.kernels": str(source / "kernels")}
