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


def test_editable_wheel_maps_the_kernels_directory(source, tmp_path):
    wheel = run_hook(source, "build_editable", tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        (finder,) = [n for n in archive.namelist() if n.endswith("_finder.py")]
        module = ast.parse(archive.read(finder).decode())
    mapping = next(ast.literal_eval(node.value) for node in module.body
                   if isinstance(node, ast.AnnAssign) and node.target.id == "MAPPING")
    assert mapping == {"hf_fp8kv": str(source / "hf_fp8kv"), "hf_fp8kv.kernels": str(source / "kernels")}
