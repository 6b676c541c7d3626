"""memory_pool.threads.InOrder: calls run in the order fed, one at a time beside the feeder, and
a failure reaches the feeder."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest

from memory_pool.threads import InOrder


def test_in_order_runs_every_call_in_the_order_fed_on_one_other_thread_and_equals_the_serial_hash():
    pieces = [bytes([i]) * (1 << 16) for i in range(40)]
    serial = hashlib.blake2b(digest_size=32)
    for p in pieces:
        serial.update(p)
    h, seen, threads = hashlib.blake2b(digest_size=32), [], set()

    def update(i, p):
        time.sleep(0.001 * (i % 3))  # (uneven: a later call must still wait for an earlier one)
        seen.append(i)
        threads.add(threading.get_ident())
        h.update(p)

    with InOrder("test-in-order") as q:
        for i, p in enumerate(pieces):
            q.feed(update, i, p)
    assert seen == list(range(40)) and h.digest() == serial.digest()
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_in_order_keeps_at_most_one_call_waiting_beside_the_feeder():
    running, most = [0], [0]
    lock = threading.Lock()

    def slow():
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.01)
        with lock:
            running[0] -= 1

    with InOrder("test-in-order") as q:
        for _ in range(10):
            q.feed(slow)
            with lock:
                assert running[0] <= 1
    assert most[0] == 1


def test_a_failed_call_reaches_the_feeder_at_its_next_feed_or_drain():
    def boom():
        raise ValueError("piece 3 was bad")

    with pytest.raises(ValueError, match="piece 3"):
        with InOrder("test-in-order") as q:
            q.feed(boom)
            q.feed(lambda: None)   # (the next feed waits for it and raises)
    q2 = InOrder("test-in-order")
    q2.feed(boom)
    with pytest.raises(ValueError, match="piece 3"):
        q2.drain()
    q2.drain()  # (reported once)
    q2.__exit__(None, None, None)


def test_a_lowered_priority_is_the_calling_threads_alone_and_never_raised_back():
    """``lower_priority`` (the prefetch thread's): the calling thread's nice value goes up to the
    one asked for; the process's other threads keep theirs; a value below the thread's own is no
    change (raising a priority back needs a privilege); 0 leaves it alone."""
    import os

    from memory_pool.threads import lower_priority

    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = {}

    def worker(name, value):
        seen[name] = (lower_priority(value), os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    for name, value in (("up", min(main + 5, 19)), ("past 19", 40), ("zero", 0)):
        t = threading.Thread(target=worker, args=(name, value))
        t.start()
        t.join()
    assert seen["up"] == (min(main + 5, 19),) * 2
    assert seen["past 19"] == (19, 19)
    assert seen["zero"] == (main, main)          # (0: left alone, at the process's value)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main


def test_the_prefetch_thread_makes_its_items_at_a_lower_priority_than_the_step(monkeypatch):
    """dlrm_cxl.data.Prefetcher: its producing thread runs at DEFAULT_NICE (README: why),
    ``DLRM_CXL_PREFETCH_NICE=0`` leaves it at the process's; the consumer's is unchanged; a bad
    value is refused before a thread starts."""
    import os

    from dlrm_cxl.data import Prefetcher
    from dlrm_cxl.data.prefetch import DEFAULT_NICE, NICE_ENV
    from memory_pool.errors import InvalidConfigError

    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def nice_of_producer():
        yield os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    with Prefetcher(nice_of_producer()) as p:
        assert list(p) == [max(main, DEFAULT_NICE)]
    monkeypatch.setenv(NICE_ENV, "0")
    with Prefetcher(nice_of_producer()) as p:
        assert list(p) == [main]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main
    for bad in ("high", "-1", "20"):
        monkeypatch.setenv(NICE_ENV, bad)
        with pytest.raises(InvalidConfigError, match=f"{NICE_ENV} must be a whole number from 0 to 19"):
            Prefetcher(iter([]))
