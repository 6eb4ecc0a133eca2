"""The run report's pure parts: Spark's figures from stage and executor records, the job window, the page's escaping
and self-containment (train/html_report.py, spark_figures.py)."""

from __future__ import annotations

import http.server
import json
import re
import threading
from html.parser import HTMLParser
from types import SimpleNamespace

import pytest

from sparklm.infra.errors import SparklmError
from sparklm.metrics import html_report
from sparklm.metrics.html_report import RunData, read_run, render_comparison, render_run, thin
from sparklm.model.figures import LM_FIGURES
from sparklm.spark import figures as spark_figures


def stage(sid, attempt=0, status="COMPLETE", **kw):
    """A stage attempt as Spark 4's REST API writes it (the keys the figures read; the values made up)."""
    return {"status": status, "stageId": sid, "attemptId": attempt, "numTasks": 2, "numCompleteTasks": 2,
            "numFailedTasks": 0, "numKilledTasks": 0, "executorRunTime": 1500, "executorCpuTime": 2_000_000_000,
            "jvmGcTime": 30, "inputBytes": 100, "outputBytes": 0, "shuffleReadBytes": 10, "shuffleWriteBytes": 20,
            "diskBytesSpilled": 0, "name": f"stage {sid}", **kw}


def executor(eid, heap, python=0):
    return {"id": eid, "peakMemoryMetrics": {"JVMHeapMemory": heap, "JVMOffHeapMemory": heap // 2,
                                             "ProcessTreePythonRSSMemory": python}}


def test_aggregate_sums_stage_attempts_and_counts_retries():
    stages = [stage(3), stage(4, numFailedTasks=1), stage(4, attempt=1, numTasks=1, numKilledTasks=1),
              stage(5, status="SKIPPED", executorRunTime=0)]  # skipped: ran nothing, not a stage of the job's
    out = spark_figures.aggregate(stages, [executor("driver", 900), executor("1", 300), executor("2", 500)],
                                  jobs=2, source="rest")
    assert out["source"] == "rest" and out["jobs"] == 2
    assert (out["stages"], out["stage_attempts"], out["retried_stages"]) == (2, 3, 1)
    assert (out["tasks"], out["failed_tasks"], out["killed_tasks"]) == (5, 1, 1)
    assert out["task_seconds"] == pytest.approx(4.5) and out["cpu_seconds"] == pytest.approx(6.0)
    assert out["gc_seconds"] == pytest.approx(0.09)
    assert (out["input_bytes"], out["shuffle_read_bytes"], out["shuffle_write_bytes"]) == (300, 30, 60)
    # the executors' peaks, not the driver's; Python's RSS is absent where Spark did not sample it (0)
    assert out["executors"] == 2 and out["executor_peak_jvm_heap_bytes"] == 500
    assert out["executor_peak_jvm_off_heap_bytes"] == 250 and "executor_peak_python_rss_bytes" not in out


def test_aggregate_of_the_status_tracker_leaves_out_what_it_does_not_know():
    tracker = [{"stageId": 0, "attemptId": 0, "numTasks": 2, "numCompleteTasks": 2, "numFailedTasks": 0},
               {"stageId": 1, "attemptId": 2, "numTasks": 1, "numCompleteTasks": 1, "numFailedTasks": 3}]
    out = spark_figures.aggregate(tracker, [], jobs=2)
    assert out == {"jobs": 2, "stages": 2, "stage_attempts": 2, "retried_stages": 1, "tasks": 3, "failed_tasks": 3}
    # local mode: the driver is the one executor; a peak not sampled yet (before the first heartbeat) is absent
    local = spark_figures.aggregate([], [executor("driver", 0)])
    assert local["executors"] == 1 and "executor_peak_jvm_heap_bytes" not in local


class FakeTracker:
    def __init__(self, jobs: dict[int, list[int]], group: str, stages: dict[int, SimpleNamespace]):
        self.jobs, self.group, self.stages = jobs, group, stages

    def getJobIdsForGroup(self, group):
        return list(self.jobs) if group == self.group else []

    def getJobInfo(self, job):
        return SimpleNamespace(jobId=job, stageIds=self.jobs[job], status="SUCCEEDED")

    def getStageInfo(self, sid):
        return self.stages.get(sid)


