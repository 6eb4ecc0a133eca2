"""Are the ranges pyproject.toml declares true? Install one end of them in a scratch venv and try sparklm there.

    python3 scripts/check_ranges.py lowest   # torch's companions at the floors pyproject allows, the rest resolved
    python3 scripts/check_ranges.py newest   # no lock: the newest release of everything (torch stays the CPU build)

Each mode makes a fresh virtual environment, installs the project with its test extra, prints the versions it
got, runs the unit and fine-tuning tests and a short `sparklm run --time-budget 20`, and ends with one summary line (exit 0 when
both pass). Not part of CI's time budget (~6-10 minutes on 2 cores); run it before moving a floor, and when a
dependency releases, to find what breaks sparklm with one command. The results go in the README's
"Dependencies" section.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"  # the CPU build on these machines (a looser pin downloads a CUDA build)
COMPANIONS = ("transformers", "peft", "tokenizers", "pyarrow", "pyspark")  # torch's companions, tried at floors


def floors(names: tuple[str, ...] = COMPANIONS) -> dict[str, str]:
    """``{name: lowest version}`` from pyproject's ``>=`` bounds for ``names``."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    found = {}
    for dep in deps:
        m = re.match(r"^([A-Za-z0-9_.-]+)\s*(?:\[[^]]*\])?\s*([^;]*)", dep)
        name, spec = m.group(1).lower(), m.group(2)
        low = re.search(r">=\s*([0-9][^,\s]*)", spec)
        if name in names and low:
            found[name] = low.group(1)
    missing = set(names) - set(found)
    if missing:
        raise SystemExit(f"pyproject.toml declares no >= floor for {', '.join(sorted(missing))}")
    return found


def run(cmd: list[str], log: Path, **kw) -> subprocess.CompletedProcess:
    print("$", " ".join(cmd), flush=True)
    with open(log, "a") as f:
        return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True, **kw)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["lowest", "newest"])
    parser.add_argument("--keep", metavar="DIR", help="build the venv and the run here (kept) instead of a temp dir")
    args = parser.parse_args()
    work = Path(args.keep or tempfile.mkdtemp(prefix=f"sparklm-{args.mode}-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "log.txt"
    log.write_text("")
    pins = [TORCH] + ([f"{n}=={v}" for n, v in floors().items()] if args.mode == "lowest" else [])
    (work / "constraints.txt").write_text("\n".join(pins) + "\n")
    py = work / "venv" / "bin" / "python"
    t0 = time.time()
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(work / "venv")], check=True)
    got = run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c", str(work / "constraints.txt"),
               TORCH, "-e", f"{ROOT}[test]"], log)
    if got.returncode:
        print(f"{args.mode}: the install failed (pins {', '.join(pins[1:]) or 'none'}); see {log}")
        return 1
    versions = subprocess.run([str(py), "-c", "import importlib.metadata as m; print(' '.join(f'{n} {m.version(n)}' "
                               f"for n in {('torch', *COMPANIONS, 'numpy', 'accelerate', 'gguf')!r}))"],
                              capture_output=True, text=True).stdout.strip()
    print(versions)
    # The unit tests, and the fine-tuning tests: the only ones that drive peft (LoRA on every strategy).
    unit = run([str(py), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/unit",
                "tests/integration/test_finetune.py"], log, cwd=ROOT)
    tail = log.read_text().strip().splitlines()[-1]
    run_dir = work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)  # an earlier check's
    job = run([str(work / "venv" / "bin" / "sparklm"), "run", "--time-budget", "20", "--output", str(run_dir)], log,
              cwd=work)
    figure = ""
    if job.returncode == 0:
        import json

        summary = json.loads((run_dir / "summary.json").read_text())
        kept = summary.get("best") or summary.get("final") or {}  # the model/ the run keeps
        figure = f"val_bpb {kept['val_bpb']:.4f} in {summary['steps']} steps" if "val_bpb" in kept else ""
    ok = unit.returncode == 0 and job.returncode == 0
    print(f"{args.mode}: {versions} | unit + fine-tuning tests: {tail} | sparklm run --time-budget 20: "
          f"{'exit 0 ' + figure if job.returncode == 0 else f'exit {job.returncode}'} | "
          f"{time.time() - t0:.0f} s | {'PASS' if ok else 'FAIL'} (log: {log})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
