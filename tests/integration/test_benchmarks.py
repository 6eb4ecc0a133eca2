"""`sparklm eval --tasks`: lm-evaluation-harness's tasks scored on Spark give exactly the harness's own numbers, read
only local data, and fail in one line. (Two Spark workers: test_cluster.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import sparklm
from conftest import HARNESS_TASKS, assert_same_figures, harness_reference, harness_toy

pytest.importorskip("lm_eval")
# one test process takes the file: the toy model and task files are made once, the harness's task index read once
pytestmark = pytest.mark.xdist_group("harness")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return harness_toy(tmp_path_factory.mktemp("harness"))


def test_tasks_on_spark_equal_the_harness_hf_backend(spark, toy, tmp_path):
    """Multiple choice with two shots (acc, acc_norm), rolling log-likelihood (word and byte perplexity, bits per
    byte), greedy generation (exact match, and each generated text) and the harness's own arc_easy over local files:
    the figures of its `simple_evaluate` with its HF backend, to 4 decimals, from local mode's one executor."""
    tasks = [*HARNESS_TASKS, "arc_easy"]
    theirs = harness_reference(toy, tasks)
    ours = sparklm.evaluate(str(toy / "model"), tasks=[str(toy / "tasks"), "arc_easy"], batch_size=4,
                            task_data=[f"allenai/ai2_arc={toy / 'ai2_arc'}"], log_samples=True,
                            output=str(tmp_path / "out"), spark=spark)
    assert_same_figures(ours, theirs)
    assert ours["n-shot"]["toy_mc"] == 2 and ours["n-samples"]["toy_mc"]["effective"] == 16
    counts = ours["config"]["requests"]
    assert (counts["loglikelihood"], counts["loglikelihood_rolling"], counts["generate_until"]) == (16 * 4 + 12 * 4, 6, 10)
    # the harness's results file, which its own tooling reads, and the report beside it
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["results"]["arc_easy"]["acc,none"] == ours["results"]["arc_easy"]["acc,none"]
    assert saved["configs"]["toy_mc"]["num_fewshot"] == 2 and "lm_eval_version" in saved
    assert (tmp_path / "out" / "samples_toy_gen.jsonl").read_text().count("\n") == 10
    page = (tmp_path / "out" / "report.html").read_text()
    assert "arc_easy" in page and "acc_norm" in page and f"{ours['results']['toy_mc']['acc,none']:.4f}" in page
    # --limit and --seed reach the harness as its own flags do
    few = sparklm.evaluate(str(toy / "model"), tasks=str(toy / "tasks" / "mc.yaml"), limit=5, seed=3, spark=spark)
    assert few["n-samples"]["toy_mc"]["effective"] == 5 and few["config"]["random_seed"] == 3


def test_the_cli_prints_the_table_and_every_mistake_is_one_line(spark, toy, tmp_path, capsys):
    from sparklm.cli import main

    model, out = str(toy / "model"), tmp_path / "out"  # (a fresh process's run: test_cluster.py, on two workers)
    assert main(["eval", model, "--tasks", str(toy / "tasks" / "roll.yaml"), "-o", str(out), "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    assert "|toy_roll|" in printed and "bits_per_byte" in printed  # the harness's own table
    assert json.loads((out / "results.json").read_text())["results"]["toy_roll"]["sample_len"] == 6
    broken = toy / "broken"
    broken.mkdir()
    (broken / "gone.yaml").write_text((toy / "tasks" / "roll.yaml").read_text().replace("pages.jsonl", "gone.jsonl"))
    (out / "notes.txt").write_text("mine")
    mistakes = [  # in this process (the session is the fixture's): each a line of its own, nothing written
        (["--tasks", f"{toy / 'tasks'},arc_easyy"], "unknown task 'arc_easyy' (did you mean arc_easy"),
        (["--tasks", f"{toy / 'tasks'},arc_easy"], "the dataset allenai/ai2_arc (ARC-Easy) is not on this machine, and sparklm never "
                                  "downloads (hint: put its splits in a directory and pass --task-data allenai/ai2_arc=DIR"),
        (["--tasks", f"{toy / 'tasks'},arc_easy", "--task-data", f"arc_easy={toy / 'tasks'}"],
         f"no data files for the dataset allenai/ai2_arc in {toy / 'tasks'}"),
        (["--tasks", f"{toy / 'tasks'},arc_easy", "--task-data", f"arc_easy={toy / 'data'}"],
         f"cannot read the dataset allenai/ai2_arc in {toy / 'data'}: "),
        (["--tasks", str(toy / "nowhere.yaml")], "no such task file or directory"),
        (["--tasks", str(broken / "gone.yaml")], f"a task's data file {toy / 'data' / 'gone.jsonl'} is not found"),
        (["--tasks", str(toy / "tasks"), "-o", str(out)], f"{out} already exists (hint: pass --overwrite"),
        (["--tasks", str(toy / "tasks"), "-o", str(out), "--overwrite"], "holds files eval did not write (notes.txt)"),
        (["--tasks", "arc_easy", "--input", "x.txt"], "--input and --tasks exclude each other"),
        ([], "eval takes --input (text to score) or --tasks (benchmark tasks)"),
    ]
    for args, line in mistakes:
        capsys.readouterr()
        assert main(["eval", model, *args]) != 0
        err = capsys.readouterr().err
        assert line in err and "Traceback" not in err, (args, err[-2000:])
        assert len([x for x in err.splitlines() if x.startswith("error:")]) == 1, (args, err[-2000:])
    assert (out / "notes.txt").read_text() == "mine" and (out / "results.json").is_file()


def test_without_the_harness_installed_the_flag_is_one_line(toy):
    code = ("import sys; sys.modules['lm_eval'] = None; from sparklm.cli import main; "
            f"sys.exit(main(['eval', {str(toy / 'model')!r}, '--tasks', 'arc_easy']))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "benchmark tasks (--tasks) need lm-evaluation-harness (hint: pip install 'sparklm[eval]')" in r.stderr
