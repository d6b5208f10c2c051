"""docs/api.md's limits agree with ``cluster.config.Limits``, the defaults the frontend runs with
(and its ``[metrics]`` settings with ``cluster.config.MetricsConfig``).

The Limits table states each ``[limits]`` key as ``[limits] NAME``, default VALUE; every
other mention of a limit with a number beside it (anywhere in the doc, or in
``cluster/config.py``'s sample config) must give the same default.
"""
from __future__ import annotations

from tests.support.paths import REPO

import re
from dataclasses import fields
from pathlib import Path

import cluster.config
from cluster.config import Limits, MetricsConfig

ROOT = REPO
DOC = ROOT / "docs" / "api.md"
DEFAULTS = {f.name: getattr(Limits(), f.name) for f in fields(Limits)}
NUMBER = r"(\d[\d,]*(?:\.\d+)?)"


def _number(text: str) -> float:
    return float(text.replace(",", ""))


def _section(markdown: str, heading: str) -> str:
    start = markdown.index(f"\n## {heading}\n")
    end = markdown.find("\n## ", start + 1)
    return markdown[start:end if end >= 0 else len(markdown)]


def table_limits(markdown: str) -> dict[str, float]:
    """``{name: default}`` from the rows of the Limits table that name a ``[limits]`` key."""
    found: dict[str, float] = {}
    for row in _section(markdown, "Limits").splitlines():
        for name, value in re.findall(r"`\[limits\] (\w+)`, default " + NUMBER, row):
            assert name not in found, f"docs/api.md: [limits] {name} is in the table twice"
            found[name] = _number(value)
    return found


def stated_defaults(text: str) -> list[tuple[str, float]]:
    """Every ``NAME`` (or ``[limits] NAME``) followed, within a clause, by a number."""
    names = "|".join(DEFAULTS)
    pattern = (r"`(?:\[limits\] )?(" + names + r")`(?:, default | \(| = )"
               r"[^`|;\d]{0,16}?" + NUMBER)
    return [(name, _number(value)) for name, value in re.findall(pattern, text)]


def test_the_limits_table_lists_every_limit_with_its_default():
    assert table_limits(DOC.read_text()) == {k: float(v) for k, v in DEFAULTS.items()}


def test_no_other_mention_of_a_limit_gives_another_default():
    doc = DOC.read_text()
    wrong = [(name, value) for name, value in stated_defaults(doc)
             if value != DEFAULTS[name]]
    assert wrong == []
    # the sample config in cluster/config.py's docstring, `name = value` lines
    sample = re.findall(r"^\s+(" + "|".join(DEFAULTS) + r") = " + NUMBER,
                        cluster.config.__doc__, re.MULTILINE)
    assert {name: _number(value) for name, value in sample} == {
        k: float(v) for k, v in DEFAULTS.items()}


def test_the_checks_catch_the_old_figures():
    old = ("| requests in a job | `[limits] max_requests_per_job`, default 1000 | split |\n"
           "| pending | `max_pending_per_tenant` (4000), `max_pending_total` (16000) | retry |\n")
    assert stated_defaults(old) == [("max_requests_per_job", 1000.0),
                                    ("max_pending_per_tenant", 4000.0),
                                    ("max_pending_total", 16000.0)]
    assert table_limits("\n## Limits\n" + old) == {"max_requests_per_job": 1000.0}


def test_no_heading_or_paragraph_is_repeated():
    doc = DOC.read_text()
    headings = [line for line in doc.splitlines() if line.startswith("#")]
    assert len(headings) == len(set(headings))
    assert "## Durability\n" not in doc  # its one paragraph was about error messages
    paragraphs = [p.strip() for p in doc.split("\n\n") if len(p.strip()) > 80]
    repeated = {p[:60] for p in paragraphs if paragraphs.count(p) > 1}
    assert repeated == set()
    openings = [p.split()[:6] for p in paragraphs]
    assert [o for o in openings if openings.count(o) > 1] == []


def _toml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_the_metrics_settings_state_the_defaults_the_config_has():
    defaults = {f.name: _toml(getattr(MetricsConfig(), f.name)) for f in fields(MetricsConfig)}
    stated = dict(re.findall(r"`\[metrics\] (\w+)`, default `([^`]+)`",
                             _section(DOC.read_text(), "Prometheus metrics")))
    assert stated == defaults
    sample = cluster.config.__doc__.split("[metrics]\n", 1)[1].split("\n\n", 1)[0]
    assert dict(re.findall(r"^\s+(\w+) = (\S+)", sample, re.MULTILINE)) == {
        k: f'"{v}"' if isinstance(getattr(MetricsConfig(), k), str) else v
        for k, v in defaults.items()}
