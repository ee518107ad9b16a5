"""The example notebooks run top to bottom with scripts/execute_notebooks.py, and are committed with the outputs
that a run gives: the report's story and tables, the plots, and no error or raw warning."""

import runpy
from pathlib import Path

import nbformat
import pytest

from hf_fp8kv.comparison import RECOMMENDED

SCRIPT = runpy.run_path(str(Path(__file__).resolve().parents[1] / "scripts" / "execute_notebooks.py"))
# What each notebook's HTML outputs must show, and how many plots.
SHOWS = {"ab_compare.ipynb": ([f"Recommended: {RECOMMENDED} = ", "<h4>Summary</h4>", "<h4>Cost (batch 1)</h4>"], 1)}


def check_shows_results(notebook, name: str) -> None:
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), "not run top to bottom"
    shown = [output for cell in code for output in cell.outputs]
    assert not [o for o in shown if o.output_type == "error" or o.get("name") == "stderr"]
    html = "".join(o.get("data", {}).get("text/html", "") for o in shown)
    texts, plots = SHOWS[name]
    assert all(text in html for text in texts)
    assert sum("image/png" in o.get("data", {}) for o in shown) == plots


@pytest.mark.parametrize("path", SCRIPT["NOTEBOOKS"], ids=lambda path: path.name)
def test_committed_notebook_shows_its_results(path):
    check_shows_results(nbformat.read(path, as_version=4), path.name)


@pytest.mark.parametrize("path", SCRIPT["NOTEBOOKS"], ids=lambda path: path.name)
def test_notebook_executes(path):
    check_shows_results(SCRIPT["execute"](path), path.name)
