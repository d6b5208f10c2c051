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


def test_each_tenant_has_a_minute_of_its_own():
    quotas = _quotas({"acme": TenantQuota(tokens_per_minute=100),
                      "bolt": TenantQuota(tokens_per_minute=100)})
    quotas.charge("acme", 100)
    quotas.charge("bolt", 100)  # acme's full minute is not bolt's
    with pytest.raises(QuotaExceeded):
        quotas.charge("bolt", 1)


def _refusal(quotas: Quotas, tokens: int) -> int:
    with pytest.raises(QuotaExceeded) as caught:
        quotas.charge("acme", tokens)
    return caught.value.retry_after_s


def test_retry_after_is_when_the_oldest_requests_summing_to_the_excess_have_left():
    clock = Clock()
    quotas = _quotas({"acme": TenantQuota(tokens_per_minute=100)}, clock)
    for at in (0.0, 10.0, 20.0):
        clock.now = at
        quotas.charge("acme", 30)    # 30 at t = 0, 10 and 20: 90 used
    clock.now = 25.0
    assert _refusal(quotas, 40) == 35   # 30 over: the first 30 leave at t = 60
    assert _refusal(quotas, 41) == 45   # 31 over: the second 30 too, at t = 70
    assert _refusal(quotas, 50) == 45   # 40 over: the same two
    assert _refusal(quotas, 100) == 55  # the whole quota: every one of the 90 must leave
    clock.now = 59.5
    quotas.charge("acme", 10)           # 100 used
    assert _refusal(quotas, 30) == 1    # the first 30 leave half a second from now


def test_a_quota_of_zero_is_no_limit_and_unknown_keys_are_named_with_the_known_ones(tmp_path):
    path = tmp_path / "orchard.toml"
    path.write_text("[quotas.acme]\nrequests_in_flight = 0\ntokens_per_minute = 0\n")
    assert QuotaFile(path).current() == {"acme": TenantQuota(0, 0)}
    path.write_text("[quotas.acme]\nrequests = 3\nburst = 2\n")
    with pytest.raises(ValueError) as caught:
        QuotaFile(path)
    assert str(caught.value) == (f"{path}: unknown key(s) burst, requests in [quotas.acme]; "
                                 "known: requests_in_flight, tokens_per_minute")


def test_a_bad_edit_is_logged_once_naming_the_file_and_the_quotas_before_stay(tmp_path,
                                                                                caplog):
    path = tmp_path / "orchard.toml"
    _write(path, "[quotas.acme]\nrequests_in_flight = 2\n", 1_000_000_000)
    file = QuotaFile(path)
    _write(path, "[quotas.acme]\nrequests_in_flight = -1\n", 2_000_000_000)
    with caplog.at_level("ERROR", logger="cluster.jobs.quotas"):
        assert file.current() == {"acme": TenantQuota(2)}
        assert file.current() == {"acme": TenantQuota(2)}  # the same bad file: not again
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: quotas not reloaded, the ones before stay: {path}: [quotas.acme] "
        "requests_in_flight must be an integer >= 0 (0: no limit), got -1"]
