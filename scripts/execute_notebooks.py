"""Re-executes the example notebooks and saves them with their outputs (tables, plots), so they show results where
people first look. tests/test_notebooks.py executes them the same way. transformers' progress bars are off
(HF_HUB_DISABLE_PROGRESS_BARS=1 in the kernel's environment): a saved bar shows nothing useful.

    .venv/bin/python scripts/execute_notebooks.py                             # every examples/*.ipynb
    .venv/bin/python scripts/execute_notebooks.py examples/ab_compare.ipynb
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.ipynb"))


def execute(path: Path, timeout: int = 1800) -> nbformat.NotebookNode:
    """The notebook at `path` run top to bottom in a fresh kernel of this Python, in a temporary directory (what
    it writes lands outside the repository). A failing cell raises `nbclient.exceptions.CellExecutionError`."""
    notebook = nbformat.read(path, as_version=4)
    notebook.metadata.pop("widgets", None)  # the previous run's widget state; this run stores its own, if any
    with tempfile.TemporaryDirectory() as cwd:
        client = NotebookClient(notebook, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": cwd}})
        client.execute(env={**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"})
    return notebook


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, default=NOTEBOOKS, help="default: examples/*.ipynb")
    for path in parser.parse_args().notebooks:
        nbformat.write(execute(path), path)
        print(f"executed and saved {path}")


if __name__ == "__main__":
    main()
