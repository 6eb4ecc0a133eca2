"""The wheel is the product (issue 55): ``python -m build`` makes an sdist and a wheel; the wheel installed alone into
a fresh virtual environment runs the commands from a directory outside the checkout; and the manual builds with
``mkdocs build --strict`` (no broken link, no missing reference)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("package")]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(the wheel, a fresh venv's bin/ with only that wheel installed into it). Its dependencies come from this
    environment's site-packages through a path file: this environment's own editable sparklm is not among them
    (a path file's directory is searched, its own path files are not run), so ``import sparklm`` can only find the
    wheel's."""
    root = tmp_path_factory.mktemp("package")
    dist = root / "dist"
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    wheel = next(dist.glob("sparklm-*.whl"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "zz_dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    r = subprocess.run([str(venv / "bin" / "pip"), "install", "--no-deps", "--no-index", "-q", str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return wheel, venv / "bin", root


def _run(bin_dir: Path, cwd: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYSPARK_", "VIRTUAL_ENV"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", SPARK_LOCAL_IP="127.0.0.1")
    return subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_sdist_and_wheel_hold_what_the_commands_need(installed):
    wheel, _, root = installed
    names = zipfile.ZipFile(wheel).namelist()
    for needed in ("sparklm/cli.py", "sparklm/log4j2.properties", "sparklm/corpus/emma.txt",
                   "sparklm/tasks/regress.py", "sparklm/spark/resources.py"):
        assert needed in names, needed
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Provides-Extra: all" in meta and "Provides-Extra: mlflow" in meta and "Classifier:" in meta
    sdist = next((root / "dist").glob("sparklm-*.tar.gz"))
    members = tarfile.open(sdist).getnames()
    assert any(m.endswith("/pyproject.toml") for m in members) and any(m.endswith("/src/sparklm/cli.py") for m in members)


def test_the_installed_wheel_runs_outside_the_checkout(installed, tmp_path):
    _, bin_dir, _ = installed
    py = str(bin_dir / "python")
    r = _run(bin_dir, tmp_path, py, "-c", "import sparklm, sys; print(sparklm.__file__)")
    assert r.returncode == 0 and str(ROOT) not in r.stdout and str(bin_dir.parent) in r.stdout, r.stdout + r.stderr
    r = _run(bin_dir, tmp_path, str(bin_dir / "sparklm"), "--version")
    assert r.returncode == 0 and r.stdout.startswith("sparklm "), r.stderr
    r = _run(bin_dir, tmp_path, str(bin_dir / "sparklm"), "config")
    assert r.returncode == 0 and "[train]" in r.stdout
    # the main job from the wheel: the bundled corpus, Spark local mode, a 20-second budget
    r = _run(bin_dir, tmp_path, str(bin_dir / "sparklm"), "run", "--time-budget", "20", "-o", "runs/main",
             "--master", "local[2]", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "main" / "summary.json").read_text())
    assert summary["steps"] > 0 and (tmp_path / "runs" / "main" / "model" / "model.safetensors").exists()
    # the Beam engine (the extra is installed in the environment the venv shares)
    (tmp_path / "in.txt").write_text("\n\n".join(f"paragraph {i} of a short text for the beam engine." * 3
                                                 for i in range(60)))
    r = _run(bin_dir, tmp_path, str(bin_dir / "sparklm"), "prepare", "in.txt", "-o", "beam-data", "--engine", "beam",
             "--vocab-size", "300", "--seq-len", "32")
    assert r.returncode == 0, r.stderr[-3000:]
    # the Python API
    code = ("import sparklm; r = sparklm.fit(data='beam-data', output='api-run', settings={'train.max_steps': 2, "
            "'model.n_layer': 1, 'model.n_embd': 32, 'model.n_head': 2, 'train.eval_every': 0}); "
            "print('steps', r.summary['steps'])")
    r = _run(bin_dir, tmp_path, py, "-c", code)
    assert r.returncode == 0 and "steps 2" in r.stdout, r.stderr[-3000:]


def test_the_manual_builds_strict(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"),
                        "--config-file", str(ROOT / "mkdocs.yml")], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    site = tmp_path / "site"
    cli = (site / "reference" / "cli" / "index.html").read_text()
    assert "--device" in cli and "sparklm prepare" in cli  # generated from the parser
    api = (site / "reference" / "api" / "index.html").read_text()
    assert "classify_dataframe" in api or "fit" in api
    assert (site / "tutorial.ipynb").exists() and (site / "benchmarks" / "index.html").exists()
