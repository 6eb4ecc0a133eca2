"""The suite's own promise: tests marked with one ``xdist_group`` run in one test process, so a group's module
fixtures (a standalone cluster, the fine-tuning models) are made once. pytest-xdist 3.8 marks them in a way pytest 9
ignores; tests/conftest.py marks them again (``_name_groups``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

GROUPED = '''
import os
import time

import pytest

pytestmark = pytest.mark.xdist_group("together")


@pytest.mark.parametrize("n", range(4))
def test_grouped(n):
    time.sleep(0.2)  # long enough for the other process to take a test, were the group spread
    with open(f"ran-{n}", "w") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"])
'''


def test_a_group_runs_in_one_test_process(tmp_path):
    shutil.copy(Path(__file__).resolve().parents[1] / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    r = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
                        "-q", "test_grouped.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    workers = [(tmp_path / f"ran-{n}").read_text() for n in range(4)]
    assert len(set(workers)) == 1 and workers[0].startswith("gw"), workers
