"""Cancel means stop: Generate streams a client cancels are aborted in the engine.

A real frontend over one in-process worker (tiny forged model, 4 requests decoding at once),
real gRPC clients. Before the engine could abort, 16 cancelled streams kept decoding to their
``max_tokens`` and the next request queued behind them.
"""
import time

import grpc

from cluster.api.client import OrchardError, token_request
from forged_models import tiny_model
from frontend_harness import ACME_CONFIG, running_frontend
from proto.orchard.v1 import orchard_pb2 as pb
from proto.orchard.v1 import orchard_pb2_grpc as pb_grpc

LIMITS = """
[limits]
max_pending_per_tenant = 64
max_pending_total = 64
max_concurrent = 16
"""  # Generate calls share max_concurrent: all 16 streams reach the worker
LONG = 1500  # tokens each cancelled stream asks for: seconds of decoding on this model


def _prompt(seed: int, n: int = 256) -> list[int]:
    return [100 + (seed * 131 + i * 7) % 800 for i in range(n)]


def _ttft(client, rid: str, seed: int) -> float:
    """The worker's TTFT of a fresh 256-token prompt (queueing on the worker included)."""
    for event in client.generate(token_request(rid, _prompt(seed), 1)):
        if event.WhichOneof("event") == "result":
            assert event.result.ok, event.result.error_message
            return event.result.ttft_s
    raise AssertionError(f"{rid}: no result")


def _engine(harness, fn):
    async def ask():
        (worker,) = await harness.backend.workers()
        return await harness.backend.runtime.call(worker.worker_id, fn)
    return harness.run(ask())


def _stats(harness):
    async def ask():
        (worker,) = await harness.backend.workers()
        return await harness.backend.runtime.stats(worker.worker_id)
    return harness.run(ask())


def test_cancelled_streams_stop_decoding_and_the_next_request_does_not_wait(tmp_path):
    (tmp_path / "orchard.toml").write_text(ACME_CONFIG + LIMITS)
    with running_frontend(tmp_path, tiny_model(), workers=1) as harness, \
            harness.client("acme") as client, grpc.insecure_channel(harness.address) as channel:
        idle = sorted(_ttft(client, f"idle-{i}", i) for i in range(5))[2]
        before = _engine(harness, lambda engine: engine.written_tokens())
        stub = pb_grpc.GenerateStub(channel)
        auth = (("authorization", "Bearer key-acme"),)
        streams = []
        for i in range(16):  # four decode (the batch is full); twelve wait behind them
            streams.append(stub.Generate(pb.GenerateRequest(request=token_request(
                f"long-{i}", _prompt(100 + i), LONG)), metadata=auth))
            if i < 4:
                assert next(streams[-1]).WhichOneof("event") == "delta"
        deadline = time.monotonic() + 30.0
        while _stats(harness).running < 16 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _stats(harness).running == 16
        written = _engine(harness, lambda engine: engine.written_tokens())
        for stream in streams:
            stream.cancel()

        deadline = time.monotonic() + 5.0
        while _engine(harness, lambda engine: engine.busy) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _engine(harness, lambda engine: engine.busy), "cancelled requests still run"
        # No output block of theirs was ever written: their decode stopped where it was.
        # (The four prompts' blocks were written at their first token; 12 never started.)
        now = _engine(harness, lambda engine: engine.written_tokens())
        assert now - before == written - before == 4 * 256
        # Medians of five: the machine may be shared. Had the cancelled requests kept
        # running, these would wait for 16 x 1,500 tokens of decoding (seconds).
        after = sorted(_ttft(client, f"after-{i}", 50 + i) for i in range(5))[2]
        assert after <= 2 * idle, f"TTFT {after * 1e3:.1f} ms after the cancels, idle " \
                                  f"{idle * 1e3:.1f} ms"


def _wait_idle(harness, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while _engine(harness, lambda engine: engine.busy) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not _engine(harness, lambda engine: engine.busy)


def test_a_cancelled_job_a_call_deadline_and_the_request_timeout_abort_their_requests(tmp_path):
    (tmp_path / "orchard.toml").write_text(
        ACME_CONFIG + LIMITS.replace("max_concurrent = 16", "max_concurrent = 8")
        + "request_timeout_s = 1.0\n")
    with running_frontend(tmp_path, tiny_model(), workers=1) as harness, \
            harness.client("acme") as client:
        # CancelJob on requests already running
        job = client.submit([token_request(f"job-{i}", _prompt(i), LONG) for i in range(4)])
        deadline = time.monotonic() + 30.0
        while _stats(harness).running < 4 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _stats(harness).running == 4
        assert client.cancel(job.job_id).state == "cancelled"
        assert _wait_idle(harness), "the cancelled job's requests still run"

        # a Generate call's deadline
        try:
            for _ in client.generate(token_request("deadline", _prompt(7), LONG), timeout_s=0.5):
                pass
        except OrchardError as exc:
            assert exc.code == "DEADLINE_EXCEEDED"
        else:
            raise AssertionError("a 1,500-token request finished within 0.5 s")
        assert _wait_idle(harness), "the request past its deadline still runs"

        # [limits] request_timeout_s on a job's request
        served = _stats(harness).requests_served
        job = client.submit([token_request("slow", _prompt(8), LONG)])
        job = client.wait(job.job_id, poll_s=0.05, timeout_s=60)
        (result,) = list(client.results(job.job_id))
        assert result.error_code == "DEADLINE_EXCEEDED"
        assert _wait_idle(harness), "the request past request_timeout_s still runs"
        assert _stats(harness).requests_served == served
