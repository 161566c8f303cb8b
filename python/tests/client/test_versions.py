"""Release, reacquire and versions: a reader gives a segment's memory back
and keeps its addresses while the daemon evicts it, and maps it again
there; a writer in another process makes the name's next version current,
and the reader refreshes onto it at the same addresses. Every check reads
through an array made before, at the address it had from the start."""

import errno
import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import gpushm

from conftest import PYDIR, Daemon, Peer, child, env_for

SIZE = (1 << 20) + 17  # not a whole number of pages


def pattern(seed, size=SIZE):
    """The bytes of version seed: every version differs at every byte."""
    return ((np.arange(size, dtype=np.int64) * 7 + seed * 13) % 251).astype(np.uint8)


# Makes the next version of argv[1], argv[2] bytes of pattern(argv[3]); with
# argv[4] == "die" it is killed before the commit, as a crash leaves it.
WRITER = """
    import os, signal, sys
    import numpy as np
    import gpushm
    name, size, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    c = gpushm.connect()
    seg = c.create(name, size, next_version=True)
    assert seg.info.uncommitted and seg.version == 1    # no version yet: the commit numbers it
    np.asarray(seg.memoryview())[:] = ((np.arange(size, dtype=np.int64) * 7 + seed * 13) % 251).astype(np.uint8)
    if sys.argv[4:] == ["die"]:
        os.kill(os.getpid(), signal.SIGKILL)
    seg.commit()
    print(seg.version)
"""


def next_version(sock, name, seed, size=SIZE):
    """Another process makes the next version of name current; returns its
    version."""
    return int(child(sock, WRITER, name, size, seed))


def address(arr):
    return arr.__array_interface__["data"][0]


def reader(sock, name, seed):
    """A client, its read-only Segment of name, and a numpy array over it,
    checked to hold pattern(seed)."""
    c = gpushm.connect(sock)
    seg = c.open(name, readonly=True)
    arr = np.asarray(seg.memoryview())
    assert np.array_equal(arr, pattern(seed, seg.size))
    return c, seg, arr


def make(client, name, seed, size=SIZE, **kw):
    """Creates name holding pattern(seed) and lets go of it."""
    seg = client.create(name, size, **kw)
    np.asarray(seg.memoryview())[:] = pattern(seed, size)
    seg.close()


def test_release_evict_reacquire_keeps_the_address(daemon, client, name):
    make(client, name, 1)
    c, seg, arr = reader(daemon.socket, name, 1)
    at = address(arr)
    assert seg.version == 1 and not seg.released and client.stat(name).opens == 1

    seg.release()
    assert seg.released and client.stat(name).opens == 0
    seg.release()                                        # twice: nothing more
    with pytest.raises(ValueError, match="released"):
        seg.read(1)
    with pytest.raises(ValueError, match="released"):
        np.asarray(seg)                                  # no new array over released memory
    with pytest.raises(BufferError, match="released"):
        seg.__dlpack__()
    inf = client.evict(name)                             # nobody holds it: it may move
    assert (inf.tier, inf.opens) == ("host", 0)
    assert client.stat(name).tier == "host"

    seg.reacquire()
    assert not seg.released and address(arr) == at
    assert np.array_equal(arr, pattern(1))               # the array made before the release
    st = client.stat(name)
    assert (st.tier, st.opens, st.version, st.versions) == ("gpu", 1, 1, ())
    seg.reacquire()                                      # not released: nothing to do
    assert client.stat(name).opens == 1
    assert seg.read(4) == pattern(1)[:4].tobytes()

    # A mapping dropped while released frees its address range, and has no
    # lease left to end.
    seg.release()
    assert maps_at(at) == "---p"                         # kept, inaccessible
    del seg, arr
    gc.collect()
    assert maps_at(at) is None and client.stat(name).opens == 0
    c.close()


