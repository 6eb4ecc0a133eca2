"""A search's ``report.html``: the study's best trial, every trial, and Optuna's own plots (its matplotlib backend:
the history, each trial's evaluations, parallel coordinates and the settings' importance), in the same
self-contained page as a run's report (no script, nothing loaded from the network)."""

from __future__ import annotations

import warnings

from .html_report import charts, esc, figure_svg, page, table


def render_study(summary: dict, study) -> str:
    """The page of a search: ``summary`` as ``tune`` returns it, ``study`` the Optuna study."""
    metric, direction, best = summary["metric"], summary["direction"], summary["best"]
    body = [f"<h1>sparklm tune: {esc(metric)} ({esc(direction)})</h1>",
            f"<p class=sub>{len(summary['trials'])} trials</p>", "<h2>Best trial</h2>"]
    if best:
        rows = [("trial", best["number"]), (metric, f"{best['value']:.4f}"), ("run directory", best["run_dir"]),
                ("model", best["model"] or "")]
        rows += [(k, v) for k, v in best["params"].items()]
        body.append(table(rows, ("", "")))
    else:
        body.append("<p class=note>No trial completed.</p>")
    body += ["<h2>Trials</h2>", table(
        [(t["number"], t["state"] + (" (interrupted)" if t.get("interrupted") else ""),
          "" if t["value"] is None else f"{t['value']:.4f}",
          ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in t["params"].items()),
          t.get("error") or "") for t in summary["trials"]],
        ("trial", "state", metric, "settings", "error")), "<h2>Optuna's plots</h2>", charts(_plots(study))]
    return page(f"sparklm tune: {metric}", body)


def _plots(study) -> list[str]:
    """Optuna's matplotlib plots as inline SVG; a plot the study cannot have yet (importance needs two finished trials
    and a setting that varies) is left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as ov

    out = []
    for name, plot in (("history", ov.plot_optimization_history), ("evaluations", ov.plot_intermediate_values),
                       ("parallel coordinates", ov.plot_parallel_coordinate),
                       ("importance", ov.plot_param_importances)):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # Optuna marks its matplotlib backend experimental
                ax = plot(study)
        except Exception:  # noqa: BLE001 - too few trials for this plot: the page goes without it
            continue
        fig = (ax[0] if hasattr(ax, "__len__") else ax).figure
        fig.set_size_inches(6.4, 3.6)
        out.append(figure_svg(fig, name))
        plt.close(fig)
    return out
