"""``orchard report``: turn a run's traces into the analyst's report (text, JSON or a plot)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cluster.config import default_run_dir
from cluster.telemetry.otlp_json import read_spans
from cluster.report.build import build_report
from cluster.report.render import render_plot, render_text


def _traces_dir(args) -> Path:
    if args.traces is not None and args.run_dir is not None:
        raise ValueError("give --run-dir or --traces, not both")
    if args.traces is not None:
        return args.traces
    return (args.run_dir if args.run_dir is not None else default_run_dir()) / "traces"


def report(args) -> int:
    traces = read_spans(_traces_dir(args))
    result = build_report(traces.spans, job=args.job, window_s=args.window)
    result["unreadable_lines"] = traces.bad_lines
    if args.plot is not None:
        path = render_plot(result, args.plot)
        print(f"wrote {path}", file=sys.stderr)
    if args.json:
        result.pop("series")
        print(json.dumps(result, indent=2))
    else:
        print(render_text(result), end="")
        if traces.bad_lines:
            print(f"({traces.bad_lines} unreadable trace lines skipped)")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report", help="forecast vs measured cost and why requests missed, from traces")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="read RUN_DIR/traces (default: $ORCHARD_RUN_DIR or ./run)")
    p.add_argument("--traces", type=Path, default=None, help="a directory of OTLP JSON lines")
    p.add_argument("--job", default=None, help="only this job's requests")
    p.add_argument("--window", type=float, default=60.0, help="time window in seconds (60)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    p.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                   help="also draw forecast vs measured M over time and the miss causes")
    p.set_defaults(func=report)
