"""The Python client rides through restarts and upgrades of the daemon's
serving process: mappings keep working, the client reconnects by itself,
reclaims its leases and temporary segments, and retries what it was doing."""

import os
import signal
import time

import numpy as np
import pytest

import gpushm

from conftest import Daemon, Peer


@pytest.fixture
def sdaemon():
    d = Daemon("host", "--grace", "2s")
    yield d
    d.stop()


def serving_pid(sock):
    with gpushm.connect(sock, reconnect=0) as c:
        return c.info()["pid"]


def wait_new_pid(sock, old, timeout=30):
    deadline = time.monotonic() + timeout
    while True:
        try:
            pid = serving_pid(sock)
            if pid != old:
                return pid
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"no new serving process within {timeout}s")
        time.sleep(0.01)


def test_client_rides_through_a_crash(sdaemon):
    c = gpushm.connect(sdaemon.socket)
    seg = c.create("kept", shape=(4096,), dtype="uint8")
    arr = np.asarray(seg.memoryview())
    arr[:] = 7
    temp = c.share("temp", np.arange(16, dtype=np.int32))   # temporary by default
    info = c.info()
    assert info["pid"] != info["supervisor_pid"] > 0

    os.kill(info["pid"], signal.SIGKILL)
    # The mapping is this process's own: it works while the daemon is down.
    arr[:] = 9
    assert int(arr.sum()) == 9 * 4096
    wait_new_pid(sdaemon.socket, info["pid"])

    # The next operation reconnects, reclaims, and succeeds.
    assert c.stat("kept").size == 4096
    assert c.reconnects == 1
    assert int(np.asarray(c.open("kept").memoryview()).sum()) == 9 * 4096
    new = c.create("after", 100)
    assert new.created
    # A peer that dies while the daemon is down loses its temporary
    # segment as soon as the new serving process sees it gone, without
    # waiting for the grace period; ours stays, then and after it.
    peer = Peer(sdaemon.socket, """
        import sys, gpushm, numpy as np
        c = gpushm.connect()
        c.share("peer-temp", np.zeros(4, dtype=np.uint8))
        print("ok", flush=True)
        sys.stdin.readline()
    """)
    peer.expect("ok")
    pid = serving_pid(sdaemon.socket)
    os.kill(pid, signal.SIGKILL)
    peer.p.kill()
    peer.p.wait()
    wait_new_pid(sdaemon.socket, pid)
    assert c.stat("temp").name == "temp"     # reclaimed again, after a second crash
    wait_names(sdaemon.socket, lambda names: {"kept", "temp", "after"} <= names and "peer-temp" not in names,
               "the dead peer's temporary segment ends at once")
    time.sleep(2.5)                          # the grace period ends
    names = {s.name for s in c.list()}
    assert "temp" in names and "peer-temp" not in names
    assert np.asarray(temp.memoryview()).view(np.int32).tolist() == list(range(16))
    c.close()
    # Our connection is gone: our temporary segment with it.
    wait_names(sdaemon.socket, lambda names: "temp" not in names, "temporary segment outlived its client")


def wait_names(sock, cond, why, timeout=30):
    """Waits until cond holds of the set of names the daemon lists."""
    deadline = time.monotonic() + timeout
    with gpushm.connect(sock, reconnect=0) as c:
        while True:
            names = {s.name for s in c.list()}
            if cond(names):
                return names
            assert time.monotonic() < deadline, f"{why}: the daemon names {sorted(names)}"
            time.sleep(0.02)


def grace_left(sock):
    with gpushm.connect(sock, reconnect=0) as c:
        return c.info()["grace_seconds"]


def wait_grace_over(sock, timeout=30):
    """Waits until the serving process's grace period has ended."""
    deadline = time.monotonic() + timeout
    while grace_left(sock) > 0:
        assert time.monotonic() < deadline, f"grace period still running after {timeout}s"
        time.sleep(0.05)


IDLE = """
    import sys, gpushm, numpy as np
    c = gpushm.connect()
    seg = c.share(sys.argv[1], np.arange(1000, dtype=np.float32))
    print("ok", flush=True)
    for line in sys.stdin:                  # idle: no call until asked
        cmd = line.strip()
        if cmd == "check":
            mine = np.asarray(seg.memoryview()).view(np.float32)
            again = np.asarray(c.open(sys.argv[1], readonly=True).memoryview()).view(np.float32)
            assert c.stat(sys.argv[1]).size == 4000
            ok = (mine == np.arange(1000, dtype=np.float32)).all() and (again == mine).all()
            print(f"ok reconnects={c.reconnects}" if ok else "bytes differ", flush=True)
        elif cmd == "close":
            c.close()
            print("ok closed", flush=True)
"""


