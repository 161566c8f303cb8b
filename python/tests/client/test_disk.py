"""The disk tier and durable segments from Python (docs/disk.md): a segment
evicted to disk comes back in another process; a durable bundle and a
durable segment written through a mapping and synced are listed again, and
read back whole, by a new daemon on the same directories after every
process of the old one was killed (a reboot, as far as memory goes)."""

import os
import tempfile

import numpy as np
import pytest

import gpushm

from conftest import Daemon, child

MIB = 1 << 20


@pytest.fixture
def disk_dir():
    d = tempfile.mkdtemp(prefix="gpushm-py-disk-")
    yield os.path.join(d, "disk")
    import shutil
    shutil.rmtree(d, ignore_errors=True)


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
        d.crash()
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