class FakeContext:
    def __init__(self, tracker, ui=None, group=None):
        self.tracker, self.uiWebUrl, self.applicationId = tracker, ui, "app-1"
        self.props = {"spark.jobGroup.id": group} if group else {}

    def statusTracker(self):
        return self.tracker

    def getLocalProperty(self, key):
        return self.props.get(key)

    def setLocalProperty(self, key, value):
        if value is None:
            self.props.pop(key, None)
        else:
            self.props[key] = value


@pytest.fixture
def ui_server():
    """The two REST endpoints of a Spark UI, answering canned stages (0 to 3) and executors."""
    answers = {"/api/v1/applications/app-1/stages": [stage(s) for s in range(4)],
               "/api/v1/applications/app-1/allexecutors": [executor("driver", 123)]}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (the http.server name)
            body = json.dumps(answers[self.path]).encode() if self.path in answers else b""
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_collect_reads_the_jobs_of_its_window_from_the_rest_api_or_else_the_tracker(ui_server):
    stages = {s: SimpleNamespace(stageId=s, currentAttemptId=0, name=f"s{s}", numTasks=4, numCompletedTasks=4,
                                 numFailedTasks=0) for s in range(4)}
    sc = FakeContext(FakeTracker({0: [0], 1: [1, 2]}, "sparklm-x", stages), ui=ui_server)
    spark = SimpleNamespace(sparkContext=sc)
    window = spark_figures.Window("sparklm-x", frozenset({0}))  # job 0 ran before the block
    rest = spark_figures.collect(spark, window)
    assert rest["source"] == "Spark UI REST API" and rest["jobs"] == 1
    assert (rest["stages"], rest["tasks"], rest["task_seconds"]) == (2, 4, pytest.approx(3.0))
    assert rest["executor_peak_jvm_heap_bytes"] == 123
    sc.uiWebUrl = ui_server + "/nothing-here"  # a UI that does not answer (a proxy, authentication): the tracker
    tracked = spark_figures.collect(spark, window)
    assert tracked["source"] == "Spark status tracker (the UI's REST API did not answer)"
    assert (tracked["stages"], tracked["tasks"]) == (2, 8) and "task_seconds" not in tracked
    sc.uiWebUrl = None  # spark.ui.enabled=false
    assert spark_figures.collect(spark, window) == {**tracked, "source": "Spark status tracker (UI disabled)"}
    assert spark_figures.collect(spark, None) == {}
    broken = SimpleNamespace(sparkContext=SimpleNamespace(statusTracker=lambda: 1 / 0))
    assert spark_figures.collect(broken, window) == {}  # never a traceback: the run goes on without them


def test_window_tags_the_block_and_keeps_a_callers_job_group():
    sc = FakeContext(FakeTracker({}, "", {}))
    with spark_figures.window(SimpleNamespace(sparkContext=sc)) as w:
        assert w.group.startswith("sparklm-") and sc.props["spark.jobGroup.id"] == w.group
    assert "spark.jobGroup.id" not in sc.props  # as it was
    notebook = FakeContext(FakeTracker({7: [1]}, "cell-42", {}), group="cell-42")  # a notebook cell's group
    with spark_figures.window(SimpleNamespace(sparkContext=notebook)) as w:
        assert w == spark_figures.Window("cell-42", frozenset({7}))  # its earlier jobs are left out
    assert notebook.props["spark.jobGroup.id"] == "cell-42"
    with spark_figures.window(SimpleNamespace()) as w:  # no SparkContext (Spark Connect): the block still runs
        assert w is None


# -- the page ---------------------------------------------------------------------------------------------------------

HOSTILE = '<script>alert("x")</script><img src=x onerror=alert(1)>'


