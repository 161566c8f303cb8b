"""Write, then commit: a segment created uncommitted is its creator's alone
until committed; readers refuse it or wait for it; a writer killed at any
moment leaves its name gone or whole, never half written."""

import hashlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import gpushm

from conftest import Daemon, Peer, env_for


@pytest.fixture
def sdaemon():
    d = Daemon("host", "--grace", "1s", "--log-level", "debug")
    yield d
    d.stop()


def wait_for_waits(d, n, timeout=60):
    """Waits until the daemon's log shows n opens waiting for a commit."""
    deadline = time.monotonic() + timeout
    while True:
        # Read through a description of our own: the daemon's shares the
        # fixture's file offset.
        with open(d.log.name) as f:
            log = f.read()
        if log.count("open waits for a commit") >= n:
            return
        assert time.monotonic() < deadline, f"fewer than {n} waiting opens:\n{log}"
        time.sleep(0.005)


READER = """
    import hashlib, sys, gpushm
    c = gpushm.connect()
    print("asking", flush=True)
    seg = c.open(sys.argv[1], readonly=True, wait=300)
    print(hashlib.sha256(seg.read()).hexdigest(), flush=True)
"""


def test_readers_wait_for_the_commit(daemon, client, name):
    data = np.random.default_rng(3).integers(0, 255, size=3 << 20, dtype=np.uint8)
    readers = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(READER), name], env=env_for(daemon.socket),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)]
    try:
        for r in readers:
            assert r.stdout.readline().strip() == "asking"
        seg = client.create(name, data.nbytes, mode=0o644, uncommitted=True)
        assert seg.info.uncommitted
        other = gpushm.connect(daemon.socket)
        with pytest.raises(gpushm.NotCommittedError, match="still being written"):
            other.open(name)
        assert other.stat(name).uncommitted
        assert [s.uncommitted for s in other.list() if s.name == name] == [True]
        with pytest.raises(gpushm.ExistsError):
            other.create(name, 4096)
        np.asarray(seg.memoryview())[:] = data
        seg.commit()
        assert not seg.info.uncommitted and not other.stat(name).uncommitted
        want = hashlib.sha256(data.tobytes()).hexdigest()
        for r in readers:
            out, err = r.communicate(timeout=120)
            assert r.returncode == 0, err
            assert out.strip() == want
        # Committed, the name opens at once, for everyone.
        assert bytes(other.open(name, True).read(16)) == data[:16].tobytes()
        with pytest.raises(gpushm.InvalidError, match="committed already"):
            seg.commit()
        other.close()
    finally:
        for r in readers:
            r.kill()
            r.wait()
        client.unlink(name)


def test_bad_waits_and_commits(client, name):
    for wait in (0, -1, 3601, float("inf")):
        with pytest.raises(ValueError, match="wait"):
            client.open(name, wait=wait)
    t0 = time.monotonic()
    with pytest.raises(gpushm.WaitTimeoutError):
        client.open(name, wait=0.3)
    assert time.monotonic() - t0 >= 0.3
    with pytest.raises(gpushm.InvalidError, match="exist_ok"):
        client.create(name, 4096, exist_ok=True, uncommitted=True)
    # A committed segment cannot be committed again.
    seg = client.create(name, 4096)
    with pytest.raises(gpushm.InvalidError, match="committed already"):
        seg.commit()
    client.unlink(name)


WRITER = """
    import sys, numpy as np, gpushm
    name, n = sys.argv[1], int(sys.argv[2])
    data = np.random.default_rng(5).integers(0, 255, size=n, dtype=np.uint8)
    c = gpushm.connect()
    seg = c.create(name, n, uncommitted=True)
    mv = np.asarray(seg.memoryview())
    print("created", flush=True)
    for off in range(0, n, 1 << 20):
        mv[off:off + (1 << 20)] = data[off:off + (1 << 20)]
    seg.commit()
    print("committed", flush=True)
"""


def test_waiting_reader_learns_the_writer_died(sdaemon, name):
    w = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER.replace("seg.commit()", "input()")), name,
                          str(1 << 20)], env=env_for(sdaemon.socket), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert w.stdout.readline().strip() == "created"
        r = Peer(sdaemon.socket, """
            import sys, gpushm
            c = gpushm.connect()
            print("asking", flush=True)
            try:
                c.open(sys.argv[1], wait=300)
                print("opened")
            except gpushm.NotFoundError as e:
                print("gone" if "went before its writer committed it" in str(e) else repr(e))
        """, name)
        r.expect("asking")
        wait_for_waits(sdaemon, 1)
        w.kill()
        w.wait()
        r.expect("gone")
        r.close()
    finally:
        w.kill()
        w.wait()
    with gpushm.connect(sdaemon.socket) as c:
        with pytest.raises(gpushm.NotFoundError):
            c.stat(name)


def test_killed_writers_leave_nothing_half_made(sdaemon):
    n = 16 << 20
    want = hashlib.sha256(np.random.default_rng(5).integers(0, 255, size=n, dtype=np.uint8).tobytes()).hexdigest()
    env = env_for(sdaemon.socket)

    def start(name):
        return subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), name, str(n)], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    t0 = time.monotonic()
    w = start("whole")
    w.communicate(timeout=120)
    took = time.monotonic() - t0
    c = gpushm.connect(sdaemon.socket)
    assert hashlib.sha256(c.open("whole", True).read()).hexdigest() == want
    c.unlink("whole")
    rng = random.Random()
    outcomes = {"whole": 0, "gone": 0}
    restarts = 0
    for i in range(10):
        name = f"w-{i}"
        w = start(name)
        time.sleep(rng.uniform(0, took * 1.5))
        restart = i % 4 == 3
        pid = c.info()["pid"] if restart else None
        w.kill()
        w.wait()
        if restart:
            os.kill(pid, signal.SIGKILL)
            restarts += 1
        deadline = time.monotonic() + 60
        while True:
            try:
                seg = c.open(name, True)
            except gpushm.NotFoundError:
                outcomes["gone"] += 1
                break
            except gpushm.NotCommittedError:
                assert time.monotonic() < deadline, f"{name} still incomplete after 60s"
                time.sleep(0.01)
                continue
            assert hashlib.sha256(seg.read()).hexdigest() == want, f"{name} is served half made"
            outcomes["whole"] += 1
            seg.close()
            c.unlink(name)
            break
    print(f"10 killed writers ({restarts} with the serving process killed too; a writer runs {took:.2f}s): {outcomes}")
    c.close()


def test_put_tensors_and_share_commit(client, name):
    seg = client.put_tensors(name, {"w": np.arange(12, dtype=np.float32).reshape(3, 4)})
    assert not seg.info.uncommitted and not client.stat(name).uncommitted
    client.unlink(name)
    seg = client.share(name, np.arange(5, dtype=np.int64))
    assert not client.stat(name).uncommitted
    assert list(np.asarray(gpushm.connect(client.socket).open(name, True))) == [0, 1, 2, 3, 4]
    client.unlink(name)