def test_idle_share_survives_restarts(sdaemon):
    """A client shares a temporary segment and makes no call for 60 s, while
    the serving process is SIGKILLed 5 times, each grace period (2 s)
    running out long before its next call: the segment stays, with its
    bytes, because the client's process lives. Its next call works, and
    when it exits the segment goes."""
    peer = Peer(sdaemon.socket, IDLE, "idle-share")
    peer.expect("ok")
    want = np.arange(1000, dtype=np.float32)
    for i in range(5):
        time.sleep(12)
        pid = serving_pid(sdaemon.socket)
        os.kill(pid, signal.SIGKILL)
        wait_new_pid(sdaemon.socket, pid)
        wait_grace_over(sdaemon.socket)
        with gpushm.connect(sdaemon.socket, reconnect=0) as c:
            got = np.asarray(c.open("idle-share", readonly=True).memoryview()).view(np.float32)
            assert (got == want).all(), f"restart {i + 1}: the bytes changed"
    peer.send("check")
    peer.expect("ok reconnects=5")           # by itself after each restart, as it holds the segment
    peer.close()                             # exits: its connection ends
    wait_names(sdaemon.socket, lambda names: "idle-share" not in names, "the segment outlived its client's process")


HOLD = """
    import sys, gpushm, numpy as np
    c = gpushm.connect()
    arr = np.asarray(c.open(sys.argv[1]).memoryview())
    print("ok", flush=True)
    for line in sys.stdin:                  # idle: no call until asked
        arr[:] = int(line)                  # into its mapping, no call either
        print(f"ok reconnects={c.reconnects}", flush=True)
"""


def test_idle_holder_keeps_its_lease(sdaemon):
    """A process maps a segment and makes no call while the serving process
    is SIGKILLed, the grace period (2 s) running out long before its next
    call. Its client notices the restart by itself (WATCH_INTERVAL) and
    reclaims the lease in time: the segment stays open, so it may not move
    (an evict is refused, as a budget's would be), and what the process
    writes into its mapping afterwards is what another process reads."""
    with gpushm.connect(sdaemon.socket) as c:
        np.asarray(c.create("held", 4096).memoryview())[:] = 7
    peer = Peer(sdaemon.socket, HOLD, "held")
    peer.expect("ok")
    pid = serving_pid(sdaemon.socket)
    os.kill(pid, signal.SIGKILL)
    wait_new_pid(sdaemon.socket, pid)
    wait_grace_over(sdaemon.socket)
    with gpushm.connect(sdaemon.socket, reconnect=0) as c:
        with pytest.raises(gpushm.BusyError):
            c.evict("held")
        peer.send("9")
        peer.expect("ok reconnects=1")
        assert np.asarray(c.open("held", readonly=True).memoryview()).tolist() == [9] * 4096
    peer.close()


@pytest.fixture
def long_grace():
    """A daemon whose grace period (10 minutes) outlasts every test: what
    ends a temporary segment here is not the grace period."""
    d = Daemon("host", "--grace", "600s")
    yield d
    d.stop()


def test_killed_creator_loses_its_share_at_once(long_grace):
    sock = long_grace.socket
    during = Peer(sock, IDLE, "killed-during")
    after = Peer(sock, IDLE, "killed-after")
    alive = Peer(sock, IDLE, "alive")
    for p in (during, after, alive):
        p.expect("ok")
    pid = serving_pid(sock)
    os.kill(pid, signal.SIGKILL)
    during.p.kill()                          # likely before the restart
    during.p.wait()
    wait_new_pid(sock, pid)
    wait_names(sock, lambda names: names == {"alive", "killed-after"}, "after the restart")
    after.p.kill()                           # after it, never reconnected
    after.p.wait()
    wait_names(sock, lambda names: names == {"alive"}, "after the second creator was killed")
    assert grace_left(sock) > 60
    alive.send("close")                      # no call since the crash
    alive.expect("ok closed")
    wait_names(sock, lambda names: not names, "after the live client closed")
    alive.close()


def test_retried_requests_have_one_outcome(sdaemon):
    """A request cut off by the crash is sent again; creating, unlinking
    and renaming once more must not fail because the first attempt had
    already done it."""
    c = gpushm.connect(sdaemon.socket)
    for i in range(20):
        pid = serving_pid(sdaemon.socket)
        c.create(f"r{i}", 4096).close()
        os.kill(pid, signal.SIGKILL)
        c.unlink(f"r{i}")                   # retried after the reconnect
        wait_new_pid(sdaemon.socket, pid)
    assert not [s.name for s in c.list() if s.name.startswith("r")]
    c.close()


def test_upgrade_keeps_the_connection(sdaemon):
    c = gpushm.connect(sdaemon.socket)
    seg = c.create("u", 4096)
    pid = c.info()["pid"]
    sup = c.info()["supervisor_pid"]
    os.kill(sup, signal.SIGHUP)
    assert wait_new_pid(sdaemon.socket, pid) != pid
    assert c.stat("u").size == 4096
    assert c.reconnects == 0, "an upgrade hands connections over"
    seg.close()
    c.close()


def test_no_reconnect_when_asked(sdaemon):
    c = gpushm.connect(sdaemon.socket, reconnect=0)
    pid = c.info()["pid"]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ConnectionError):
        c.stat("nothing")
    wait_new_pid(sdaemon.socket, pid)
