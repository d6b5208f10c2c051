"""Wall-clock bounds for tests that wait on threads or tasks: a stuck wait fails, saying so.

``wait_until(done, "what")`` polls a condition within a bound; ``wall_clock_limit`` does the
same as ``run_bounded`` for synchronous tests (the ``bounded`` fixture in
``conftest.py``).

``run_bounded(scenario(), 60, "what it does")`` is ``asyncio.run`` with a deadline. Past it the
scenario is cancelled and the test fails with an ``AssertionError`` naming the scenario, instead
of hanging: an engine thread that never answers, a slot never given back. An exception that
reaches the event loop's handler (raised in a done callback, say one that gives a slot back)
or ends a thread (the engine thread, whose callers would wait forever) fails the scenario at
once, quoting it, rather than leaving it to stall. The loop is closed
without waiting for the default executor (``asyncio.run`` would join a thread that may be the
stuck one).

Under mutmut (``MUTANT_UNDER_TEST`` set) both exit with mutmut's timeout status instead of
failing, so a mutant that only a hang catches is counted as a timeout, never as killed.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from typing import Callable, Coroutine, TypeVar

T = TypeVar("T")


def run_bounded(scenario: Coroutine[object, object, T], timeout_s: float, what: str) -> T:
    async def bounded() -> T:
        task = asyncio.ensure_future(scenario)
        escaped: list[dict] = []

        def escape(loop: asyncio.AbstractEventLoop, context: dict) -> None:
            escaped.append(context)   # an exception no task took: the scenario stops now
            loop.default_exception_handler(context)
            task.cancel()

        def thread_ended(args: threading.ExceptHookArgs) -> None:
            escaped.append({"message": f"thread {args.thread.name} ended by an exception",
                            "exception": args.exc_value})
            previous_hook(args)
            loop.call_soon_threadsafe(task.cancel)

        loop = asyncio.get_running_loop()
        loop.set_exception_handler(escape)
        previous_hook, threading.excepthook = threading.excepthook, thread_ended
        # not ``wait_for``: a ``TimeoutError`` the scenario raises is its failure, not the bound
        try:
            finished = (await asyncio.wait({task}, timeout=timeout_s))[0]
        finally:
            threading.excepthook = previous_hook
        if escaped:
            context = escaped[0]
            raise AssertionError(f"{what}: an exception reached the event loop: "
                                 f"{context['message']}: {context.get('exception')!r}")
        if not finished:
            task.cancel()
            message = (f"{what}: not finished after {timeout_s:g} s of wall-clock time "
                       "(a wait that never ended)")
            _a_timeout_under_mutmut(message)
            raise AssertionError(message)
        return task.result()

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(bounded())
    finally:
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        if left:  # cancelled tasks get a bounded moment to unwind
            loop.run_until_complete(asyncio.wait(left, timeout=5))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


async def wait_until(done: Callable[[], object], what: str, timeout_s: float = 60.0):
    """Poll ``done()`` every 10 ms until it is true, and return it; past ``timeout_s`` of
    wall-clock time the test fails naming ``what`` (under mutmut: a timeout)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not (value := done()):
        if loop.time() > deadline:
            message = f"waited {timeout_s:g} s of wall-clock time for {what}"
            _a_timeout_under_mutmut(message)
            raise AssertionError(message)
        await asyncio.sleep(0.01)
    return value


async def within(done: Callable[[], object], limit_s: float, what: str):
    """Poll ``done()`` until it is true, and return it; past ``limit_s`` the test fails, an
    assertion naming ``what``. For a wait whose bound is itself the behaviour under test, many
    times what the work takes (a deadline that must cut a request short, a job of instant
    failures that must end): running past it is the bug, not a hang."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while not (value := done()):
        if loop.time() > deadline:
            raise AssertionError(f"{what}: not within {limit_s:g} s")
        await asyncio.sleep(0.01)
    return value


WALL_CLOCK_LIMIT_S = 60.0
TIMEOUT_EXIT = 36  # what mutmut reads as "timeout"


@contextlib.contextmanager
def wall_clock_limit(what: str, limit_s: float = WALL_CLOCK_LIMIT_S):
    """Fail a synchronous test that waits on threads (the disk tier's writer and readers) once
    it has run ``limit_s`` seconds of wall-clock time, naming it.

    A ``SIGALRM`` in the main thread interrupts the wait. Under mutmut (``MUTANT_UNDER_TEST``
    set) the process exits with mutmut's timeout status instead, so a mutant that only a hang
    catches is counted as a timeout, never as killed.
    """
    def expire(signum, frame):
        message = (f"{what}: still running after {limit_s:g} s of wall-clock time "
                   "(a wait that never ended)")
        _a_timeout_under_mutmut(message)
        raise TimeoutError(message)

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _a_timeout_under_mutmut(message: str) -> None:
    """Under mutmut, a bound that ran out ends the process with mutmut's timeout status."""
    if os.environ.get("MUTANT_UNDER_TEST"):
        print(message, file=sys.stderr, flush=True)
        os._exit(TIMEOUT_EXIT)


def record_timeouts(monkeypatch) -> list:
    """The delay of each ``asyncio.timeout`` entered from now on, in order; the real timeout
    runs under it (``monkeypatch`` undoes it after the test)."""
    entered: list = []
    real = asyncio.timeout

    def recording(delay):
        entered.append(delay)
        return real(delay)

    monkeypatch.setattr(asyncio, "timeout", recording)
    return entered
