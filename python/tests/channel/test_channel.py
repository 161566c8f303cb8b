"""Channels (docs/python.md, "Channels") on the host backend: numpy messages
between a producer and a consumer in separate processes, a real daemon,
and the crashes a deployment sees (either end SIGKILLed, the daemon's
serving process SIGKILLed under a live channel)."""

import gc
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import gpushm
from conftest import Daemon, Peer, env_for

# Writes count messages, message k holding arange(n) + 7k (expect(k)).
PRODUCER = """
    import sys, time, numpy as np, gpushm
    name, count, slots, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    pause = float(sys.argv[5]) if len(sys.argv) > 5 else 0
    c = gpushm.connect()
    tx = c.channel(name, shape=(n,), dtype="float32", slots=slots)
    print("open", flush=True)
    for k in range(count):
        m = tx.send()
        assert m.seq == k, (m.seq, k)
        with m as t:
            t[:] = np.arange(n, dtype=np.float32) + k * 7
        if pause and k % 97 == 0:
            time.sleep(pause)      # the consumer catches up and sleeps
    print("sent", flush=True)
    if sys.stdin.readline().strip() == "close":
        tx.close()
        print("closed", flush=True)
        sys.stdin.readline()
"""


def expect(k, n=64):
    """Message k's contents."""
    return np.arange(n, dtype=np.float32) + k * 7


@pytest.fixture
def channels(daemon):
    """Clients for this test; each end needs its own."""
    made = []

    def connect():
        c = gpushm.connect(daemon.socket)
        made.append(c)
        return c
    yield connect
    for c in made:
        c.close()


def test_thousands_of_messages_between_processes(daemon, channels, name):
    """Every message arrives once, in order, with what was written into it;
    the consumer is sometimes slower (slots full) and sometimes faster (it
    sleeps on the futex)."""
    n, count = 64, 5000
    p = Peer(daemon.socket, PRODUCER, name, count, 3, n, 0.002)
    p.expect("open")
    rx = channels().channel(name)
    assert (rx.role, rx.slots, rx.dtype, rx.shape, rx.device) == ("rx", 3, "float32", (n,), None)
    for k in range(count):
        m = rx.recv(timeout=30)
        assert m.seq == k
        with m as t:
            assert isinstance(t, np.ndarray) and not t.flags.writeable
            np.testing.assert_array_equal(t, expect(k))
        if k % 1000 == 500:
            time.sleep(0.05)       # the producer fills every slot and waits
    p.expect("sent")
    p.send("close")
    p.expect("closed")
    with pytest.raises(EOFError, match="producer is gone"):
        rx.recv(timeout=10)
    with pytest.raises(EOFError):  # and again: the stream stays ended
        rx.recv(timeout=10)
    p.send("")
    p.close()


def test_iteration_releases_each_message_when_the_next_starts(daemon, channels, name):
    """With one slot, the producer can send message k+1 only once the loop
    has moved past message k; leaving the loop releases the last one."""
    tx = channels().channel(name, shape=(4,), dtype="int64", slots=1)
    p = Peer(daemon.socket, """
        import sys, gpushm
        rx = gpushm.connect().channel(sys.argv[1])
        print("open", flush=True)
        got = []
        for t in rx:
            got.append(int(t[0]))
            if len(got) == 50:
                break
        print("broke", flush=True)
        assert sys.stdin.readline().strip() == "more"
        for t in rx:
            got.append(int(t[0]))
        assert got == list(range(60)), got
        print("eof", len(got), flush=True)
    """, name)
    p.expect("open")
    for k in range(50):
        with tx.send(timeout=30) as t:
            t[:] = k
    p.expect("broke")
    with tx.send(timeout=30) as t:      # the slot came back when the loop ended
        t[:] = 50
    p.send("more")
    for k in range(51, 60):
        with tx.send(timeout=30) as t:
            t[:] = k
    tx.close()
    p.expect("eof 60")
    p.close()


