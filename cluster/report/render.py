"""How ``orchard report`` shows what ``cluster.report.build.build_report`` found: tables and a plot.

The text is plain fixed-width tables an analyst can paste; the plot (matplotlib, Agg backend,
no display needed) has two panels: forecast against measured ``M`` over time (each request,
and the token-weighted value of all requests so far), and the computed tokens per miss cause.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

_COLUMNS = ("requests", "input", "cached", "written", "hit", "forecast M", "measured M",
            "error", "miss causes (computed tokens)")


def _num(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _row(name: str, g: dict) -> list[str]:
    causes = ", ".join(f"{k}={v}" for k, v in g["miss_causes"].items()) or "-"
    return [name, str(g["requests"]), str(g["input_tokens"]), str(g["cached_tokens"]),
            str(g["written_tokens"]), _num(g["hit_ratio"]), _num(g["forecast_multiplier"]),
            _num(g["measured_multiplier"]), _num(g["forecast_error"], 3), causes]


def _table(title: str, first: str, rows: Sequence[list[str]]) -> list[str]:
    header = [first, *_COLUMNS]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i in (0, len(r) - 1) else c.rjust(w)
                              for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return [title, fmt(header), *(fmt(r) for r in rows), ""]


def render_text(report: dict) -> str:
    lines = [f"orchard report: {report['requests']} requests"
             + ("" if report["requests"] else " (no finished request spans in these traces)"), ""]
    lines += _table("Per job", "job", [
        _row(g["job_id"] + (f" ({g['failed_requests']} failed)" if g["failed_requests"] else ""),
             g) for g in report["jobs"]])
    lines += _table("Per tenant", "tenant", [_row(g["key"], g) for g in report["tenants"]])
    lines += _table(f"Per {report['window_s']:g} s window", "window",
                    [_row(g["key"], g) for g in report["windows"]])
    lines.append("Worst near misses")
    if not report["near_misses"]:
        lines.append("  none")
    for n in report["near_misses"]:
        lines.append(f"  {n['request_id']} (job {n['job_id']}, {n['worker']}): {n['line']}, "
                     f"cached {n['cached_tokens']}; next token prompt={n['next_prompt_token']} "
                     f"stored={n['next_stored_token']}")
        if n.get("text_before") is not None:
            lines.append(f"    ...{n['text_before']!r} | prompt: {n['prompt_next']!r} "
                         f"| stored: {n['stored_next']!r}")
    lines += ["", "Template drift (a turn that does not extend the previous turn's prompt)"]
    if not report["template_drift"]:
        lines.append("  none")
    for d in report["template_drift"]:
        lines.append(f"  {d['tenant']}/{d['conversation']} turn {d['turn']} ({d['request_id']}): "
                     f"diverged at block {d['diverged_at_block']} (token "
                     f"{d['diverged_at_token']}) of the previous "
                     f"{d['previous_prompt_blocks']} blocks")
    return "\n".join(lines) + "\n"


def render_plot(report: dict, path: str | Path) -> Path:
    """Write the two-panel PNG to ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"--plot writes a PNG: give a path ending in .png, not {path.name!r}")
    series = report["series"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8),
                                      gridspec_kw={"width_ratios": [2, 1]})
    for key, label, marker in (("forecast_m", "forecast M", "x"), ("measured_m", "measured M", ".")):
        points = [(p["t_s"], p[key]) for p in series if p[key] is not None]
        if points:
            left.scatter(*zip(*points), s=14, marker=marker, alpha=0.5, label=f"{label} (request)")
    for key, label, style in (("measured_m", "measured M (cumulative)", "-"),
                              ("forecast_m", "forecast M (cumulative)", "--")):
        xs, ys, num, den = [], [], 0.0, 0
        for p in series:
            if p[key] is not None and p["input_tokens"]:
                num += p[key] * p["input_tokens"]
                den += p["input_tokens"]
                xs.append(p["t_s"])
                ys.append(num / den)
        if xs:
            left.step(xs, ys, where="post", lw=2, ls=style, label=label)
    for job in report["jobs"][:5]:  # each job's forecast at submission, where traced
        if job["forecast_multiplier"] is not None and job["requests"]:
            left.axhline(job["forecast_multiplier"], color="tab:green", lw=1, ls="-.",
                         label=f"job {job['job_id'][-8:]}: forecast at submission")
    left.axhline(1.0, color="grey", lw=0.8, ls=":")
    left.set_xlabel("seconds since the first request")
    left.set_ylabel("effective input multiplier M")
    left.set_title("Forecast vs measured M")
    if series:
        left.legend(fontsize=8, loc="best")
    else:
        left.text(0.5, 0.5, "no finished requests", ha="center", va="center",
                  transform=left.transAxes)
    causes = report["total"]["miss_causes"]
    if causes:
        names = list(causes)
        right.barh(names, [causes[n] for n in names], color="tab:red")
        right.invert_yaxis()
    else:
        right.text(0.5, 0.5, "no misses", ha="center", va="center")
    right.set_xlabel("computed tokens")
    right.set_title("Why requests missed")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
