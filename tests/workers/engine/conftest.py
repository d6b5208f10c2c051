"""Fixtures the engine's tests share: the mixed batch decoded without speculation, run once
for the package (the speculation and draft-model tests compare their outputs with it)."""
from __future__ import annotations

import pytest

from tests.support.spec_runs import drive, engine, requests


@pytest.fixture(scope="package")
def plain_run():
    eng = engine(False)
    return drive(eng, requests(eng, "p"))