def test_message_protocol_misuse(channels, name):
    tx = channels().channel(name, nbytes=16, slots=2, wait_for_consumer=False)
    rx = channels().channel(name)
    assert rx.dtype == "uint8" and rx.shape == (16,)
    m = tx.send()
    with pytest.raises(RuntimeError, match="message 0 is still out"):
        tx.send()
    with pytest.raises(ValueError, match="send on the consumer's end"):
        rx.send()
    with pytest.raises(ValueError, match="recv on the producer's end"):
        tx.recv()
    m.tensor[:] = 5
    m.done()
    with pytest.raises(ValueError, match="handed over already"):
        m.done()
    with pytest.raises(ValueError):   # an exception in the block sends nothing
        with tx.send() as t:
            t[:] = 9
            raise ValueError("fill failed")
    with tx.send() as t:
        t[:] = 6
    got = []
    for _ in range(2):
        with rx.recv(timeout=5) as t:
            got.append(bytes(t))
    assert got == [bytes([5]) * 16, bytes([6]) * 16]
    with pytest.raises(TimeoutError, match="no message within"):
        rx.recv(timeout=0.05)
    with pytest.raises(TimeoutError):
        rx.recv(timeout=0)
    tx.close()
    with pytest.raises(ValueError, match="is closed"):
        tx.send()
    with pytest.raises(EOFError):
        rx.recv()


def test_producer_sigkill_ends_the_stream_after_what_it_sent(daemon, channels, name):
    """The consumer gets every message the dead producer sent, then EOF;
    the one it was writing when it died is not among them."""
    p = Peer(daemon.socket, """
        import sys, time, numpy as np, gpushm
        tx = gpushm.connect().channel(sys.argv[1], shape=(64,), dtype="float32", slots=8)
        print("open", flush=True)
        for k in range(5):
            with tx.send() as t:
                t[:] = np.arange(64, dtype=np.float32) + k * 7
        m = tx.send()
        m.tensor[:3] = -1         # half written when it dies
        print("sent", flush=True)
        time.sleep(600)
    """, name)
    p.expect("open")
    rx = channels().channel(name)
    p.expect("sent")
    p.p.kill()
    p.p.wait()
    for k in range(5):
        with rx.recv(timeout=10) as t:
            np.testing.assert_array_equal(t, expect(k))
    with pytest.raises(EOFError):
        rx.recv(timeout=10)


def test_producer_sigkill_wakes_a_sleeping_consumer(daemon, channels, name):
    p = Peer(daemon.socket, """
        import sys, time, gpushm
        tx = gpushm.connect().channel(sys.argv[1], nbytes=8)
        print("open", flush=True)
        time.sleep(600)
    """, name)
    p.expect("open")
    rx = channels().channel(name)
    t0 = time.monotonic()
    killer = subprocess.Popen([sys.executable, "-c", f"import os, time; time.sleep(0.3); os.kill({p.p.pid}, 9)"])
    with pytest.raises(EOFError):
        rx.recv()                 # no timeout: the daemon's repair must end it
    assert time.monotonic() - t0 < 60
    killer.wait()
    p.p.wait()


def test_consumer_sigkill_frees_its_slots_and_a_new_consumer_goes_on(daemon, channels, name):
    tx = channels().channel(name, shape=(64,), dtype="float32", slots=4, wait_for_consumer=False)
    with pytest.raises(gpushm.NoConsumerError, match="no consumer is attached"):
        tx.send()
    p = Peer(daemon.socket, """
        import sys, time, gpushm
        rx = gpushm.connect().channel(sys.argv[1])
        print("open", flush=True)
        for k in range(2):
            with rx.recv() as t:
                assert t[0] == k * 7
        m = rx.recv()             # held when it dies
        assert m.seq == 2
        print("holding", flush=True)
        time.sleep(600)
    """, name)
    p.expect("open")
    for k in range(6):
        with tx.send(timeout=30) as t:
            t[:] = expect(k)
    p.expect("holding")
    # Messages 3, 4 and 5 wait, and the consumer holds 2: every slot is taken.
    with pytest.raises(TimeoutError, match="every slot holds a message"):
        tx.send(timeout=0.1)
    p.p.kill()
    p.p.wait()
    # The daemon ends its role and drops the message it held, freeing that
    # slot; with no consumer, this producer does not wait.
    deadline = time.monotonic() + 10
    while True:
        try:
            tx.send(timeout=0)
            pytest.fail("send with no consumer attached went through")
        except gpushm.NoConsumerError:
            break
        except TimeoutError:
            assert time.monotonic() < deadline, "the dead consumer's role did not end"
            time.sleep(0.01)
    rx = channels().channel(name)
    with tx.send(timeout=5) as t:    # a free slot, now that a consumer is back
        t[:] = expect(6)
    got = []
    for _ in range(4):
        m = rx.recv(timeout=5)
        with m as t:
            got.append(m.seq)
            np.testing.assert_array_equal(t, expect(m.seq))
    assert got == [3, 4, 5, 6]


