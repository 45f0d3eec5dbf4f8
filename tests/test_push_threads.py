"""The prefill role's push threads (`prefill_node/transfer.PushThreads`): every push runs,
each on a thread that is not the caller's; one push that waits holds only its own thread;
threads are reused once their pushes end, and end once idle long enough; `close` ends
them all. A gang's push that its step never let go ends once cancelled."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import torch

from tandem.kvtransfer.connector import TransferError
from tandem.prefill_node.transfer import Gang, PushThreads, Transfer


def _push_threads(old: frozenset[threading.Thread] = frozenset()) -> list[threading.Thread]:
    """The push threads running now, but those in `old`."""
    return [t for t in threading.enumerate() if t.name == "kv-push" and t not in old]


def _wait_until(condition, timeout_s: float = 10.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_a_waiting_push_holds_only_its_own_thread() -> None:
    threads = PushThreads()
    release, ran = threading.Event(), []
    try:
        threads.submit(lambda: release.wait(10.0))  # a push stuck on a slow receiver
        done = [threading.Event() for _ in range(8)]
        for i, event in enumerate(done):
            threads.submit(lambda i=i, event=event: (ran.append(
                (i, threading.current_thread().name)), event.set()))
        assert all(event.wait(10.0) for event in done), "a push waited behind a stuck one"
        assert sorted(i for i, _ in ran) == list(range(8))
        assert {name for _, name in ran} == {"kv-push"}  # never the caller's thread
    finally:
        release.set()
        threads.close()


def test_threads_are_reused_and_closed() -> None:
    old = frozenset(_push_threads())  # an earlier test's, maybe still ending
    threads = PushThreads()
    for _ in range(40):  # one at a time: each push finds the last one's thread idle
        done = threading.Event()
        threads.submit(done.set)
        assert done.wait(10.0)
        assert _wait_until(lambda: threads._idle == threads._threads)  # noqa: SLF001
    assert len(_push_threads(old)) <= 2
    threads.close()
    assert _wait_until(lambda: not _push_threads(old)), "close left threads running"


def test_idle_threads_end_and_new_ones_come() -> None:
    old = frozenset(_push_threads())
    threads = PushThreads(idle_s=0.05)
    try:
        for _ in range(3):  # a burst of pushes, then idle: its threads end; then another
            release = threading.Event()
            done = [threading.Event() for _ in range(6)]
            for event in done:
                threads.submit(lambda e=event, r=release: (r.wait(10.0), e.set()))
            assert _wait_until(lambda: len(_push_threads(old)) == 6)
            release.set()
            assert all(event.wait(10.0) for event in done)
            assert _wait_until(lambda: not _push_threads(old)), "idle threads stayed"
    finally:
        threads.close()


def test_a_gang_push_whose_step_never_ended_its_handover_ends_once_cancelled() -> None:
    """The engine handed the push its last layer and then failed before saying the step's
    handover was over: the push waits in its gang until its cancellation lets it go, and
    then ends with the cancellation's error."""
    threads = PushThreads()
    gang = Gang(threads, num_layers=2)
    ended: list[BaseException | None] = []
    done = threading.Event()

    def on_end(error: BaseException | None) -> None:
        ended.append(error)
        done.set()

    def open_push(target):  # noqa: ANN001, ANN202 - never reached: it has no target
        raise AssertionError("a push with no target was opened")

    try:
        transfer = Transfer(threads, Future(), open_push, torch.device("cpu"),
                            lambda: time.monotonic() + 30.0, on_end, whole=2, gang=gang)
        transfer.layer_done(1)
        assert not done.wait(0.2), "a queued push ran before its step's handover ended"
        error = TransferError("the prefill of that prompt failed")
        transfer.cancel(error)
        assert done.wait(5.0), "the cancelled push never ended"
        assert ended == [error]
    finally:
        threads.close()
