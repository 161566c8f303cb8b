"""More models than GPU memory, from Python: a budget on the host backend
(whose memory stands for a GPU's), segments evicted to host memory and
brought back by an open in another process; evict, load, pin."""

import numpy as np
import pytest

import gpushm

from conftest import Daemon, child

MIB = 1 << 20


@pytest.fixture
def tdaemon():
    d = Daemon("host", "--gpu-budget", str(3 * MIB), "--host-budget", str(4 * MIB))
    yield d
    d.stop()


def fill(c, name, k):
    seg = c.create(name, MIB)
    np.frombuffer(seg.memoryview(), dtype=np.uint8)[:] = k
    seg.close()


READ = """
    import sys, numpy as np, gpushm
    c = gpushm.connect()
    for name in sys.argv[1:]:
        seg = c.open(name, readonly=True)
        v = np.frombuffer(seg.memoryview(), dtype=np.uint8)
        print(name, int(v.min()), int(v.max()), flush=True)
        seg.close()
"""


def test_evicted_segments_come_back_in_another_process(tdaemon):
    c = gpushm.connect(tdaemon.socket)
    for k in range(4):
        fill(c, f"m{k}", k + 1)  # the fourth evicts m0, the least recently opened
    assert [c.stat(f"m{k}").tier for k in range(4)] == ["host", "gpu", "gpu", "gpu"]
    out = child(tdaemon.socket, READ, "m0", "m1", "m2", "m3").split("\n")
    assert out[:4] == [f"m{k} {k + 1} {k + 1}" for k in range(4)]
    tiers = c.info()["tiers"]
    assert tiers["devices"][0]["peak_bytes"] <= 3 * MIB and tiers["restores"] >= 1, tiers
    assert c.stat("m0").last_open > 0


def test_evict_load_pin_and_their_errors(tdaemon):
    c = gpushm.connect(tdaemon.socket)
    for k in range(3):
        fill(c, f"m{k}", k + 1)
    held = c.open("m1")
    with pytest.raises(gpushm.BusyError, match="it is open"):
        c.evict("m1")
    held.close()
    assert c.evict("m1").tier == "host"
    assert c.load("m1").tier == "gpu"
    info = c.pin("m2")
    assert info.pinned and info.tier == "gpu"
    with pytest.raises(gpushm.BusyError, match="pinned"):
        c.evict("m2")
    assert not c.pin("m2", False).pinned
    with pytest.raises(gpushm.NoSpaceError, match="budget"):
        c.create("big", 4 * MIB)
    p = c.create("p", MIB, pin=True)
    assert p is not None and c.stat("p").pinned
    # Everything on the device open or pinned: no room for another.
    opened = [c.open(n) for n in ("m0", "m1", "m2") if c.stat(n).tier == "gpu"]
    assert len(opened) == 2, [c.stat(n).tier for n in ("m0", "m1", "m2")]
    with pytest.raises(gpushm.NoSpaceError, match="no room"):
        c.create("more", MIB)
    for s in opened:
        s.close()