def test_bad_layouts_and_slot_counts(daemon, channels, name):
    c = channels()
    tx = c.channel(name, shape=(2, 3), dtype="float32", slots=4)
    other = channels()
    before = other.stat(name).opens
    for kw, what in ((dict(shape=(2, 4), dtype="float32"), r"float32\[2, 4\]"),
                     (dict(shape=(2, 3), dtype="float16"), r"float16\[2, 3\]"),
                     (dict(shape=(2, 3), dtype="float32", slots=8), "8 slots"),
                     (dict(nbytes=24), "messages of 24 bytes")):
        with pytest.raises(gpushm.ExistsError, match=rf"exists with 4 slots of float32\[2, 3\], not .*{what}"):
            other.channel(name, role="rx", **kw)
    assert other.stat(name).opens == before     # no role or lease taken
    rx = other.channel(name, shape=(2, 3), dtype="float32", role="rx")   # the same layout opens it
    assert rx.slots == 4 and rx.shape == (2, 3)
    for slots in (0, 65, -1, True, 2.0):
        with pytest.raises(ValueError, match=r"slots; want 1 to 64"):
            c.channel(name + "-s", nbytes=8, slots=slots)
    for req in ({"slots": 65, "slot_bytes": 8}, {"slots": 0, "slot_bytes": 8}, {"slot_bytes": 8}):
        with pytest.raises(gpushm.InvalidError):   # the daemon says no as well
            c._call("create", name=name + "-s", open=True, **req)
    with pytest.raises(ValueError, match="messages of 0 bytes"):
        c.channel(name + "-s", shape=(0, 3), dtype="float32")
    with pytest.raises(gpushm.NotFoundError):
        c.stat(name + "-s")
    with pytest.raises(TypeError, match="make a channel"):
        c.channel(name, slots=4)
    with pytest.raises(ValueError, match="role 'both'"):
        c.channel(name, role="both")
    with pytest.raises(ValueError, match="framework 'jax'"):
        channels().channel(name + "-f", nbytes=8, framework="jax")
    with pytest.raises(gpushm.NotFoundError):
        c.channel(name + "-missing")
    c.create(name + "-seg", 64)
    with pytest.raises(gpushm.InvalidError, match="not a channel"):
        channels().channel(name + "-seg")
    with pytest.raises(gpushm.ExistsError):
        channels().channel(name + "-seg", nbytes=64)
    tx.close()
    rx.close()


def test_second_producer_is_refused(daemon, channels, name):
    p = Peer(daemon.socket, """
        import sys, gpushm
        tx = gpushm.connect().channel(sys.argv[1], nbytes=32)
        print("open", flush=True)
        sys.stdin.readline()
        tx.close()
        print("closed", flush=True)
        sys.stdin.readline()
    """, name)
    p.expect("open")
    c = channels()
    with pytest.raises(gpushm.BusyError, match=rf"has a producer already \(pid {p.p.pid}\)") as e:
        c.channel(name, nbytes=32)
    assert e.value.code == "EBUSY"
    rx = c.channel(name)          # the consumer's role is free
    with pytest.raises(ValueError, match="already holds the consumer end"):
        c.channel(name)
    with pytest.raises(ValueError, match="open the producer end with another gpushm.connect"):
        c.channel(name, role="tx")
    with pytest.raises(ValueError, match="this process already holds the consumer end"):
        channels().channel(name)
    p.send("")
    p.expect("closed")
    tx = channels().channel(name, nbytes=32)   # free once the first closed
    with tx.send() as t:
        t[:] = 1
    with rx.recv(timeout=5) as t:
        assert bytes(t) == bytes([1]) * 32
    p.send("")
    p.close()


