"""The tutorial notebook (docs/tutorial.ipynb) top to bottom in a real Jupyter kernel, started as IDEs start one:
by the interpreter's path, with the environment's ``bin/`` not on PATH and no PYSPARK_PYTHON, in the user's own
SparkSession (issue 55). Then the mistakes a notebook user meets: an error reads as its one line, and a default
(generation's 64 new tokens) fits a model whose context is 64."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("notebook")]

ROOT = Path(__file__).resolve().parents[2]


def _kernel(tmp_path: Path) -> str:
    """A kernel spec that starts this interpreter by its path, with a PATH where ``python3`` is not this
    environment's and nothing saying which Python Spark's workers should run."""
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p != venv_bin)
    spec = tmp_path / "jupyter" / "kernels" / "by-path"
    spec.mkdir(parents=True)
    argv = ["/usr/bin/env", "-u", "PYSPARK_PYTHON", "-u", "PYSPARK_DRIVER_PYTHON", "-u", "VIRTUAL_ENV",
            f"PATH={path}", sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "by path", "language": "python"}))
    return "by-path"


def test_the_tutorial_runs_in_a_kernel_started_by_path(tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    nb = nbformat.read(ROOT / "docs" / "tutorial.ipynb", as_version=4)
    n = len(nb.cells)
    # after the tutorial: the defaults fit its 64-token model, and an error is one line
    nb.cells.append(nbformat.v4.new_code_cell(
        "print('rows', sparklm.generate_dataframe(prompts, model=run.run_dir).count())"))
    nb.cells.append(nbformat.v4.new_code_cell(
        "sparklm.generate_dataframe(prompts, model=f'{work}/no-such-run')", metadata={"tags": ["raises-exception"]}))
    client = NotebookClient(nb, kernel_name=_kernel(tmp_path), timeout=900, allow_errors=False,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    text = "\n".join(o.get("text", "") + json.dumps(o.get("data", {})) for o in outputs)
    assert "SPARKLM-ERROR" not in text and "PythonException" not in text
    # the classifier labelled the last paragraph of each book
    shown = "".join(o.get("text", "") for o in nb.cells[n - 3].outputs)
    assert "emma" in shown or "persuasion" in shown, shown
    assert "report.html" in json.dumps([o.get("data") for o in nb.cells[n - 1].outputs])
    assert "rows 2" in "".join(o.get("text", "") for o in nb.cells[n].outputs)
    error = nb.cells[n + 1].outputs[-1]
    assert error.output_type == "error" and error.ename == "SparklmError"
    assert "no-such-run" in error.evalue and "\n" not in error.evalue and "SPARKLM" not in error.evalue