def maps_at(addr):
    """The permissions of this process's mapping holding addr, or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= addr < hi:
                return perms
    return None


def test_next_version_refresh_in_place(daemon, client, name):
    make(client, name, 1, mode=0o644)
    c, seg, arr = reader(daemon.socket, name, 1)
    at = address(arr)
    keep = gpushm.connect(daemon.socket)
    kept = keep.open(name)                               # a second reader of version 1, in its own client
    assert not seg.stale()

    held = segments(client)
    waited = {}
    t = threading.Thread(target=lambda: waited.update(info=seg.wait_version(60)))
    t.start()
    assert next_version(daemon.socket, name, 2) == 2
    t.join(60)
    assert waited["info"].version == 2 and waited["info"].id != seg.id
    assert seg.stale()
    assert np.array_equal(arr, pattern(1)), "a reader that has not refreshed saw the new version"
    st = client.stat(name)
    assert st.version == 2 and len(st.versions) == 1 and st.mode == 0o644   # the writer gave no mode: version 1's
    v1 = st.versions[0]
    assert (v1.id, v1.version, v1.opens, v1.pids) == (seg.id, 1, 2, (os.getpid(),))

    assert seg.refresh() is True
    assert seg.version == 2 and address(arr) == at and not seg.stale()
    assert np.array_equal(arr, pattern(2))
    assert seg.refresh() is False                        # the same version: nothing to do
    st = client.stat(name)
    assert st.opens == 1 and len(st.versions) == 1 and st.versions[0].opens == 1

    kept.close()
    del kept
    keep.close()                                         # the last reader of version 1 goes
    st = client.stat(name)
    assert st.versions == () and st.opens == 1
    wait_segments(client, held)                          # version 1 is freed
    del seg, arr
    gc.collect()
    assert client.stat(name).opens == 0                  # the finalizer ended the lease on version 2
    c.close()


def segments(client):
    """How many segments the daemon holds, named or not."""
    return client.info()["usage"]["segments"]


def wait_segments(client, n):
    """Waits until the daemon holds n segments: what a test let go of is
    freed."""
    deadline = time.monotonic() + 10
    while segments(client) != n:
        assert time.monotonic() < deadline, f"{segments(client)} segments held, want {n}"
        time.sleep(0.01)


def test_writer_killed_before_commit_leaves_the_version(daemon, client, name):
    make(client, name, 1)
    c, seg, arr = reader(daemon.socket, name, 1)
    held = segments(client)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(WRITER), name, str(SIZE), "9", "die"],
                       env=env_for(daemon.socket), capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    with pytest.raises(gpushm.WaitTimeoutError):
        seg.wait_version(0.2)
    assert not seg.stale() and seg.refresh() is False
    st = client.stat(name)
    assert (st.id, st.version, st.versions) == (seg.id, 1, ())
    assert np.array_equal(arr, pattern(1))
    wait_segments(client, held)                          # the dead writer's segment goes
    del seg, arr
    c.close()


def test_stale_reacquire_and_refused_versions(daemon, client, name):
    make(client, name, 1)
    c, seg, arr = reader(daemon.socket, name, 1)
    at = address(arr)
    seg.release()
    assert next_version(daemon.socket, name, 3) == 2
    with pytest.raises(gpushm.StaleError) as e:
        seg.reacquire()
    assert (e.value.errno, e.value.code) == (errno.ESTALE, "ESTALE")
    assert seg.released and client.stat(name).opens == 0
    assert seg.refresh() is True                         # released across a new version: refresh maps it
    assert address(arr) == at and seg.version == 2 and np.array_equal(arr, pattern(3))

    # Larger than the addresses kept: EFBIG, and the reader keeps what it has.
    assert next_version(daemon.socket, name, 4, size=2 * SIZE + (4 << 20)) == 3
    with pytest.raises(gpushm.Error) as e:
        seg.refresh()
    assert e.value.code == "EFBIG" and "bytes of addresses" in str(e.value)
    assert not seg.released and seg.version == 2 and np.array_equal(arr, pattern(3))
    # Smaller than the mapped version: views made before may reach past it.
    assert next_version(daemon.socket, name, 5, size=SIZE - 4096) == 4
    with pytest.raises(gpushm.InvalidError, match="views of the mapped version"):
        seg.refresh()
    assert np.array_equal(arr, pattern(3))
    st = client.stat(name)
    assert st.version == 4 and [(v.version, v.opens) for v in st.versions] == [(2, 1)]  # refused leases ended
    assert next_version(daemon.socket, name, 6) == 5     # the same size again: taken
    assert seg.refresh() is True and seg.version == 5 and np.array_equal(arr, pattern(6))
    assert client.stat(name).versions == ()
    del seg, arr
    c.close()


def test_tensor_and_bundle_refresh_keep_their_layout(daemon, client, name):
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    client.put_tensors(name, {"w": w, "b": np.ones(5, dtype=np.int64)}).close()
    c = gpushm.connect(daemon.socket)
    bundle = c.tensors(name, readonly=True)
    arrs = {k: np.asarray(v) for k, v in bundle.items()}
    at = {k: address(a) for k, a in arrs.items()}
    seg = bundle.segment

    # The same layout, new values: the arrays made before see them once it
    # is current and refreshed onto.
    nv = client.put_tensors(name, {"w": w * 10, "b": np.full(5, 7, dtype=np.int64)}, next_version=True, commit=False)
    assert nv.info.uncommitted and not seg.stale() and seg.refresh() is False
    assert np.array_equal(np.asarray(nv.tensors()["w"]), w * 10)   # the writer's own view, before its commit
    nv.commit()
    nv.close()
    assert seg.stale() and seg.refresh() is True
    assert {k: address(a) for k, a in arrs.items()} == at
    assert np.array_equal(arrs["w"], w * 10) and np.array_equal(arrs["b"], np.full(5, 7))
    again = c.tensors(name, readonly=True)               # a new open maps afresh, the same bytes
    assert again.segment.version == 2 and np.array_equal(np.asarray(again["w"]), w * 10)
    del again

    # Another shape (same size): refused, the old version stays mapped.
    client.put_tensors(name, {"w": (w * 100).reshape(4, 3), "b": np.full(5, 8, dtype=np.int64)},
                       next_version=True).close()
    with pytest.raises(gpushm.InvalidError, match="laid out unlike"):
        seg.refresh()
    assert seg.version == 2 and not seg.released and np.array_equal(arrs["w"], w * 10)
    assert client.stat(name).versions[0].version == 2

    # A tensor segment: another dtype of the same size is refused.
    t = name + "-t"
    client.create(t, shape=(4,), dtype="float32").write(np.arange(4, dtype=np.float32))
    ts = c.open(t, readonly=True)
    ta = np.asarray(ts)
    nv = client.create(t, shape=(4,), dtype="int32", next_version=True)
    nv.write(np.arange(4, dtype=np.int32))
    nv.commit()
    with pytest.raises(gpushm.InvalidError, match="its tensor is int32"):
        ts.refresh()
    assert ta.dtype == np.float32 and ta.tolist() == [0, 1, 2, 3]
    nv = client.create(t, shape=(4,), dtype="float32", next_version=True, mode=0o640)
    nv.write(np.full(4, 5, dtype=np.float32))
    nv.commit()
    assert ts.refresh() is True and ta.tolist() == [5, 5, 5, 5]
    assert client.stat(t).mode == 0o640                  # a mode given is the new version's
    del nv, ta, ts, arrs, bundle, seg
    c.close()


# A stand-in for torch: Tensors over numpy arrays and Modules holding them,
# the little of torch that gpushm.torch's release, reacquire and refresh use.
FAKE_TORCH = {
    "torch/__init__.py": """
        from . import nn

        class Tensor:
            def __init__(self, arr):
                self.arr = arr

            def data_ptr(self):
                return self.arr.__array_interface__["data"][0]
    """,
    "torch/nn/__init__.py": """
        class Module:
            def __init__(self, params=(), buffers=()):
                self._p, self._b = list(params), list(buffers)

            def parameters(self):
                return iter(self._p)

            def buffers(self):
                return iter(self._b)
    """,
}


def test_torch_helpers_with_a_stand_in_torch(daemon, client, name, tmp_path):
    for path, src in FAKE_TORCH.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(textwrap.dedent(src))
    client.put_tensors(name, {"w": np.arange(8, dtype=np.float32), "b": np.zeros(3, dtype=np.float32)}).close()
    client.create(name + "-x", 4096).close()
    out = child(daemon.socket, """
        import sys
        import numpy as np
        import torch
        import gpushm, gpushm.torch
        name = sys.argv[1]
        c = gpushm.connect()
        b = c.tensors(name)
        sd = {k: torch.Tensor(np.asarray(v)) for k, v in b.items()}
        x = c.open(name + "-x")
        model = torch.nn.Module(params=[sd["w"], torch.Tensor(np.zeros(2))], buffers=[sd["b"]])
        gpushm.torch.release(model)
        assert b.segment.released and not x.released            # only the bundle behind the model
        assert c.stat(name).opens == 0
        c.evict(name)
        gpushm.torch.reacquire([model, x])                      # x is not released: left as it is
        assert not b.segment.released and sd["w"].arr.tolist() == list(range(8))
        w = gpushm.connect()
        w.put_tensors(name, {"w": np.full(8, 2, dtype=np.float32), "b": np.ones(3, dtype=np.float32)},
                      next_version=True).close()
        (seg,) = gpushm.torch.segments([sd, model])             # one bundle behind both
        assert seg.version == 1 and seg.name == name and seg.stale()
        assert gpushm.torch.refresh(sd) is True and gpushm.torch.refresh(model) is False
        assert seg.version == 2
        assert sd["w"].arr.tolist() == [2] * 8 and sd["b"].arr.tolist() == [1] * 3
        assert b.segment.version == 2 and c.stat(name).versions == ()
        gpushm.torch.release((sd["w"], b["b"]))                 # a tuple of a tensor and a View: one segment
        w.put_tensors(name, {"w": np.full(8, 3, dtype=np.float32), "b": np.ones(3, dtype=np.float32)},
                      next_version=True).close()
        try:
            gpushm.torch.reacquire(sd)
            raise AssertionError("reacquired a replaced version")
        except gpushm.StaleError:
            pass
        assert gpushm.torch.refresh(sd) is True and sd["w"].arr.tolist() == [3] * 8
        for bad, err in ((torch.Tensor(np.zeros(3)), ValueError), (object(), TypeError)):
            try:
                gpushm.torch.refresh(bad)
                raise AssertionError(f"refresh of {bad!r}")
            except err:
                pass
        print("ok")
    """, name, env={"PYTHONPATH": f"{tmp_path}:{PYDIR}"})
    assert out.strip() == "ok"


@pytest.fixture
def sdaemon():
    """A daemon of its own, whose serving process the test kills: its
    supervisor starts another, which keeps the segments and leases."""
    d = Daemon("host", "--grace", "2s")
    yield d
    d.stop()


# Makes the next version of argv[1] for every seed read from stdin, across
# restarts of the daemon's serving process (its client reconnects).
PEER_WRITER = """
    import sys
    import numpy as np
    import gpushm
    name, size = sys.argv[1], int(sys.argv[2])
    c = gpushm.connect()
    print("ok", flush=True)
    for line in sys.stdin:
        seed = int(line)
        seg = c.create(name, size, next_version=True)
        np.asarray(seg.memoryview())[:] = ((np.arange(size, dtype=np.int64) * 7 + seed * 13) % 251).astype(np.uint8)
        seg.commit()
        v = seg.version
        seg.close()
        del seg                                  # its lease ends: the reader's is the only one
        print(v, flush=True)