def test_removed_channel_stops_both_ends(daemon, channels, name):
    tx = channels().channel(name, nbytes=8, slots=2)
    rx = channels().channel(name)
    with tx.send() as t:
        t[:] = 3
    channels().unlink(name)
    with pytest.raises(gpushm.ChannelRemovedError, match="was removed"):
        tx.send()
    with rx.recv(timeout=5) as t:    # what was sent before is still there
        assert t[0] == 3
    with pytest.raises(gpushm.ChannelRemovedError, match="was removed") as e:
        rx.recv(timeout=5)
    assert e.value.code == "EIDRM"
    with pytest.raises(gpushm.NotFoundError):
        channels().channel(name)
    # The name is free for a new channel, which this process may open again.
    tx2 = channels().channel(name, nbytes=8)
    assert tx2.info.id != tx.info.id
    tx.close()
    rx.close()
    tx2.close()


def test_send_waits_for_a_consumer_by_default(daemon, channels, name):
    tx = channels().channel(name, nbytes=8)
    with pytest.raises(TimeoutError, match="no consumer is attached"):
        tx.send(timeout=0.1)
    p = Peer(daemon.socket, """
        import sys, time, gpushm
        time.sleep(0.3)
        rx = gpushm.connect().channel(sys.argv[1])
        with rx.recv() as t:
            print("got", int(t[0]), flush=True)
    """, name)
    with tx.send() as t:             # waits until the consumer comes
        t[:] = 42
    p.expect("got 42")
    p.close()


def test_client_close_ends_its_channels(daemon, channels, name):
    c = gpushm.connect(daemon.socket)
    tx = c.channel(name, nbytes=8)
    rx = channels().channel(name)
    with tx.send() as t:
        t[:] = 1
    c.close()
    assert tx.closed
    with rx.recv(timeout=5) as t:
        assert t[0] == 1
    with pytest.raises(EOFError):
        rx.recv(timeout=5)


@pytest.fixture
def sdaemon():
    d = Daemon("host", "--grace", "2s")
    yield d
    d.stop()


def test_daemon_restart_under_a_live_channel(sdaemon, name):
    """SIGKILL the serving process while messages flow: both ends keep
    going, reclaim their roles when they next talk to the daemon, and a
    clean close still ends the stream with EOF after the last message."""
    count = 3000
    p = Peer(sdaemon.socket, """
        import sys, time, numpy as np, gpushm
        name, count = sys.argv[1], int(sys.argv[2])
        c = gpushm.connect()
        tx = c.channel(name, shape=(64,), dtype="float32", slots=4)
        print("open", flush=True)
        for k in range(count):
            with tx.send() as t:
                t[:] = np.arange(64, dtype=np.float32) + k * 7
            if k == count // 2:
                print("half", flush=True)
                assert sys.stdin.readline().strip() == "talk"
                c.info()                           # reconnects, reclaims
                print("reconnects", c.reconnects, flush=True)
            if k % 50 == 0:
                time.sleep(0.001)
        print("sent", flush=True)
        assert sys.stdin.readline().strip() == "close"
        tx.close()
        print("closed", flush=True)
        sys.stdin.readline()
    """, name, count)
    p.expect("open")
    c = gpushm.connect(sdaemon.socket)
    rx = c.channel(name)
    pid = c.info()["pid"]
    killed = False
    for k in range(count):
        if k == 100:
            os.kill(pid, signal.SIGKILL)   # messages keep flowing with no daemon
            killed = True
        with rx.recv(timeout=30) as t:
            np.testing.assert_array_equal(t, expect(k))
        if k == count // 2:
            p.expect("half")
            p.send("talk")
            p.expect("reconnects 1")
            c.info()
            assert c.reconnects == 1
    assert killed
    p.expect("sent")
    # Both leases (and roles) were taken back by the new serving process.
    assert c.stat(name).opens == 2
    with pytest.raises(gpushm.BusyError):
        gpushm.connect(sdaemon.socket).channel(name, shape=(64,), dtype="float32")
    p.send("close")
    p.expect("closed")
    with pytest.raises(EOFError):
        rx.recv(timeout=10)       # the producer lives on: its close ended the stream
    p.send("")
    p.close()
    rx.close()
    c.close()


