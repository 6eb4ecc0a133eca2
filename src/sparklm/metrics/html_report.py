"""report.html: a run directory's page, and ``sparklm report``'s page of several runs side by side.

One self-contained file: inline CSS, charts as inline SVG drawn by matplotlib, no script. It opens as it is from an
object store, an e-mail or a host without a network, and its Content-Security-Policy blocks anything that would load
from elsewhere (a browser says so on its console: the test's check). Everything on it is read from the run
directory's files, so ``sparklm report RUN`` writes the same page again at any time; every text taken from a file is
HTML-escaped.
"""

from __future__ import annotations

import html
import io
import json
import posixpath
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import StorageConfig
from ..infra.errors import SparklmError
from ..infra.fs import exists, join, read_text, write_text
from ..infra.progress import duration
from ..infra.redact import MASK
from ..model.figures import FigureSet
from ..registry import DEFAULT_TASK
from ..registry import task as task_info
from ..spark import figures as spark_figures
from .sinks import read_metrics

REPORT = "report.html"
_MAX_POINTS = 2000  # per curve: a long run's every step would make each chart megabytes, and look the same
_MAX_ROUND_ROWS = 200
_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px auto;max-width:1400px;padding:0 16px;
color:#1d1d1f}
h1{font-size:22px;margin-bottom:2px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd;padding-bottom:4px}
.sub{color:#666;margin-top:0}.note{color:#666;font-size:13px}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ddd;padding:3px 8px;text-align:right;
vertical-align:top}th{background:#f5f5f7}td:first-child,th:first-child{text-align:left}
tr.changed td{font-weight:600}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(520px,1fr));gap:12px}
figure{margin:0;border:1px solid #eee;padding:4px}figure svg{width:100%;height:auto}
pre{background:#f5f5f7;padding:12px;overflow-x:auto;white-space:pre-wrap;font-size:13px}
"""


@dataclass(frozen=True)
class RunData:
    """What a run directory holds, read once."""

    uri: str
    config: dict  # config.json: {"config": sections, "decided": ..., "data": ...}
    summary: dict  # summary.json; {} while the run has not ended
    train: list[dict]  # metrics.csv's train rows
    evals: list[dict]  # metrics.csv's eval rows
    rounds: list[dict]  # rounds.csv (average, diloco); [] for DDP
    samples: str | None  # samples.txt
    figures: FigureSet
    epochs: list[dict] = field(default_factory=list)  # epochs.csv: one row per pass over the training split
    benchmarks: dict | None = None  # eval_tasks.json: the harness's results for train.eval_tasks

    @property
    def task(self) -> str:
        return self.summary.get("task") or self.config.get("config", {}).get("model", {}).get("task", DEFAULT_TASK)

    @property
    def name(self) -> str:
        return posixpath.basename(self.uri.rstrip("/")) or self.uri


def read_run(run_dir: str, storage: StorageConfig | None = None) -> RunData:
    """The run in ``run_dir``; a SparklmError when it is not a run directory."""
    missing = [n for n in ("config.json", "metrics.csv") if not exists(join(run_dir, n), storage)]
    if missing:
        raise SparklmError(f"{run_dir} is not a sparklm run directory (no {' or '.join(missing)})",
                           hint="pass the --output of `sparklm train` or `sparklm run`")
    try:
        config = json.loads(read_text(join(run_dir, "config.json"), storage))
        summary_uri = join(run_dir, "summary.json")
        summary = json.loads(read_text(summary_uri, storage)) if exists(summary_uri, storage) else {}
        task = summary.get("task") or config["config"]["model"]["task"]
        figures = task_info(task).figures
    except (ValueError, KeyError, TypeError) as e:
        raise SparklmError(f"{run_dir} holds a config.json or summary.json sparklm cannot read ({type(e).__name__}: "
                           f"{e})", hint="restore it from a copy of the run directory") from None
    rows = read_metrics(join(run_dir, "metrics.csv"), storage)
    samples_uri = join(run_dir, "samples.txt")
    tasks_uri = join(run_dir, "eval_tasks.json")
    return RunData(benchmarks=json.loads(read_text(tasks_uri, storage)) if exists(tasks_uri, storage) else None,
                   uri=run_dir, config=config, summary=summary, train=[r for r in rows if r["kind"] == "train"],
                   evals=[r for r in rows if r["kind"] == "eval"],
                   rounds=read_metrics(join(run_dir, "rounds.csv"), storage), figures=figures,
                   epochs=read_metrics(join(run_dir, "epochs.csv"), storage),
                   samples=read_text(samples_uri, storage) if exists(samples_uri, storage) else None)


def write_report(run_dir: str, storage: StorageConfig | None = None, output: str | None = None) -> str:
    """Write the run's page (``run_dir``/report.html, or ``output``); return where it went."""
    if output:
        _check_page_output(output, storage)
    output = output or join(run_dir, REPORT)
    write_text(output, render_run(read_run(run_dir, storage)), storage)
    return output


def write_comparison(run_dirs: list[str], output: str, storage: StorageConfig | None = None) -> str:
    """Write a page with the runs side by side to ``output``; return it."""
    _check_page_output(output, storage)
    write_text(output, render_comparison([read_run(r, storage) for r in run_dirs]), storage)
    return output


_GENERATOR = '<meta name="generator" content="sparklm">'


def _check_page_output(output: str, storage: StorageConfig | None) -> None:
    """An ``output`` the user named may replace a page sparklm wrote (its generator tag, or the title of pages
    written before the tag), never another file: a path given by mistake must not lose what it held."""
    import pyarrow.fs as pafs

    from ..infra.fs import resolve

    fs, path = resolve(output, storage)
    kind = fs.get_file_info(path).type
    if kind == pafs.FileType.NotFound:
        return
    if kind == pafs.FileType.Directory:
        raise SparklmError(f"--output {output} is a directory", hint="name the page's file, e.g. DIR/report.html")
    with fs.open_input_stream(path) as f:
        head = f.read(4096).decode("utf-8", "replace")
    if _GENERATOR not in head and "<title>sparklm run" not in head:
        raise SparklmError(f"refusing to replace {output}: it is not a page sparklm wrote",
                           hint="choose another --output, or move the file away first")


# -- the pages --------------------------------------------------------------------------------------------------------


def render_run(run: RunData) -> str:
    """The page of one run."""
    s = run.summary
    sub = " · ".join(esc(x) for x in (s.get("strategy"), s.get("task"), run.uri) if x)
    body = [f"<h1>{esc(run.name)}</h1><p class=sub>{sub}</p>"]
    if not s:
        body.append("<p class=note>No summary.json: the run has not ended (or was stopped); the figures below are "
                    "those it logged.</p>")
    body += ["<h2>Headline figures</h2>", table(list(facts(run).items()), ("figure", "value")),
             "<h2>Curves</h2>", charts(run_charts(run))]
    if run.epochs:
        body += ["<h2>Epochs</h2>", epochs_table(run.epochs)]
    if run.rounds:
        body += ["<h2>Rounds</h2>", charts(round_charts(run)), rounds_table(run.rounds)]
    if run.benchmarks:
        body += benchmark_section(run.benchmarks)
    section = task_info(run.task).section  # the task's own: a causal LM's samples, a classifier's classes, ...
    body += section(run) if section is not None else []
    body += ["<h2>Spark</h2>", spark_section(s.get("spark")),
             "<h2>Configuration</h2>", config_table(run.config)]
    return page(f"sparklm run {run.name}", body)


def render_comparison(runs: list[RunData]) -> str:
    """The runs side by side: their headline figures in one table, their curves overlaid."""
    names = _names(runs)
    per_run = [facts(r) for r in runs]
    labels = list(dict.fromkeys(label for f in per_run for label in f))
    rows = [(label, *(f.get(label, "") for f in per_run)) for label in labels]
    loss = runs[0].figures.get(runs[0].figures.loss)

    def overlay(points: Callable[[RunData], tuple[list, list]], style: str = "-") -> Callable:
        def draw(ax) -> None:
            for name, run in zip(names, runs):
                xs, ys = thin(*points(run))
                if xs:
                    ax.plot(xs, ys, style, label=mpl_text(name), lw=1, ms=3)
        return draw

    def val(run: RunData) -> tuple[list, list]:
        key = run.figures.loss
        return _xy(run.evals, "tokens", key)

    curves = [
        svg("train loss", "tokens seen", "loss (nats/token)", overlay(lambda r: _xy(r.train, "tokens", "loss"))),
        svg(f"validation {loss.label}", "tokens seen", loss.label, overlay(val, "o-")),
        svg("throughput", "tokens seen", "tokens/s", overlay(lambda r: _xy(r.train, "tokens", "tokens_per_s"))),
    ]
    main = runs[0].figures.main
    if main.key != loss.key:
        curves.insert(2, svg(f"validation {main.label}", "tokens seen", main.label,
                             overlay(lambda r: _xy(r.evals, "tokens", main.key), "o-")))
    body = [f"<h1>{len(runs)} sparklm runs</h1>",
            "<p class=sub>" + " · ".join(f"<b>{esc(n)}</b>: {esc(r.uri)}" for n, r in zip(names, runs)) + "</p>",
            "<h2>Headline figures</h2>", table(rows, ("figure", *names)),
            "<h2>Curves</h2>", charts(curves)]
    return page("sparklm runs: " + ", ".join(names), body)


def page(title: str, body: list[str]) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">{_GENERATOR}'
            f'<meta name="viewport" content="width=device-width,initial-scale=1">'
            f"<title>{esc(title)}</title><style>{_CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")


# -- benchmark tasks (sparklm eval --tasks, train.eval_tasks): lm-evaluation-harness's results ----------------------


def benchmark_rows(results: dict) -> list[tuple]:
    """(task, metric, filter, value, stderr, n-shot, samples) for each figure of ``results`` (the harness's dict),
    groups first, then tasks, each in name order."""
    out = []
    for section in ("groups", "results"):
        for task in sorted(results.get(section) or {}):
            figures = results[section][task]
            for key in sorted(figures):
                value = figures[key]
                if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                    continue
                metric, _, flt = key.partition(",")
                stderr = figures.get(f"{metric}_stderr,{flt}")
                out.append((task, metric, flt, value, stderr, (results.get("n-shot") or {}).get(task, ""),
                            (results.get("n-samples") or {}).get(task, {}).get("effective", "")))
    return out


def render_benchmarks(results: dict, title: str) -> str:
    """The page for ``results``; ``title`` names the model."""
    body = [f"<h1>sparklm eval: {esc(title)}</h1>",
            f"<p class=sub>lm-evaluation-harness {esc(results.get('lm_eval_version', ''))}, "
            f"{len(results.get('results') or {})} task(s)</p>", *benchmark_section(results, "Results")]
    return page(f"sparklm eval: {title}", body)


def benchmark_section(results: dict, heading: str = "Benchmark tasks") -> list[str]:
    """The table and chart of ``results``: the page's body, and a run report's section (train.eval_tasks)."""
    figures = benchmark_rows(results)
    shown = [(task, metric, flt, f"{value:.4f}", "" if not isinstance(stderr, (int, float)) else f"± {stderr:.4f}",
              shots, n) for task, metric, flt, value, stderr, shots, n in figures]
    scores = [(f"{task} {metric}" + ("" if flt == "none" else f" ({flt})"), value)
              for task, metric, flt, value, _, _, _ in figures if 0.0 <= value <= 1.0]
    out = [f"<h2>{esc(heading)}</h2>", table(shown, ("task", "metric", "filter", "value", "stderr", "n-shot",
                                                       "samples"))]
    return out + ([charts([_score_bars(scores)])] if scores else [])


def _score_bars(scores: list[tuple[str, float]]) -> str:
    """One horizontal bar per score (a figure of its own: :func:`html_report.svg` draws numeric axes)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, max(1.6, 0.32 * len(scores) + 0.9)))
    fig.subplots_adjust(left=0.42, right=0.96, top=0.88, bottom=0.12)
    ax = fig.subplots()
    ax.barh(range(len(scores)), [s[1] for s in scores], color="#4c72b0")
    ax.set_yticks(range(len(scores)), [s[0] for s in scores], fontsize="small")
    ax.set_xlim(0, 1)
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    ax.set_title("scores (0 to 1)")
    return figure_svg(fig, "benchmark scores")


# -- the parts --------------------------------------------------------------------------------------------------------


def esc(value) -> str:
    """Text for HTML (element content and quoted attribute values)."""
    return html.escape(str(value), quote=True)


def table(rows: list[tuple], header: tuple[str, ...], classes: list[str] | None = None) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join(f"<tr{f' class={classes[i]}' if classes and classes[i] else ''}>"
                   + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for i, row in enumerate(rows))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def charts(svgs: list[str]) -> str:
    shown = [s for s in svgs if s]
    return f"<div class=charts>{''.join(shown)}</div>" if shown else "<p class=note>Nothing logged yet.</p>"


def facts(run: RunData) -> dict[str, str]:
    """The run's headline figures, label → text (the run page's table, a column of the comparison's)."""
    s, f = run.summary, run.figures
    last = run.train[-1] if run.train else {}
    final = s.get("final") or (run.evals[-1] if run.evals else {})
    out = {"task": s.get("task"), "strategy": s.get("strategy"), "workers": s.get("workers"),
           "steps": _count(s.get("steps", last.get("step"))), "tokens": _count(s.get("tokens", last.get("tokens"))),
           "epochs": _sig(s.get("epochs", last.get("epoch")))}
    for fig in f.figures:
        if fig.shown and final.get(fig.key) is not None:
            out[f"final {fig.label}"] = format(final[fig.key], fig.fmt)
    best = s.get("best")
    if best and best.get(f.main.key) is not None:
        out[f"best {f.main.label}"] = f"{best[f.main.key]:{f.main.fmt}} (step {best['step']})"
    out.update({
        "tokens/s (steady)": _count(round(s["tokens_per_s"])) if s.get("tokens_per_s") else None,
        "ms/step": _sig(s.get("ms_per_step")),
        "MFU": f"{s['mfu']:.2%}" if s.get("mfu") is not None else None,
        "peak memory": _mb(s.get("peak_rss_mb", last.get("peak_rss_mb"))),
        "peak memory per worker": " / ".join(_mb(m) for m in s.get("rank_peak_rss_mb") or []) or None,
        "wall time": _seconds(s.get("wall_seconds")), "training time": _seconds(s.get("train_seconds")),
        "parameters": _count(s.get("params")),
        "trainable parameters": _count(s.get("trainable_params")) if s.get("trainable_params") != s.get("params")
        else None,
        "dtype": s.get("dtype"), "rounds": _count(s.get("rounds")),
        "bytes communicated": _bytes(s.get("bytes_communicated")) if s.get("bytes_communicated") else None,
        "Spark application": s.get("spark_application_id"), "Spark master": s.get("spark_master"),
        "sparklm": s.get("sparklm_version") or run.config.get("sparklm_version"),
    })
    return {k: str(v) for k, v in out.items() if v is not None and v != ""}


def run_charts(run: RunData) -> list[str]:
    """The curves of one run: loss and each evaluation figure against tokens; LR, throughput, MFU, memory and the
    gradient norm against steps."""
    f, train, evals = run.figures, run.train, run.evals
    loss = f.get(f.loss)

    def draw_loss(ax) -> None:
        ax.plot(*thin(*_xy(train, "tokens", "loss")), lw=1, label="train loss")
        if any(r.get(loss.key) is not None for r in evals):
            ax.plot(*_xy(evals, "tokens", loss.key), "o-", ms=4, label=f"validation {loss.label}")

    out = [svg("loss", "tokens seen", "cross-entropy (nats/token)", draw_loss) if train else ""]
    for fig in f.figures:
        if fig.shown and fig.key != f.loss and any(r.get(fig.key) is not None for r in evals):
            out.append(svg(f"validation {fig.label}", "tokens seen", fig.label,
                           _lines([("", *_xy(evals, "tokens", fig.key))], "o-")))
    out += [
        _step_chart(train, "training accuracy", "next-token accuracy (%)", [("acc", "")], scale=100),
        _step_chart(train, "learning rate", "lr", [("lr", "")]),
        _step_chart(train, "throughput", "tokens/s", [("tokens_per_s", "")]),
        _step_chart(train, "model FLOPs utilisation", "MFU (%)", [("mfu", "")], scale=100),
        _step_chart(train, "resident memory", "MB", [("rss_mb", "now"), ("peak_rss_mb", "peak")],
                    extra=_worker_peaks(train)),
        _step_chart(train, "gradient norm", "norm (before clipping)", [("grad_norm", "")]),
    ]
    if len({r.get("workers") for r in train if r.get("workers")}) > 1:  # an elastic run whose world size changed
        out.append(_step_chart(train, "workers", "workers training", [("workers", "")]))
    return out


def round_charts(run: RunData) -> list[str]:
    """Average/DiLoCo rounds: each worker's inner loss, the bytes each way and where each round's time went."""
    rows = run.rounds
    rounds = [r["round"] for r in rows]

    def inner(ax) -> None:
        xs, ys = [], []
        for r in rows:
            for v in _split(r.get("inner_losses"), ";"):
                xs.append(r["round"])
                ys.append(v)
        ax.plot(xs, ys, "o", ms=4, alpha=0.6, label="a worker's inner loss")
        ax.plot(rounds, [r["loss"] for r in rows], "-", lw=1.5, label="the round's loss (token-weighted)")

    def timings(ax) -> None:
        bottom = [0.0] * len(rows)
        for key in ("broadcast_s", "fetch_s", "compute_s", "aggregate_s"):
            heights = [r.get(key) or 0.0 for r in rows]
            ax.bar(rounds, heights, bottom=bottom, label=key.removesuffix("_s"))
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.plot(rounds, [r.get("round_s") for r in rows], "k.-", lw=1, label="round (wall)")

    sent = [("broadcast (weights out)", rounds, [(r.get("broadcast_bytes") or 0) / 1e6 for r in rows]),
            ("returned (deltas back)", rounds, [(r.get("returned_bytes") or 0) / 1e6 for r in rows])]
    return [svg("inner loss per worker", "round", "loss (nats/token)", inner),
            svg("bytes per round", "round", "MB", _lines(sent, "o-")),
            svg("round timings", "round", "seconds", timings)]


def epochs_table(rows: list[dict]) -> str:
    header = ("epoch", "ended at step", "steps", "train loss", "train accuracy", "lr", "seconds", "tokens/s",
              "ms/step", "peak memory")
    cells = [(r["epoch"], r["step"], r.get("steps"), _sig(r.get("loss")),
              f"{r['acc']:.2%}" if isinstance(r.get("acc"), float) and r["acc"] == r["acc"] else "",
              _sig(r.get("lr")), _seconds(r.get("epoch_s")),
              f"{r['tokens_per_s']:,.0f}" if isinstance(r.get("tokens_per_s"), int | float) else "", _sig(r.get("ms_per_step")),
              _mb(r.get("peak_rss_mb"))) for r in rows]
    return table(cells, header)


def rounds_table(rows: list[dict]) -> str:
    header = ("round", "step", "workers done", "loss", "inner losses", "attempts", "cold", "broadcast MB",
              "returned MB", "broadcast s", "fetch s", "compute s", "aggregate s", "round s")
    cells = [(r["round"], r["step"], f"{r.get('workers_done')}/{r.get('workers')}", _sig(r.get("loss")),
              " ".join(f"{v:.4f}" for v in _split(r.get("inner_losses"), ";")), _text(r.get("attempts")),
              _text(r.get("cold")), _sig((r.get("broadcast_bytes") or 0) / 1e6),
              _sig((r.get("returned_bytes") or 0) / 1e6),
              *(_sig(r.get(k)) for k in ("broadcast_s", "fetch_s", "compute_s", "aggregate_s", "round_s")))
             for r in rows]
    if len(cells) > _MAX_ROUND_ROWS:  # a long run: its start and its end
        half = _MAX_ROUND_ROWS // 2
        cells = cells[:half] + [(f"… {len(cells) - 2 * half} rounds …", *[""] * (len(header) - 1))] + cells[-half:]
    return table(cells, header)


def spark_section(figures: dict | None) -> str:
    """Spark's own figures for the training's jobs (summary.json's "spark")."""
    if not figures:
        return ("<p class=note>No figures from Spark: the run ended before sparklm recorded them, or Spark could not "
                "say.</p>")
    unit = {"count": _count, "seconds": _seconds, "bytes": _bytes, "text": str}
    rows = [(label, unit[kind](figures[key])) for key, label, kind in spark_figures.FIELDS if key in figures]
    note = ("" if "task_seconds" in figures else
            "<p class=note>Task time, GC time and bytes come from the Spark UI's REST API: set spark.ui = true "
            "(the default) to have them.</p>")
    return table(rows, ("figure", "value")) + note


def config_table(saved: dict) -> str:
    """config.json as a table (values that differ from today's defaults in bold), and what the driver decided."""
    from ..config import Config

    flat = flatten(saved.get("config") or {})
    try:
        defaults = flatten(Config().to_dict())
    except Exception:  # the defaults are a reading aid: the table stands without them
        defaults = {}
    rows = [(k, _text(v)) for k, v in flat.items()]
    classes = ["changed" if k in defaults and defaults[k] != flat[k] != MASK else "" for k in flat]
    decided = saved.get("decided") or {}
    out = [f"<p>Dataset: {esc(saved.get('data', ''))}. Bold: differs from the default.</p>",
           table(rows, ("setting", "value"), classes)]
    if decided:
        out += ["<p>Decided by the driver where the settings left it open:</p>",
                table([(k, _text(v)) for k, v in flatten(decided).items()], ("setting", "value"))]
    return "".join(out)


def flatten(raw: dict, prefix: str = "") -> dict:
    """``{"train": {"rounds": {"sync_every": 4}}}`` → ``{"train.rounds.sync_every": 4}``."""
    out: dict = {}
    for key, value in raw.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# -- charts -----------------------------------------------------------------------------------------------------------


def svg(title: str, xlabel: str, ylabel: str, draw: Callable) -> str:
    """One chart as inline SVG (text as text: small, selectable, in the page's fonts)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(6.4, 3.4))  # no pyplot: no global state, nothing to close
    # fixed margins: a layout engine would draw each chart twice (half the page's time)
    fig.subplots_adjust(left=0.13, right=0.97, top=0.9, bottom=0.15)
    ax = fig.subplots()
    draw(ax)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    if xlabel in ("step", "round"):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    # a learning rate's 0.00225 would be wider than the fixed margin: small and large values get a power of ten
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 5), useOffset=False)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    return figure_svg(fig, title)


def figure_svg(fig, salt: str) -> str:
    """A matplotlib figure as inline SVG in a ``<figure>`` (text as text; ``salt`` keeps its ids apart from other
    charts' on the page)."""
    from matplotlib import rc_context

    out = io.StringIO()
    # a fixed salt: the same page each time; ids from the content, so equal ids in two charts mean equal definitions
    with rc_context({"svg.fonttype": "none", "svg.hashsalt": salt}):
        fig.savefig(out, format="svg", metadata={"Date": None})
    text = out.getvalue()
    return f"<figure>{text[text.index('<svg'):]}</figure>"  # without the XML prolog, which HTML does not take


def thin(xs: list, ys: list, n: int = _MAX_POINTS) -> tuple[list, list]:
    """At most about ``n`` points of a curve, evenly spaced, the last one kept."""
    if len(xs) <= n:
        return xs, ys
    k = -(-len(xs) // n)
    idx = list(range(0, len(xs), k))
    if idx[-1] != len(xs) - 1:
        idx.append(len(xs) - 1)
    return [xs[i] for i in idx], [ys[i] for i in idx]


def mpl_text(text: str) -> str:
    """A label matplotlib shows as written: ``$`` would start mathtext, a leading ``_`` hides it from the legend."""
    text = text.replace("$", r"\$")
    return " " + text if text.startswith("_") else text


def _lines(series: list[tuple[str, list, list]], style: str = "-") -> Callable:
    def draw(ax) -> None:
        for label, xs, ys in series:
            ax.plot(*thin(xs, ys), style, lw=1, ms=4, label=mpl_text(label) if label else None)
    return draw


def _step_chart(train: list[dict], title: str, ylabel: str, keys: list[tuple[str, str]], *, scale: float = 1.0,
                extra: list[tuple[str, list, list]] = ()) -> str:
    series = [(label, *_xy(train, "step", key, scale)) for key, label in keys]
    series = [s for s in series if s[1]] + list(extra)
    return svg(title, "step", ylabel, _lines(series)) if series else ""


def _worker_peaks(train: list[dict]) -> list[tuple[str, list, list]]:
    """Each worker's peak (metrics.csv's rank_peak_rss_mb, "812/790"), when there is more than one."""
    per_step = [(r["step"], _split(r.get("rank_peak_rss_mb"), "/")) for r in train]
    n = max((len(p) for _, p in per_step), default=0)
    if n < 2:
        return []
    return [(f"worker {w} peak", [s for s, p in per_step if len(p) > w], [p[w] for _, p in per_step if len(p) > w])
            for w in range(n)]


def _xy(rows: list[dict], x: str, y: str, scale: float = 1.0) -> tuple[list, list]:
    pts = [(r[x], r[y] * scale) for r in rows
           if r.get(x) is not None and isinstance(r.get(y), int | float) and r[y] == r[y]]  # NaN: not measured
    return [p[0] for p in pts], [p[1] for p in pts]


def _split(value, sep: str) -> list[float]:
    """``"5.73;5.71"`` → [5.73, 5.71] (one worker's value arrives already parsed as a number)."""
    if value is None or value == "":
        return []
    out = []
    for part in str(value).split(sep):
        try:
            out.append(float(part))
        except ValueError:
            continue
    return out


def _names(runs: list[RunData]) -> list[str]:
    """Each run's directory name, or its whole path where two share a name."""
    names = [r.name for r in runs]
    return [r.uri if names.count(r.name) > 1 else r.name for r in runs]


# -- numbers as text --------------------------------------------------------------------------------------------------


def _text(value) -> str:
    return "" if value is None else value if isinstance(value, str) else json.dumps(value)


def _count(value) -> str | None:
    return None if value is None else f"{value:,}" if isinstance(value, int) else _sig(value)


def _sig(value) -> str | None:
    return None if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def _seconds(value) -> str | None:
    if value is None:
        return None
    return f"{value:.1f} s" if value < 60 else duration(value)


def _mb(value) -> str | None:
    return None if value is None else f"{value:,.0f} MB"


def _bytes(value) -> str | None:
    if value is None:
        return None
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.0f} B"