"""


def serving_pid(sock):
    with gpushm.connect(sock, reconnect=0) as c:
        return c.info()["pid"]


def kill_serving(sock):
    """SIGKILLs the serving process and waits for its successor."""
    old = serving_pid(sock)
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:
        try:
            if serving_pid(sock) != old:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, "no new serving process within 30s"
        time.sleep(0.01)


def test_release_and_refresh_cycles_across_crashes(sdaemon):
    """20 cycles of: release, evict, reacquire, check; a writer process
    makes the next version, refresh, check; the serving process is SIGKILLed
    between every fourth and the next, and while released in four. The array made at the start reads every version at
    its first address, and at the end the name holds one segment."""
    sock, name = sdaemon.socket, "cycled"
    owner = gpushm.connect(sock)
    make(owner, name, 0)
    c, seg, arr = reader(sock, name, 0)
    at = address(arr)
    writer = Peer(sock, PEER_WRITER, name, SIZE)
    writer.expect("ok")
    for i in range(1, 21):
        seg.release()
        assert seg.released
        inf = owner.evict(name)
        assert (inf.tier, inf.opens, inf.version) == ("host", 0, i), f"cycle {i}: {inf}"
        if i % 5 == 2:
            kill_serving(sock)                   # while released: the reconnection reclaims no lease
        seg.reacquire()
        assert address(arr) == at and np.array_equal(arr, pattern(i - 1)), f"cycle {i}: after reacquire"
        st = owner.stat(name)
        assert (st.tier, st.opens, st.version) == ("gpu", 1, i), f"cycle {i}: {st}"

        writer.send(str(i))
        assert writer.expect() == str(i + 1)
        assert seg.stale(), f"cycle {i}: not stale after version {i + 1}"
        assert seg.refresh() is True and seg.version == i + 1 and not seg.stale()
        assert address(arr) == at and np.array_equal(arr, pattern(i)), f"cycle {i}: after refresh"
        if i % 4 == 0 and i < 20:
            kill_serving(sock)
    writer.p.stdin.close()
    assert writer.p.wait(60) == 0, writer.p.stderr.read()
    st = owner.stat(name)
    assert (st.version, st.opens, st.versions) == (21, 1, ())
    info = owner.info()
    assert info["usage"]["segments"] == 1 and info["restarts"] == 8 and c.reconnects == 8
    del seg, arr
    c.close()
    owner.close()