def test_close_after_a_restart_reconnects_to_end_the_role(sdaemon, name):
    """A producer that never talked to the daemon since it restarted still
    ends the stream cleanly when it closes."""
    c = gpushm.connect(sdaemon.socket)
    tx = c.channel(name, nbytes=8)
    p = Peer(sdaemon.socket, """
        import sys, gpushm
        rx = gpushm.connect().channel(sys.argv[1])
        print("open", flush=True)
        n = sum(1 for _ in rx)
        print("eof", n, flush=True)
    """, name)
    p.expect("open")
    os.kill(c.info()["pid"], signal.SIGKILL)
    for k in range(10):
        with tx.send(timeout=10) as t:
            t[:] = k
    tx.close()                         # reconnects, reclaims, and closes
    assert c.reconnects == 1
    p.expect("eof 10")
    p.close()
    c.close()


def test_channel_is_listed_and_stated(daemon, channels, name):
    c = channels()
    tx = c.channel(name, shape=(3,), dtype="int32", slots=5)
    info = c.stat(name)
    assert info.meta == {"kind": "channel", "dtype": "int32", "shape": [3]}
    assert name in {s.name for s in c.list()}
    out = subprocess.run([os.environ["GPUSHM_BIN"], "--socket", daemon.socket, "ls"], capture_output=True, text=True,
                         env=env_for(daemon.socket))
    assert name in out.stdout
    tx.close()


def test_producers_one_after_another(daemon, channels, name):
    """A producer that comes after another one closed continues the stream
    (message numbers go on), so a consumer that stays sees one sequence,
    with an EOF between producers."""
    rx = channels().channel(name, shape=(64,), dtype="float32", slots=2, role="rx")
    base = 0
    for i in range(3):
        p = Peer(daemon.socket, """
            import sys, numpy as np, gpushm
            name, base = sys.argv[1], int(sys.argv[2])
            tx = gpushm.connect().channel(name, shape=(64,), dtype="float32", slots=2)
            print("open", flush=True)
            for k in range(base, base + 40):
                m = tx.send()
                assert m.seq == k, (m.seq, k)
                with m as t:
                    t[:] = np.arange(64, dtype=np.float32) + k * 7
            tx.close()
            print("done", flush=True)
        """, name, base)
        p.expect("open")   # until a producer comes back, the stream has ended
        for k in range(base, base + 40):
            m = rx.recv(timeout=30)
            assert m.seq == k
            with m as t:
                np.testing.assert_array_equal(t, expect(k))
        p.expect("done")
        p.close()
        with pytest.raises(EOFError):
            rx.recv(timeout=10)
        base += 40


def test_dropped_channel_ends_its_role(channels, name):
    """A channel that goes without close() is closed when collected, as a
    file is: its role ends and the consumer gets the end of the stream."""
    c = channels()
    tx = c.channel(name, nbytes=8)
    rx = channels().channel(name)
    with tx.send() as t:
        t[:] = 1
    del tx, t
    gc.collect()
    with rx.recv(timeout=5) as t:
        assert t[0] == 1
    with pytest.raises(EOFError):
        rx.recv(timeout=5)
    tx = c.channel(name, nbytes=8)          # the role is free, for this client too
    with tx.send() as t:
        t[:] = 2
    with rx.recv(timeout=5) as t:
        assert t[0] == 2
    tx.close()


def test_close_from_another_thread_ends_a_wait(channels, name):
    tx = channels().channel(name, nbytes=8)
    rx = channels().channel(name)
    errors = []

    def wait():
        try:
            rx.recv()
        except Exception as e:
            errors.append(e)
    th = threading.Thread(target=wait)
    th.start()
    time.sleep(0.2)
    rx.close()
    th.join(10)
    assert not th.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], ValueError) and "closed while recv waited" in str(errors[0])
    tx.close()
