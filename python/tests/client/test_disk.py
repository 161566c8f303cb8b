"""The disk tier and durable segments from Python (docs/disk.md): a segment
evicted to disk comes back in another process; a durable bundle and a
durable segment written through a mapping and synced are listed again, and
read back whole, by a new daemon on the same directories after every
process of the old one was killed (a reboot, as far as memory goes)."""

import os
import signal
import tempfile
import time

import numpy as np
import pytest

import gpushm
import gpushm.testing

from conftest import Daemon, child

MIB = 1 << 20


@pytest.fixture
def disk_dir():
    d = tempfile.mkdtemp(prefix="gpushm-py-disk-")
    yield os.path.join(d, "disk")
    import shutil
    shutil.rmtree(d, ignore_errors=True)


def daemon_procs(sock):
    """The live processes whose command line names the socket: the
    supervisor and serving processes, whoever started them."""
    pids = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if sock.encode() in cmd and gpushm.testing.start_time(int(p)) is not None:
            pids.append(int(p))
    return pids


def kill_all(d):
    """Every process of the daemon, as a crash of the machine would end
    them: each stopped first, so that none starts another when it sees
    another die, then killed, until none is left; nothing it held stays."""
    for _ in range(1000):
        pids = daemon_procs(d.socket)
        if not pids:
            break
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        time.sleep(0.01)
    d.proc.wait()
    d.stop()


READ = """
    import sys, numpy as np, gpushm
    c = gpushm.connect()
    for name in sys.argv[1:]:
        seg = c.open(name, readonly=True)
        v = np.frombuffer(seg.memoryview(), dtype=np.uint8)
        print(name, c.stat(name).tier, int(v.min()), int(v.max()), flush=True)
        seg.close()
"""


def test_evict_to_disk_and_back(disk_dir):
    d = Daemon("host", "--disk", disk_dir)
    try:
        c = gpushm.connect(d.socket)
        seg = c.create("cold", MIB)
        np.frombuffer(seg.memoryview(), dtype=np.uint8)[:] = 7
        seg.close()
        assert c.evict("cold", to="disk").tier == "disk"
        assert c.info()["tiers"]["disk"]["segments"] == 1
        assert child(d.socket, READ, "cold").strip() == "cold gpu 7 7"
        with pytest.raises(gpushm.InvalidError):
            c.evict("cold", to="moon")
        with pytest.raises(gpushm.InvalidError, match="not durable"):
            c.sync("cold")
    finally:
        d.stop()


def test_durable_segments_survive_a_reboot(disk_dir):
    d = Daemon("host", "--disk", disk_dir)
    try:
        c = gpushm.connect(d.socket)
        w = np.arange(MIB // 4, dtype=np.float32)
        c.put_tensors("weights", {"w": w}, persist=True)
        seg = c.create("state", MIB, persist=True, mode=0o640)
        np.frombuffer(seg.memoryview(), dtype=np.uint8)[:] = 3
        seg.close()
        info = c.sync("state")
        assert info.persist and info.synced > 0 and not info.stale
        c.create("scratch", MIB).close()
        c.close()
    finally:
        kill_all(d)
    d = Daemon("host", "--disk", disk_dir)
    try:
        c = gpushm.connect(d.socket)
        assert sorted(s.name for s in c.list()) == ["state", "weights"]
        st = c.stat("state")
        assert st.persist and st.mode == 0o640 and st.tier == "disk"
        assert child(d.socket, READ, "state").strip() == "state gpu 3 3"
        b = c.tensors("weights", readonly=True)
        assert np.array_equal(np.asarray(b["w"]), w)
    finally:
        d.stop()


def test_offer_and_peers_without_peers(disk_dir):
    d = Daemon("host")
    try:
        c = gpushm.connect(d.socket)
        c.create("o", MIB).close()
        assert c.offer("o").offer
        assert not c.offer("o", False).offer
        assert c.peers() is None
    finally:
        d.stop()


def test_pull_without_peers(disk_dir):
    d = Daemon("host")
    try:
        c = gpushm.connect(d.socket)
        with pytest.raises(gpushm.Error, match="no peers"):
            c.pull("x", "node2")
    finally:
        d.stop()
