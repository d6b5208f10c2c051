"""The report's plot: forecast against measured ``M`` per job, and why requests missed.

Left panel, one colour per job (keyed in the legend by its full id, in the table's order)::

    M
    1.0 ┤·····································  no caching
        │   ●  ●                ●   ●
        │ ━━━━━━━━ job A forecast   ━━━━━━━ job B forecast   (over the job's own span)
        │            ╎idle 3600 s╎
        └──────────────────────────────────── active seconds

Dots are the requests' measured ``M``; a solid line spans each job's first to last request
at the forecast made when it was submitted. Idle gaps longer than ``GAP_S`` between requests
are drawn ``SHOWN_GAP_S`` wide and marked with their length (labels of gaps close together
stepped up, so none overlaps), so jobs hours apart stay readable. A job of a few requests gets
larger dots and a forecast line at least ``MIN_LINE_SHARE`` of the axis wide; the legend sits
under the panel, off the points. Right panel: computed tokens per miss cause over all
requests. Requests whose client disconnected have no ``M`` and are not drawn; the panel says
how many.
"""
from __future__ import annotations

import bisect
from pathlib import Path
from typing import Callable, Sequence

GAP_S = 10.0        # an idle gap longer than this is compressed
SHOWN_GAP_S = 2.0   # and drawn this wide
MIN_LINE_SHARE = 0.02  # a job's forecast line spans at least this share of the x axis
FEW_POINTS = 3      # a job with at most this many measured requests gets larger dots


def compressed_axis(times: Sequence[float], gap_s: float = GAP_S, shown_s: float = SHOWN_GAP_S
                    ) -> tuple[Callable[[float], float], list[tuple[float, float]]]:
    """A map from seconds to plotted seconds with idle gaps compressed, and the gaps as
    (plotted position of the gap's middle, idle seconds)."""
    ts = sorted(set(times))
    starts, shifts, gaps = [ts[0] if ts else 0.0], [0.0], []
    for a, b in zip(ts, ts[1:]):
        if b - a > gap_s:
            shift = shifts[-1] + (b - a) - shown_s
            gaps.append((a - shifts[-1] + shown_s / 2, b - a))
            starts.append(b)
            shifts.append(shift)

    def plotted(t: float) -> float:
        return t - shifts[max(0, bisect.bisect_right(starts, t) - 1)]
    return plotted, gaps


def _measured_panel(ax, report: dict) -> None:
    import matplotlib.pyplot as plt
    series = report["series"]
    if not series:
        ax.text(0.5, 0.5, "no finished requests", ha="center", va="center",
                transform=ax.transAxes)
        return
    x, gaps = compressed_axis([p["t_s"] for p in series])
    plotted = [x(p["t_s"]) for p in series]
    width = max(max(plotted) - min(plotted), 1.0)
    colours = plt.get_cmap("tab10").colors
    for i, job in enumerate(report["jobs"]):
        colour = colours[i % len(colours)]
        points = [(x(p["t_s"]), p["measured_m"]) for p in series
                  if p["job_id"] == job["job_id"] and p["measured_m"] is not None]
        few = len(points) <= FEW_POINTS
        if points:
            ax.scatter(*zip(*points), s=60 if few else 16, color=colour, alpha=0.8,
                       edgecolors="black" if few else "none", linewidths=0.6, zorder=3)
        if job["forecast_multiplier"] is not None and job["first_s"] is not None:
            left, right = x(job["first_s"]), x(job["last_s"])
            if right - left < MIN_LINE_SHARE * width:  # a short job still shows its forecast
                middle = (left + right) / 2
                left, right = (middle - MIN_LINE_SHARE * width / 2,
                               middle + MIN_LINE_SHARE * width / 2)
            ax.plot([left, right], [job["forecast_multiplier"]] * 2, color=colour, lw=2.5,
                    marker="|", markersize=9, zorder=2)
        ax.plot([], [], color=colour, marker="o", lw=2.5,
                label=f"{job['job_id']}: forecast (line), measured (dots)")
    left_early = sum(1 for p in series if p.get("disconnected"))
    if left_early:
        noun = "request" if left_early == 1 else "requests"
        ax.annotate(f"{left_early} {noun} disconnected before the result: no M, not drawn", (0.99, 0.98), xycoords="axes fraction", ha="right",
                    va="top", fontsize=7, color="dimgrey")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.annotate("M = 1.0: no caching", (0.0, 1.0), xycoords=("axes fraction", "data"),
                xytext=(4, 3), textcoords="offset points", fontsize=8, color="dimgrey")
    for (middle, idle), level in zip(gaps, gap_label_levels([m for m, _ in gaps], width)):
        ax.axvline(middle, color="lightgrey", lw=6, alpha=0.6)
        ax.annotate(f"idle {idle:.0f} s", (middle, 0.02 + 0.3 * level),
                    xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                    ha="center", va="bottom", color="dimgrey")
    top = max([1.0] + [p["measured_m"] for p in series if p["measured_m"] is not None])
    ax.set_ylim(0.0, top * 1.12)
    ax.set_xlabel(f"active seconds since the first request (idle gaps over {GAP_S:g} s "
                  "compressed)")
    ax.set_ylabel("effective input multiplier M")
    ax.set_title("Forecast vs measured M per job (lower is cheaper)")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16),
              ncol=min(3, max(1, len(report["jobs"]))), title="job (newest first)",
              title_fontsize=7, frameon=False)


def gap_label_levels(middles: Sequence[float], width: float, near_share: float = 0.03,
                     levels: int = 3) -> list[int]:
    """The height step (0, 1, 2, ...) of each idle gap's label: a label within
    ``near_share`` of the axis width of the previous one goes one step up (cycling through
    ``levels``), so labels of gaps close together never overlap."""
    out: list[int] = []
    for i, middle in enumerate(middles):
        near = i > 0 and middle - middles[i - 1] < near_share * width
        out.append((out[-1] + 1) % levels if near else 0)
    return out


def _causes_panel(ax, report: dict) -> None:
    causes = report["total"]["miss_causes"]
    timing = set(report.get("timing_dependent_causes", ()))
    if causes:
        names = list(causes)
        ax.barh([n + (" *" if n in timing else "") for n in names], [causes[n] for n in names],
                color=["lightcoral" if n in timing else "tab:red" for n in names],
                hatch=["//" if n in timing else "" for n in names])
        ax.invert_yaxis()
    else:
        ax.text(0.5, 0.5, "no misses", ha="center", va="center")
    ax.set_xlabel("computed tokens")
    ax.set_title("Why requests missed")


def render_plot(report: dict, path: str | Path) -> Path:
    """Write the two-panel PNG to ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    if path.suffix.lower() != ".png":
        raise ValueError(f"--plot writes a PNG: give a path ending in .png, not {path.name!r}")
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.2),
                                      gridspec_kw={"width_ratios": [2.2, 1]})
    _measured_panel(left, report)
    _causes_panel(right, report)
    prices = ", ".join(report.get("price_tables", ())) or "none recorded"
    caption = (f"M: what input tokens cost over their uncached price (price table {prices}); "
               "1.0 is no caching, lower is cheaper.")
    if report.get("timing_dependent_causes"):
        caption += " * split between these causes follows routing order (timing-dependent)."
    fig.text(0.01, 0.01, caption, fontsize=8, color="dimgrey")
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legend under the left panel
    plt.close(fig)
    return path
