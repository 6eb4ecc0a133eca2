"""The harness backend's pure parts: which split a file holds, which tasks --tasks names, where a dataset is read
from, and how the harness's results become figures and report rows."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from sparklm.infer.harness import LocalData, metrics, split_of, task_specs  # noqa: E402
from sparklm.infra.errors import SparklmError  # noqa: E402
from sparklm.metrics.html_report import benchmark_rows  # noqa: E402

RESULTS = {
    "results": {"arc_easy": {"alias": "arc_easy", "sample_len": 12, "acc,none": 0.5, "acc_stderr,none": 0.1,
                             "acc_norm,none": 0.25, "acc_norm_stderr,none": 0.05},
                "gsm8k": {"exact_match,strict-match": 0.125, "exact_match_stderr,strict-match": "N/A"}},
    "groups": {"ai2_arc": {"acc,none": 0.4}},
    "n-shot": {"arc_easy": 0, "gsm8k": 5},
    "n-samples": {"arc_easy": {"original": 2376, "effective": 12}},
}


@pytest.mark.parametrize("rel,split", [
    ("test.jsonl", "test"), ("validation-00000-of-00001.parquet", "validation"), ("data/train-0000.parquet", "train"),
    ("test/0000.parquet", "test"), ("dev.csv", "dev"), ("train/part-00001.parquet", "train"),
])
def test_a_files_split_comes_from_its_name_or_its_folder(rel, split):
    assert split_of(Path(rel)) == split


def test_tasks_are_names_files_or_directories(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.yaml").write_text("task: mine_a\ndataset_path: json\noutput_type: loglikelihood_rolling\n")
    specs = task_specs(["arc_easy", str(tmp_path / "t" / "a.yaml"), ""])
    assert specs.names == ["arc_easy", str(tmp_path / "t" / "a.yaml")] and specs.registry
    assert specs.include == [str(tmp_path / "t")]
    directory = task_specs([str(tmp_path / "t")])
    assert directory.names == ["mine_a"] and not directory.registry  # the harness's own tasks need not be indexed
    with pytest.raises(SparklmError, match="no such task file or directory"):
        task_specs([str(tmp_path / "gone.yaml")])
    with pytest.raises(SparklmError, match="names no task"):
        task_specs([" ", ""])


def test_local_data_by_dataset_name_or_under_a_root(tmp_path):
    (tmp_path / "hub" / "Rowan" / "hellaswag").mkdir(parents=True)
    (tmp_path / "arc").mkdir()
    data = LocalData([f"allenai/ai2_arc={tmp_path / 'arc'}", str(tmp_path / "hub")])
    assert data.find("allenai/ai2_arc") == tmp_path / "arc"
    assert data.find("Rowan/hellaswag") == tmp_path / "hub" / "Rowan" / "hellaswag"
    assert data.find("cais/mmlu") is None
    with pytest.raises(SparklmError, match="is not a directory"):
        LocalData([f"x={tmp_path / 'nowhere'}"])


def test_results_become_figures_and_report_rows():
    assert metrics(RESULTS) == {"arc_easy/acc": 0.5, "arc_easy/acc_norm": 0.25, "gsm8k/exact_match,strict-match": 0.125,
                                "ai2_arc/acc": 0.4}
    rows = benchmark_rows(RESULTS)
    assert rows[0] == ("ai2_arc", "acc", "none", 0.4, None, "", "")  # groups first
    assert ("arc_easy", "acc", "none", 0.5, 0.1, 0, 12) in rows
    assert ("gsm8k", "exact_match", "strict-match", 0.125, "N/A", 5, "") in rows
