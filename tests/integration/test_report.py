"""report.html of real runs (DDP and DiLoCo on Spark local mode), as headless Chromium renders it, and
`sparklm report`'s comparison of runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import cfg
from sparklm.cli import main
from sparklm.launch.train import train


@pytest.fixture(scope="module")
def runs(spark, dataset, tmp_path_factory) -> dict[str, Path]:
    """A DDP run with samples and a DiLoCo run of two workers, both evaluated twice (the session's Spark: UI off)."""
    root = tmp_path_factory.mktemp("report-runs")
    train(dataset, output=str(root / "ddp"), config=cfg(max_steps=8, eval_every=4), spark=spark)
    train(dataset, output=str(root / "diloco"), config=cfg(max_steps=8, eval_every=4, samples=0, strategy="diloco",
                                                           sync_every=4, workers=2), spark=spark)
    return {"ddp": root / "ddp", "diloco": root / "diloco"}


def test_every_run_directory_has_its_report(runs):
    ddp, diloco = ((runs[k] / "report.html").read_text() for k in ("ddp", "diloco"))
    # curves: loss, 3 other evaluation figures, training accuracy, LR, throughput, MFU, memory, gradient norm; DiLoCo
    # adds 3 of rounds
    assert ddp.count("<svg") == 10 and diloco.count("<svg") == 13
    assert "Content-Security-Policy" in ddp  # what loads from elsewhere is blocked: the Chromium test sees it
    assert "<td>train.max_steps</td><td>8</td>" in ddp and "<td>train.strategy</td><td>diloco</td>" in diloco
    assert "--- prompt: " in ddp and "No samples.txt" in diloco
    assert "inner loss per worker" in diloco and "round timings" in diloco and "inner loss" not in ddp
    for name, page in (("ddp", ddp), ("diloco", diloco)):
        spark = json.loads((runs[name] / "summary.json").read_text())["spark"]
        # the fixture's session has no UI: the status tracker's figures, of the training's jobs only
        assert spark["source"].startswith("Spark status tracker") and "task_seconds" not in spark
        assert spark["jobs"] >= 1 and spark["tasks"] >= 1 and spark["failed_tasks"] == 0, spark
        assert f"<td>tasks</td><td>{spark['tasks']:,}</td>" in page
    rounds = json.loads((runs["diloco"] / "summary.json").read_text())
    assert rounds["spark"]["tasks"] >= 2 * rounds["rounds"]  # each round: a task per worker


# -- headless Chromium ------------------------------------------------------------------------------------------------


def chromium(page: Path, out: Path, name: str) -> tuple[str, list[str], Path]:
    """Load ``page`` in headless Chromium (Debian's package): (the DOM once loaded, the console's messages, a
    screenshot of the first 1280×2000 pixels). The console goes to stderr with --enable-logging; every message is
    a finding here (the report runs no script; a blocked load is a Content-Security-Policy message)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed (apt-get install chromium)")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    shot = out / f"{name}.png"
    r = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                        "--disable-quic", "--no-first-run", "--disable-background-networking",
                        "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                        f"--user-data-dir={out / 'chromium-profile'}", "--enable-logging=stderr", "--v=0",
                        f"--screenshot={shot}", "--window-size=1280,2000", "--dump-dom", page.as_uri()],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout, [line for line in r.stderr.splitlines() if ":CONSOLE" in line], shot


def test_chromium_renders_the_report_with_its_plots_and_no_console_error(runs, tmp_path):
    from PIL import Image

    # the check itself: a script's error and a load the page's policy blocks both reach it
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><body><p>x</p><script>throw new Error("deliberate")</script></body></html>')
    _, console, _ = chromium(bad, tmp_path, "bad")
    assert any("Uncaught Error: deliberate" in line for line in console), console
    leaky = tmp_path / "leaky.html"
    leaky.write_text((runs["ddp"] / "report.html").read_text().replace(
        "<body>", '<body><img src="https://example.invalid/x.png">', 1))
    _, console, _ = chromium(leaky, tmp_path, "leaky")
    assert any("Content Security Policy" in line and "example.invalid" in line for line in console), console

    for name in ("ddp", "diloco"):
        dom, console, shot = chromium(runs[name] / "report.html", tmp_path, name)
        assert console == [], console
        assert dom.count("<svg") == (10 if name == "ddp" else 13) and "Headline figures" in dom
        image = Image.open(shot).convert("RGB")  # kept in tmp_path for a look
        assert image.size == (1280, 2000) and shot.stat().st_size > 50_000
        gray = image.convert("L")
        inked = sum(gray.histogram()[:200]) / (1280 * 2000)  # pixels darker than the page's near-white
        colors = len(image.getcolors(1 << 20) or [])
        assert inked > 0.01 and colors > 100, (inked, colors)  # text, tables and coloured curves, not a blank page


# -- `sparklm report` -------------------------------------------------------------------------------------------------


def test_cli_writes_one_run_again_and_compares_several(runs, tmp_path, capsys):
    one = runs["ddp"] / "report.html"
    before = one.read_text()
    one.unlink()
    assert main(["report", str(runs["ddp"])]) == 0
    assert one.read_text() == before  # the same page from the same files
    out = tmp_path / "both.html"
    assert main(["report", str(runs["ddp"]), str(runs["diloco"]), "--output", str(out)]) == 0
    page = out.read_text()
    assert page.count("<svg") == 4 and "<th>ddp</th><th>diloco</th>" in page and "2 sparklm runs" in page
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(out)
    assert main(["report", str(runs["ddp"]), str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {tmp_path} is not a sparklm run directory"), err
    # --output replaces a page sparklm wrote (the comparison above, again), never another file: it wrote its page
    # over a user's text file given by mistake
    assert main(["report", str(runs["ddp"]), str(runs["diloco"]), "--output", str(out)]) == 0
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    for runs_given in ([runs["ddp"]], [runs["ddp"], runs["diloco"]]):
        capsys.readouterr()
        assert main(["report", *map(str, runs_given), "--output", str(notes)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: refusing to replace {notes}: it is not a page sparklm "
                                                   "wrote"), err
        assert notes.read_text() == "my notes\n"
    assert main(["report", str(runs["ddp"]), "--output", str(tmp_path)]) == 2  # a directory
    assert "is a directory" in capsys.readouterr().err
