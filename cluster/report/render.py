"""How ``orchard report`` shows what ``cluster.report.build.build_report`` found: tables and a plot.

The text is plain fixed-width tables an analyst can paste; the plot is
``cluster.report.plot.render_plot`` (re-exported here).
"""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from cluster.report.plot import render_plot  # noqa: F401  (re-exported)

_COLUMNS = ("requests", "input", "cached", "written", "hit", "forecast M", "measured M",
            "error", "miss causes (computed tokens)")


def _num(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _causes(g: dict, timing: frozenset[str]) -> str:
    return ", ".join(f"{k}={v}" + ("*" if k in timing else "")
                     for k, v in g["miss_causes"].items()) or "-"


def _row(name: str, g: dict, timing: frozenset[str] = frozenset()) -> list[str]:
    return [name, str(g["requests"]), str(g["input_tokens"]), str(g["cached_tokens"]),
            str(g["written_tokens"]), _num(g["hit_ratio"]), _num(g["forecast_multiplier"]),
            _num(g["measured_multiplier"]), _num(g["forecast_error"], 3), _causes(g, timing)]


def _table(title: str, first: str, rows: Sequence[list[str]],
           columns: Sequence[str] = _COLUMNS) -> list[str]:
    header = [first, *columns]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i in (0, len(r) - 1) else c.rjust(w)
                              for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return [title, fmt(header), *(fmt(r) for r in rows), ""]


def _when(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _acceptance(g: dict) -> str:
    """Speculative decoding's accepted over drafted tokens: "0.62 (310/500)", "-" if none."""
    if not g["drafted_tokens"]:
        return "-"
    return f"{g['acceptance']:.2f} ({g['accepted_tokens']}/{g['drafted_tokens']})"


def _job_rows(report: dict, timing: frozenset[str]) -> list[list[str]]:
    rows = []
    for g in report["jobs"]:
        notes = [f"{g['failed_requests']} failed"] if g["failed_requests"] else []
        if g["disconnected_requests"]:
            notes.append(f"{g['disconnected_requests']} disconnected")
        name = g["job_id"] + (f" ({', '.join(notes)})" if notes else "")
        span = ("-" if g["first_s"] is None
                else f"{g['first_s']:.0f}-{g['last_s']:.0f} s")
        row = _row(name, g, timing)
        rows.append([name, _when(g["submitted_ns"]), span, *row[1:-1], _acceptance(g), row[-1]])
    return rows


def render_text(report: dict) -> str:
    timing = frozenset(report.get("timing_dependent_causes", ()))
    prices = ", ".join(report.get("price_tables", ())) or "none recorded"
    lines = [f"orchard report: {report['requests']} requests"
             + ("" if report["requests"] else " (no finished request spans in these traces)"),
             f"Priced with price table {prices}. M is what the input tokens cost over their "
             f"uncached price: 1.0 is no caching, lower is cheaper.", ""]
    lines += _table("Per job (newest first; submitted in UTC; requests' start times in "
                    "seconds since the first request)", "job", _job_rows(report, timing),
                    ("submitted", "requests' span", *_COLUMNS[:-1], "drafts accepted",
                     _COLUMNS[-1]))
    lines += _table("Per tenant", "tenant", [_row(g["key"], g, timing) for g in report["tenants"]])
    lines += _table(f"Per {report['window_s']:g} s window", "window",
                    [_row(g["key"], g, timing) for g in report["windows"]])
    left = report["total"]["disconnected_requests"]
    if left:
        lines += [f"{left} requests' clients disconnected before their result: their "
                  f"{report['total']['disconnected_input_tokens']} prompt tokens are counted "
                  f"in input (load), not in hit ratio or M.", ""]
    if timing:
        lines += [f"* timing-dependent: the split between {' and '.join(sorted(timing))} follows "
                  f"the order in which concurrent requests were routed; their sum does not.", ""]
    total = report["total"]
    lines += ["Cache controls (all requests)",
              f"  prompt tokens written: {total['written_by_ttl']['5m']} at 5 minutes, "
              f"{total['written_by_ttl']['1h']} at 1 hour",
              f"  bypassed: {total['bypassed']['read']} read nothing, "
              f"{total['bypassed']['write']} wrote nothing; salted: "
              f"{total['salted_requests']} requests", ""]
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
    lines += ["", "Near-miss positions by prompt template (where the misses diverged)"]
    if not report["near_miss_positions"]:
        lines.append("  none")
    for t in report["near_miss_positions"]:
        at = ", ".join(f"token {p['token']} ({p['requests']})" for p in t["positions"])
        lines.append(f"  {t['tenant']} template {t['template']}: {t['near_misses']} near "
                     f"misses; {at}")
    lines += ["", "Template drift (a turn that does not extend the previous turn's prompt)"]
    if not report["template_drift"]:
        lines.append("  none")
    for d in report["template_drift"]:
        lines.append(f"  {d['tenant']}/{d['conversation']} turn {d['turn']} ({d['request_id']}): "
                     f"diverged at block {d['diverged_at_block']} (token "
                     f"{d['diverged_at_token']}) of the previous "
                     f"{d['previous_prompt_blocks']} blocks")
    return "\n".join(lines) + "\n"
