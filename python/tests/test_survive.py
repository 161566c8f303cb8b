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
    # segment when the grace period ends; ours stays.
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
    names = {s.name for s in c.list()}
    assert {"kept", "temp", "after", "peer-temp"} <= names
    time.sleep(2.5)
    names = {s.name for s in c.list()}
    assert "temp" in names and "peer-temp" not in names
    assert np.asarray(temp.memoryview()).view(np.int32).tolist() == list(range(16))
    c.close()
    # Our connection is gone: our temporary segment with it.
    with gpushm.connect(sdaemon.socket) as c2:
        deadline = time.monotonic() + 5
        while "temp" in {s.name for s in c2.list()}:
            assert time.monotonic() < deadline, "temporary segment outlived its client"
            time.sleep(0.02)


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