def hostile_run(name: str = "run<b>") -> RunData:
    train = [{"kind": "train", "step": s, "tokens": 64 * s, "loss": 5.0 - 0.1 * s, "lr": 1e-3, "grad_norm": 1.0,
              "tokens_per_s": 1000.0, "mfu": 0.01, "rss_mb": 300.0, "peak_rss_mb": 310.0,
              "rank_peak_rss_mb": "305/310", "epoch": 0.1} for s in range(1, 9)]
    evals = [{"kind": "eval", "step": 4, "tokens": 256, "val_loss": 4.7, "val_ppl": 110.0, "val_bpb": 3.1,
              "val_acc": 0.1, "val_tokens": 100}]
    rounds = [{"round": 1, "step": 4, "workers": 2, "workers_done": 2, "loss": 4.8, "inner_losses": "4.79;4.81",
               "attempts": "0;1", "cold": "", "broadcast_bytes": 1000, "returned_bytes": 900, "broadcast_s": 0.1,
               "fetch_s": 0.01, "compute_s": 0.5, "aggregate_s": 0.05, "round_s": 0.7}]
    config = {"config": {"model": {"task": "causal-lm"}, "train": {"max_steps": 8, "note": HOSTILE},
                         "spark": {"conf": {"spark.secret.key": "***"}}},
              "decided": {"train.threads": 1}, "data": HOSTILE}
    summary = {"task": "causal-lm", "strategy": HOSTILE, "steps": 8, "tokens": 512, "final": evals[0],
               "best": {**evals[0], "step": 4}, "spark": {"source": HOSTILE, "jobs": 1, "stages": 1, "tasks": 2,
                                                          "failed_tasks": 0}}
    return RunData(uri=f"/runs/{name}", config=config, summary=summary, train=train, evals=evals, rounds=rounds,
                   samples=f"--- prompt: 'x'\n{HOSTILE}", figures=LM_FIGURES)


def external_references(page: str) -> list[str]:
    """Every URL an element of the page names (src, href, xlink:href, CSS url()) that is not data: or within the
    page."""
    found: list[str] = []

    class Parser(HTMLParser):
        def handle_starttag(self, tag, attrs):
            for name, value in attrs:
                if name in ("src", "href", "xlink:href", "action", "poster") and value:
                    found.append(value)
                if name == "style" and value:
                    found.extend(re.findall(r"url\(\s*['\"]?([^'\")]+)", value))

        def handle_data(self, data):
            if self.lasttag == "style":
                found.extend(re.findall(r"url\(\s*['\"]?([^'\")]+)", data))

    Parser().feed(page)
    return [u for u in found if not u.startswith(("data:", "#"))]


def test_the_page_escapes_every_text_from_the_run_and_loads_nothing():
    page = render_run(hostile_run())
    assert "<script" not in page and "<img" not in page and "<b>" not in page
    assert page.count("&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;") >= 5  # samples, config, data, spark, strategy
    assert "run&lt;b&gt;" in page
    assert external_references('<img src="https://e.invalid/x.png"><svg><use xlink:href="#m1"/></svg>'
                               '<div style="background:url(http://e.invalid/b)">') == [  # the check sees them
        "https://e.invalid/x.png", "http://e.invalid/b"]
    assert page.count("<svg") == 12 and "Content-Security-Policy" in page and external_references(page) == []
    assert "inner loss per worker" in page and "tr class=changed" in page  # rounds; train.max_steps is not a default
    assert ">spark.conf.spark.secret.key</td><td>***<" in page  # as config.json holds it, masked


def test_comparison_overlays_runs_whose_names_matplotlib_would_misread(tmp_path):
    page = render_comparison([hostile_run("a$x$"), hostile_run("_b")])
    assert page.count("<svg") == 4 and external_references(page) == []
    assert "a$x$" in page and "_b" in page and "<th>a$x$</th><th>_b</th>" in page


def test_a_path_that_is_not_a_run_directory_is_one_error(tmp_path):
    with pytest.raises(SparklmError, match="is not a sparklm run directory"):
        read_run(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "metrics.csv").write_text("kind,step\n")
    with pytest.raises(SparklmError, match="cannot read"):
        read_run(str(tmp_path))


def test_thin_keeps_a_long_curve_short_with_its_ends():
    xs = list(range(10_001))
    tx, ty = thin(xs, xs, 2000)
    assert len(tx) <= 2001 and tx[0] == 0 and tx[-1] == 10_000 and tx == ty
    assert thin([1, 2], [3, 4]) == ([1, 2], [3, 4])
    assert html_report.flatten({"a": {"b": {"c": 1}, "d": {}}}) == {"a.b.c": 1, "a.d": {}}
