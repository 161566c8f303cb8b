"""A channel's producer dying before its writes of the messages it handed
over are done (docs/protocol.md, "Channels"; docs/python.md, "Crashes"),
on the host backend, with real processes.

On a GPU a producer hands a message over on the CPU and its stream writes
the slot, and then the message's filled flag, later. These producers do
the same on host memory: a thread of theirs plays the stream, doing each
message's writes and then its flag's, in order and late, while the
producer's CPU goes on handing messages over. So a SIGKILL leaves messages
handed over and not written, as it does on a GPU."""

import os
import random
import signal
import threading
import time

import numpy as np
import pytest

import gpushm
from conftest import Peer

# A producer whose writes lag behind its hand-overs, as a GPU stream's do:
# message k holds k in every element, written by the "stream" thread, which
# then writes the flag; the producer's CPU only queues both.
LAGGING_PRODUCER = """
    import queue, random, sys, threading, time, gpushm
    name, slots, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    stall = len(sys.argv) > 4 and sys.argv[4] == "stall"
    tx = gpushm.connect().channel(name, shape=(n,), dtype="int64", slots=slots)
    flags, work = tx._filled, queue.Queue()

    class Queued:
        # The block's filled flags as the producer's CPU sees them: the write
        # is queued after the message's own, as cuStreamWriteValue64 is.
        def __setitem__(self, i, v):
            work.put((None, i, v))

    def stream():
        rnd = random.Random()
        while True:
            t, i, v = work.get()
            if t is None:
                flags[i] = v
                continue
            time.sleep(0.001 + rnd.random() * 0.002)  # the GPU's work before the write
            t[:] = v

    print("open", flush=True)
    if stall:
        # Six messages written; then two handed over whose writes never run.
        for k in range(6):
            with tx.send() as t:
                t[:] = k
        tx._filled = type("Never", (), {"__setitem__": lambda self, i, v: None})()
        for k in range(6, 8):
            with tx.send():
                pass
        print("sent", flush=True)
        time.sleep(600)
    tx._filled = Queued()
    threading.Thread(target=stream, daemon=True).start()
    k = 0
    while True:
        with tx.send() as t:
            assert tx._out.seq == k
            work.put((t, None, k))
        k += 1
"""


