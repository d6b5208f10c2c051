"""Per-tenant quotas: requests in flight, a minute of tokens on an injected clock, and the
``[quotas]`` of orchard.toml read again when the file changes (no restart, no sleep)."""
from __future__ import annotations

import os

import pytest

from cluster.jobs.quotas import QuotaExceeded, QuotaFile, Quotas, TenantQuota
from tests.conftest import Clock


def _quotas(table: dict[str, TenantQuota], clock: Clock | None = None) -> Quotas:
    return Quotas(lambda: table, clock or Clock())


def test_requests_in_flight_past_the_quota_are_refused_and_freed_ones_count_again():
    quotas = _quotas({"acme": TenantQuota(requests_in_flight=2)})
    with quotas.in_flight("acme", 3), quotas.in_flight("acme", 3):
        with pytest.raises(QuotaExceeded) as caught:
            with quotas.in_flight("acme", 3):
                pass
        assert (caught.value.reason, caught.value.retry_after_s) == ("requests_in_flight", 3)
        assert "has 2 requests in flight and its requests_in_flight quota is 2" in str(
            caught.value)
        with quotas.in_flight("other", 3):  # no quota: no limit
            pass
    with quotas.in_flight("acme", 3):  # both ended: room again
        pass


def test_tokens_per_minute_refuse_with_the_seconds_until_enough_have_aged_out():
    clock = Clock()
    quotas = _quotas({"acme": TenantQuota(tokens_per_minute=1000)}, clock)
    quotas.charge("acme", 400)       # t = 0
    clock.now += 10.0
    quotas.charge("acme", 500)       # t = 10: 900 used
    clock.now += 5.0
    with pytest.raises(QuotaExceeded) as caught:  # t = 15: 900 + 300 > 1000
        quotas.charge("acme", 300)
    # the 400 of t = 0 leave the window at t = 60: 45 s from now
    assert (caught.value.reason, caught.value.retry_after_s) == ("tokens_per_minute", 45)
    assert "used 900 of its tokens_per_minute quota of 1000" in str(caught.value)
    quotas.charge("acme", 100)       # what fits still passes: 1000 used
    clock.now += 45.0                # t = 60: the first 400 are gone
    quotas.charge("acme", 300)
    with pytest.raises(QuotaExceeded) as caught:  # bigger than the whole quota: a minute
        quotas.charge("acme", 1001)
    assert caught.value.retry_after_s == 60


def test_a_tenant_without_a_quota_has_no_limit():
    quotas = _quotas({})
    quotas.charge("acme", 10**9)
    assert quotas.quota("acme") == TenantQuota()


def _write(path, text: str, mtime_ns: int) -> None:
    path.write_text(text)
    os.utime(path, ns=(mtime_ns, mtime_ns))  # a change the stat sees, whatever the clock


def test_a_quota_edited_in_the_file_applies_to_the_next_request_without_a_restart(tmp_path):
    path = tmp_path / "orchard.toml"
    _write(path, "[quotas.acme]\nrequests_in_flight = 1\n", 1_000_000_000)
    quotas = Quotas(QuotaFile(path).current, Clock())
    with quotas.in_flight("acme", 1):
        with pytest.raises(QuotaExceeded):
            with quotas.in_flight("acme", 1):
                pass
        _write(path, "[quotas.acme]\nrequests_in_flight = 2\ntokens_per_minute = 50\n",
               2_000_000_000)
        with quotas.in_flight("acme", 1):  # the edit is read on this call
            pass
    assert quotas.quota("acme") == TenantQuota(requests_in_flight=2, tokens_per_minute=50)
    _write(path, "[quotas.acme]\nrequests_in_flight = -1\n", 3_000_000_000)  # a bad edit
    assert quotas.quota("acme") == TenantQuota(2, 50)  # logged; the quotas before stay
    _write(path, "[admin]\n", 4_000_000_000)  # the table removed: no quota any more
    assert quotas.quota("acme") == TenantQuota()


def test_a_bad_quota_table_at_start_is_refused_naming_the_key(tmp_path):
    path = tmp_path / "orchard.toml"
    for text, words in (("[quotas.acme]\nrequests = 3\n", "unknown key(s) requests in "
                         "[quotas.acme]"),
                        ("[quotas.acme]\ntokens_per_minute = 1.5\n", "[quotas.acme] "
                         "tokens_per_minute must be an integer >= 0"),
                        ("[quotas]\nacme = 3\n", "[quotas.acme] must be a table"),
                        ("quotas = 3\n", "[quotas] must be a table")):
        path.write_text(text)
        with pytest.raises(ValueError) as caught:
            QuotaFile(path)
        assert words in str(caught.value)
    assert QuotaFile(tmp_path / "missing.toml").current() == {}