def _stopped(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def _wait(cond, what, seconds=60):
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, f"waited {seconds}s for {what}"
        time.sleep(0.001)


def test_producer_sigkilled_at_random_moments_20_times(daemon, name):
    """Every message the consumer accepts holds its own number in every
    element, it accepts every message before the first one whose writes
    were not done, and that one is the one it is told of: BrokenMessageError
    naming it, or EOF when every message handed over was written."""
    rnd = random.Random(os.getpid())
    slots, n = 4, 512
    c = gpushm.connect(daemon.socket)
    outcomes = {"broken": 0, "eof": 0}
    try:
        for run in range(20):
            ch = f"{name}-{run}"
            rx = c.channel(ch, shape=(n,), dtype="int64", slots=slots, role="rx")
            got, end = [], {}

            def consume():
                try:
                    while True:
                        m = rx.recv(timeout=60)
                        with m as a:
                            whole = bool((a == m.seq).all())
                        got.append((m.seq, whole))  # accepted: released without an error
                except BaseException as e:
                    end["error"] = e

            p = Peer(daemon.socket, LAGGING_PRODUCER, ch, slots, n)
            p.expect("open")
            consumer = threading.Thread(target=consume)
            consumer.start()
            # A random moment: after some messages, and a little more.
            target = rnd.randrange(0, 150)
            _wait(lambda: len(got) >= target or "error" in end, f"{target} messages")
            time.sleep(rnd.random() * 0.01)
            os.kill(p.p.pid, signal.SIGSTOP)
            _wait(lambda: _stopped(p.p.pid), "the producer to stop")
            # Frozen: its stream thread wrote messages in order, each flag
            # after its message, so the highest flag is the number of
            # messages whose writes were done.
            head = rx._head.value
            written = max(rx._filled[i] for i in range(slots))
            os.kill(p.p.pid, signal.SIGKILL)
            p.p.wait()
            consumer.join(60)
            assert not consumer.is_alive(), "the consumer still waits after the producer died"
            err = end.get("error")
            bad = [k for k, whole in got if not whole]
            assert not bad, f"run {run}: messages accepted with contents not their own: {bad[:10]}"
            assert [k for k, _ in got] == list(range(len(got))), f"run {run}: messages accepted out of order"
            if written < head:
                assert isinstance(err, gpushm.BrokenMessageError), f"run {run}: {err!r}, want BrokenMessageError"
                assert err.seq == written, f"run {run}: told of message {err.seq}, the first unwritten is {written}"
                assert f"message {written};" in str(err)
                assert len(got) == written, f"run {run}: {len(got)} accepted, want the {written} written"
                outcomes["broken"] += 1
                # Told once: then the stream ends after the messages cut off.
                with pytest.raises(EOFError):
                    rx.recv(timeout=30)
            else:
                assert isinstance(err, EOFError), f"run {run}: {err!r}, want EOFError (all {head} written)"
                assert len(got) == head
                outcomes["eof"] += 1
            rx.close()
            c.unlink(ch)
    finally:
        c.close()
    print(f"20 SIGKILLs: {outcomes['broken']} ended with BrokenMessageError, {outcomes['eof']} with EOF")
    assert outcomes["broken"] > 0, "no kill landed with writes in flight: the test proved nothing"


def test_consumer_told_of_messages_it_took_before_the_death(daemon, name):
    """A consumer that read a message before its writes were done (on a GPU:
    its stream waits, its CPU does not) accepts nothing from the first one
    cut off: the release of a message cut off raises, naming that one, and
    the next call ends the stream. A next producer goes on after them."""
    c = gpushm.connect(daemon.socket)
    rx = c.channel(name, shape=(512,), dtype="int64", slots=4, role="rx")
    p = Peer(daemon.socket, LAGGING_PRODUCER, name, 4, 512, "stall")
    p.expect("open")
    # This consumer's CPU does not wait for the flags, as a GPU consumer's
    # does not: its stream would.
    flags = rx._filled
    rx._filled = type("StreamWaits", (), {"__getitem__": lambda self, i: 1 << 62})()
    for k in range(7):
        with rx.recv(timeout=30) as a:
            if k < 6:
                np.testing.assert_array_equal(a, k)
    p.expect("sent")
    m = rx.recv(timeout=30)
    assert m.seq == 7
    p.p.kill()
    p.p.wait()
    _wait(lambda: rx._breaks.value != 0, "the daemon to record the break")
    with pytest.raises(gpushm.BrokenMessageError, match="died before it finished message 6;") as e:
        with m:
            pass
    assert e.value.seq == 6
    with pytest.raises(EOFError):
        rx.recv(timeout=30)
    rx._filled = flags
    # A next producer's messages come after the ones cut off, whole.
    q = Peer(daemon.socket, """
        import sys, gpushm
        tx = gpushm.connect().channel(sys.argv[1], shape=(512,), dtype="int64", slots=4)
        print("open", flush=True)
        for _ in range(3):
            with tx.send() as t:
                t[:] = tx._out.seq
        tx.close()
        print("done", flush=True)
    """, name)
    q.expect("open")
    for k in range(8, 11):
        with rx.recv(timeout=30) as a:
            np.testing.assert_array_equal(a, k)
    q.expect("done")
    q.close()
    with pytest.raises(EOFError):
        rx.recv(timeout=30)
    rx.close()
    c.close()


def test_consumer_attaching_after_the_death_is_told(daemon, name):
    """A consumer that comes after the producer died is told of the
    messages cut off that it would meet, then gets the end of the stream."""
    c = gpushm.connect(daemon.socket)
    p = Peer(daemon.socket, LAGGING_PRODUCER, name, 4, 64, "stall")
    p.expect("open")
    rx = c.channel(name)
    for k in range(6):
        with rx.recv(timeout=30) as a:
            np.testing.assert_array_equal(a, k)
    p.expect("sent")
    rx.close()
    p.p.kill()
    p.p.wait()
    # Before the daemon's repair or after it: either way it is news to
    # this consumer.
    c2 = gpushm.connect(daemon.socket)
    rx = c2.channel(name)
    with pytest.raises(gpushm.BrokenMessageError) as e:
        rx.recv(timeout=30)
    assert e.value.seq == 6
    with pytest.raises(EOFError):
        rx.recv(timeout=30)
    rx.close()
    c2.close()
    c.close()

