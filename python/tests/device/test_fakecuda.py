"""The client's CUDA code path, on machines without a GPU: a stand-in
libcuda.so.1 (fakecuda.c) maps host memfds where the driver would map device
memory, and the client is told the host daemon's segments are cuda_fd
handles. This checks what ctypes could get wrong (argument types, pointers
in and out, context push and pop, every resource released), not the driver;
test_gpu.py checks the driver on the GPU machine."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import child, env_for


@pytest.fixture(scope="module")
def fake_libdir(tmp_path_factory):
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in libcuda.so.1")
    d = tmp_path_factory.mktemp("fakecuda")
    src = __file__.rsplit("/", 1)[0] + "/fakecuda.c"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", str(d / "libcuda.so.1"), src], check=True)
    return str(d)


PRELUDE = """
import ctypes, gc, os, sys
import numpy as np
import gpushm
import gpushm._info as C
from gpushm import _dlpack

fake = ctypes.CDLL("libcuda.so.1")
def live():
    return {k: getattr(fake, "fake_" + ("live_" if k != "ctx_depth" else "") + k)() for k in ("handles", "reserved", "mapped", "allocs", "ctx_depth")}
_orig = C.SegmentInfo.from_wire
C.SegmentInfo.from_wire = classmethod(lambda cls, d: _orig(dict(d, handle_type="cuda_fd") if d.get("handle_type") == "memfd" else d))
c = gpushm.connect()
name = sys.argv[1]
"""


def run(daemon, fake_libdir, name, code):
    env = {"LD_LIBRARY_PATH": fake_libdir + ":" + os.environ.get("LD_LIBRARY_PATH", "")}
    return child(daemon.socket, PRELUDE + textwrap.dedent(code), name, env=env)


def test_cuda_path_maps_copies_and_releases(daemon, fake_libdir, name, client):
    out = run(daemon, fake_libdir, name, """
        zero = {"handles": 0, "reserved": 0, "mapped": 0, "allocs": 0, "ctx_depth": 0}
        seg = c.create(name, shape=(4, 8), dtype="float32")
        assert seg.device == 0 and seg.__dlpack_device__() == (2, 0)
        assert live() == {"handles": 0, "reserved": 1, "mapped": 1, "allocs": 0, "ctx_depth": 0}, live()
        src = np.arange(32, dtype=np.float32).reshape(4, 8)
        seg.write(src)                                    # host to device
        assert seg.tobytes() == src.tobytes()             # device to host
        cai = seg.__cuda_array_interface__
        assert cai["data"] == (seg.ptr, False) and cai["typestr"] == "<f4" and cai["shape"] == (4, 8)
        assert not hasattr(seg, "__array_interface__")
        try:
            seg.numpy()
            raise AssertionError("numpy() of GPU memory")
        except TypeError as e:
            assert "GPU memory" in str(e)

        class Cap:
            def __init__(self, cap): self.cap = cap
            def __dlpack__(self, **kw): return self.cap
            def __dlpack_device__(self): return (1, 0)
        host = np.from_dlpack(Cap(seg.__dlpack__(dl_device=(1, 0))))   # copied out
        assert (host == src).all() and live()["allocs"] == 0
        dev_copy = seg.__dlpack__(copy=True, max_version=(1, 0))       # a private device copy
        assert live()["allocs"] == 1
        del dev_copy
        assert live()["allocs"] == 0

        t = c.share(name + "t", src.T)                                 # strided, host to device
        assert t.strides == (1, 8) and t.read() == src.tobytes()
        b = c.put_tensors(name + "b", {"x": src, "y": np.arange(3, dtype=np.int64)}, metadata={"k": "v"})
        got = c.tensors(name + "b")
        assert got["x"].tobytes() == src.tobytes() and got["y"].tobytes() == np.arange(3).tobytes()
        assert got.metadata == {"k": "v"} and got["x"].device == 0
        ro = c.open(name, readonly=True)
        assert ro.readonly and ro.__cuda_array_interface__["data"][1] is True
        try:
            ro.write(b"x")
            raise AssertionError("write to a read-only mapping")
        except PermissionError:
            pass
        cap = seg.__dlpack__(max_version=(1, 0))
        del seg, t, b, got, ro, host
        gc.collect()
        assert live()["mapped"] == 1, live()                          # the capsule holds one
        del cap
        assert live() == zero, live()

        fds = len(os.listdir("/proc/self/fd"))
        for i in range(2000):
            s = c.open(name)
            cap = s.__dlpack__()
            del s, cap
        gc.collect()
        assert live() == zero and len(os.listdir("/proc/self/fd")) == fds, live()
        assert c.info()["usage"]["opens"] == 0
        assert fake.fake_syncs() > 2000                               # every unmap waited for the GPU
        c.open(name).write(np.full(32, 7, dtype=np.float32))
        print("ok")
    """)
    assert out.strip() == "ok"
    # What the "GPU" process wrote is in the shared memory another process sees.
    assert (client.open(name).numpy() == 7).all()


def test_cuda_errors_name_the_call(daemon, fake_libdir, name):
    out = run(daemon, fake_libdir, name, """
        from gpushm import _cuda
        try:
            _cuda.device(3)
        except gpushm.CUDAError as e:
            print(e)
        try:
            _cuda.device(0).import_map(10000, 4096, False)      # not a descriptor
        except gpushm.CUDAError as e:
            print(e, e.result)
        assert live()["ctx_depth"] == 0
    """)
    assert out.splitlines() == ["gpushm: cuDeviceGet: CUresult 101",
                                "gpushm: cuMemImportFromShareableHandle: CUDA_ERROR_INVALID_VALUE 1"]


A, B = "GPU-aaaaaaaa-0000-0000-0000-00000000000a", "GPU-bbbbbbbb-0000-0000-0000-00000000000b"

# The daemon says a segment lives on the GPU of UUID B (its device 0).
ON_B = """
C.SegmentInfo.from_wire = classmethod(lambda cls, d: _orig(dict(d, handle_type="cuda_fd", uuid="%s") if d.get("handle_type") == "memfd" else d))
""" % B


def test_cuda_segment_maps_on_its_gpu_by_uuid(daemon, fake_libdir, name):
    """A process that numbers the node's GPUs its own way (a container,
    CUDA_VISIBLE_DEVICES) maps a segment on the GPU the daemon named by
    UUID, whatever the ordinals, and says so clearly when it cannot see it."""
    code = ON_B + textwrap.dedent("""
        seg = c.create(name, shape=(4,), dtype="float32")
        print(seg.device, fake.fake_last_access_device(), seg.__dlpack_device__())
    """)
    env = {"LD_LIBRARY_PATH": fake_libdir, "FAKECUDA_UUIDS": f"{A},{B}"}
    out = child(daemon.socket, PRELUDE + code, name, env=env)
    assert out.split("\n")[0] == "1 1 (2, 1)", out
    # B first: the same segment is this process's GPU 0.
    env["FAKECUDA_UUIDS"] = f"{B},{A}"
    out = child(daemon.socket, PRELUDE + code, name + "2", env=env)
    assert out.split("\n")[0] == "0 0 (2, 0)", out
    # A process that cannot see B gets an error that says so, and nothing is left mapped.
    env["FAKECUDA_UUIDS"] = A
    out = child(daemon.socket, PRELUDE + ON_B + textwrap.dedent("""
        try:
            c.create(name, shape=(4,), dtype="float32")
        except gpushm.CUDAError as e:
            print(e)
        assert live() == {"handles": 0, "reserved": 0, "mapped": 0, "allocs": 0, "ctx_depth": 0}, live()
        assert not [s for s in c.list() if s.name == name and s.opens]
    """), name + "3", env=env)
    assert "GPU %s is not among the 1 this process can see" % B in out, out


def test_daemon_device_by_uuid(daemon, fake_libdir, name):
    """A tensor on this process's GPU 0 goes to the daemon's number for the
    same GPU, matched by UUID."""
    env = {"LD_LIBRARY_PATH": fake_libdir, "FAKECUDA_UUIDS": f"{A},{B}"}
    out = child(daemon.socket, PRELUDE + textwrap.dedent("""
        c.info = lambda: {"devices": [{"index": 0, "uuid": "%s"}, {"index": 1, "uuid": "%s"}]}
        print(c._daemon_device(0), c._daemon_device(1))
        c2 = gpushm.connect()
        c2.info = lambda: {"devices": [{"index": 0, "uuid": "%s"}]}
        try:
            c2._daemon_device(0)
        except ValueError as e:
            print(e)
        c3 = gpushm.connect()       # a daemon that reports no UUID
        c3.info = lambda: {"devices": [{"index": 0}]}
        print(c3._daemon_device(1))
    """ % (B, A, B)), name, env=env)
    lines = out.splitlines()
    assert lines[0] == "1 0", out
    assert lines[1] == "gpushm: this process's GPU 0 (%s) is not one the daemon serves" % A.lower(), out
    assert lines[2] == "1", out


CHANNEL_END = """
import time
S = [None, 7, 9, 11, 13]
class TorchStream:           # what torch.cuda.Stream looks like
    cuda_stream = 7
class CupyStream:            # what cupy.cuda.Stream looks like
    ptr = 9
class Protocol:              # the __cuda_stream__ protocol
    def __cuda_stream__(self):
        return (0, 13)
given = [None, TorchStream(), CupyStream(), 11, Protocol()]
want_stream = lambda k: 1 if S[k % 5] is None else S[k % 5]   # None: the legacy default stream
n, count, slots = 64, 500, 3
"""


# Every flag read as not landed yet, as a busy GPU leaves them: _reached
# says no, and so does the producer's send(), which reads its drained flags
# inline (0 meets no wait of a message that reuses a slot).
NOT_LANDED = """
_ch._reached = lambda v, want: False
_ch_init = _ch.Channel.__init__
def _not_landed(self, *a, **kw):
    _ch_init(self, *a, **kw)
    if self.role == _ch.TX:
        self._drained = [0] * self.slots
_ch.Channel.__init__ = _not_landed
"""


@pytest.mark.parametrize("waits", ["queued", "landed"])
def test_channel_cuda_path(daemon, fake_libdir, name, waits):
    """Producer and consumer processes through the CUDA path: the control
    block pinned and addressed on the "GPU", every hand-off ordered by a
    stream write after the producer's work and, before the consumer's, a
    stream wait, on the stream each was given, and everything released at
    close. The stand-in runs streams at once, so a wait queued before its
    flag was written (a protocol mistake) fails. Its flags have always
    landed by the time the other end looks, so that no wait is queued
    ("landed"); "queued" makes the ends see every flag as not landed yet,
    as a busy GPU leaves them, so that every wait is queued."""
    env = dict(env_for(daemon.socket), LD_LIBRARY_PATH=fake_libdir + ":" + os.environ.get("LD_LIBRARY_PATH", ""))
    force = "\nimport gpushm._channel as _ch\n" + NOT_LANDED if waits == "queued" else ""
    queued = waits == "queued"
    producer = subprocess.Popen([sys.executable, "-c", PRELUDE + force + textwrap.dedent(CHANNEL_END) + textwrap.dedent("""
        tx = c.channel(name, shape=(n,), dtype="float32", slots=slots, framework=None)
        assert tx.device == 0 and live()["ctx_depth"] == 0
        print("open", flush=True)
        for k in range(count):
            m = tx.send(stream=given[k % 5])
            with m as v:
                assert v.__dlpack_device__() == (2, 0) and v.ptr % 4096 == 0
                src = np.arange(n, dtype=np.float32) + k
                ctypes.memmove(v.ptr, src.ctypes.data, src.nbytes)
            assert fake.fake_last_stream() == want_stream(k), (k, fake.fake_last_stream())
        # One write per message; a wait for every message that reuses a slot.
        assert (fake.fake_writes(), fake.fake_waits(), fake.fake_waits_unmet()) == (count, (count - slots) * queued, 0), \\
            (fake.fake_writes(), fake.fake_waits(), fake.fake_waits_unmet())
        # A thread whose current context is the channel's (as a framework
        # leaves it) hands over without pushing it again.
        fake.cuCtxPushCurrent_v2(tx._dev.ctx)
        pushes = fake.fake_pushes()
        with tx.send(stream=given[count % 5]) as v:
            src = np.arange(n, dtype=np.float32) + count
            ctypes.memmove(v.ptr, src.ctypes.data, src.nbytes)
        assert fake.fake_pushes() == pushes, "the stream operations pushed a context already current"
        fake.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        tx.close()
        del m, v
        gc.collect()
        assert live() == {"handles": 0, "reserved": 0, "mapped": 0, "allocs": 0, "ctx_depth": 0}, live()
        assert fake.fake_live_registered() == 0
        print("closed", flush=True)
    """).replace("queued", str(queued)), name], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert producer.stdout.readline().strip() == "open", producer.stderr.read()
        out = run(daemon, fake_libdir, name, force + CHANNEL_END + textwrap.dedent("""
            rx = c.channel(name, framework=None)
            assert rx.device == 0 and fake.fake_live_registered() == 1
            k = 0
            while True:
                try:
                    m = rx.recv(timeout=30, stream=given[k % 5])
                except EOFError:
                    break
                assert m.seq == k
                with m as v:
                    assert v.readonly
                    got = np.frombuffer(ctypes.string_at(v.ptr, 4 * n), dtype=np.float32)
                    assert (got == np.arange(n, dtype=np.float32) + k).all(), (k, got)
                assert fake.fake_last_stream() == want_stream(k)
                k += 1
            assert k == count + 1
            assert (fake.fake_writes(), fake.fake_waits(), fake.fake_waits_unmet()) == (count + 1, (count + 1) * queued, 0)
            rx.close()
            del m, v
            gc.collect()
            assert fake.fake_live_registered() == 0 and live()["mapped"] == 0 and live()["ctx_depth"] == 0, live()
            print("ok")
        """).replace("queued", str(queued)))
        assert out.strip() == "ok"
        assert producer.stdout.readline().strip() == "closed", producer.stderr.read()
        assert producer.wait(30) == 0, producer.stderr.read()
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.wait()


GROUPS_END = """
import json, time
import gpushm._channel as _ch
n, count, slots = 16, 3000, 32
"""


@pytest.mark.parametrize("waits", ["queued", "landed"])
def test_channel_cuda_groups(daemon, fake_libdir, name, waits):
    """32 slots, each end on one stream: the consumer gives slots back in
    groups of 4 (one cuStreamBatchMemOp each, writing every message's
    drained flag, tail stored after it), and an end whose flag has not
    landed queues, in one call, the waits of the next messages the other
    end has handed over too. The stand-in fails a wait queued before its
    flag was written: so a group's tail stored before its writes, or a
    wait for a message not handed over, fails the run. With "queued" no
    flag is seen landed; every message is still checked, and every slot
    comes back by the end."""
    count, slots = 3000, 32  # as GROUPS_END says
    env = dict(env_for(daemon.socket), LD_LIBRARY_PATH=fake_libdir + ":" + os.environ.get("LD_LIBRARY_PATH", ""))
    force = "\n" + NOT_LANDED if waits == "queued" else ""
    producer = subprocess.Popen([sys.executable, "-c", PRELUDE + GROUPS_END + force + textwrap.dedent("""
        tx = c.channel(name, shape=(n,), dtype="float32", slots=slots, framework=None)
        print("open", flush=True)
        for k in range(count):
            with tx.send(stream=7) as v:
                src = np.arange(n, dtype=np.float32) + k
                ctypes.memmove(v.ptr, src.ctypes.data, src.nbytes)
        # One write a message, on its own or in a batch; every wait met.
        assert fake.fake_writes() == count and fake.fake_waits_unmet() == 0, (fake.fake_writes(), fake.fake_waits_unmet())
        print(json.dumps({"waits": fake.fake_waits(), "batches": fake.fake_batches()}), flush=True)
        tx.close()
        print("closed", flush=True)
    """), name], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert producer.stdout.readline().strip() == "open", producer.stderr.read()
        out = run(daemon, fake_libdir, name, GROUPS_END + force + textwrap.dedent("""
            rx = c.channel(name, framework=None)
            assert rx._group == 4
            while rx._head.value < slots:  # the producer's window full: the first groups are whole
                time.sleep(0.01)
            k = 0
            for m in iter(lambda: rx.recv(timeout=30, stream=9), None):
                assert m.seq == k
                with m as v:
                    got = np.frombuffer(ctypes.string_at(v.ptr, 4 * n), dtype=np.float32)
                    assert (got == np.arange(n, dtype=np.float32) + k).all(), (k, got)
                assert rx._npend < 4 and rx._tail.value + rx._npend == k + 1
                k += 1
                if k == count:
                    break
            assert fake.fake_writes() == count - rx._npend and fake.fake_waits_unmet() == 0
            writes, batches = fake.fake_writes(), fake.fake_batches()
            rx.close()  # gives back the last group
            assert fake.fake_writes() == count and rx._st.last == count
            print(json.dumps({"waits": fake.fake_waits(), "batches": batches, "writes": writes}))
        """))
        got = json.loads(out.strip().splitlines()[-1])
        sent = json.loads(producer.stdout.readline())
        assert producer.stdout.readline().strip() == "closed", producer.stderr.read()
        assert producer.wait(30) == 0, producer.stderr.read()
        if waits == "queued":
            # Every message waited for at each end (the first slots' sends
            # need none), each wait once, and most of them ahead, in batches;
            # the producer's last sends may have covered a few messages it
            # then did not send.
            assert got["waits"] == count and count - slots <= sent["waits"] < count - slots + 8, (got, sent)
            assert got["batches"] >= 7, got
        else:
            assert got["waits"] == 0 and sent["waits"] == 0, (got, sent)
            # At least the groups of the first 28 messages, which were
            # all there when the consumer began, were whole.
            assert got["batches"] >= 7, got
    finally:
        if producer.poll() is None:
            producer.kill()
            producer.wait()


def test_cuda_release_reacquire_refresh(daemon, fake_libdir, name):
    """Release, reacquire and refresh on the CUDA path: released, the range
    stays reserved with nothing mapped in it (after a synchronize) and no
    handle held; reacquire and refresh map at the same device address; a
    bundle's next version is read before it is mapped, and refused when its
    layout differs; a mapping dropped released or refreshed frees its range
    and ends the lease it holds then."""
    out = run(daemon, fake_libdir, name, """
        zero = {"handles": 0, "reserved": 0, "mapped": 0, "allocs": 0, "ctx_depth": 0}
        one = dict(zero, reserved=1, mapped=1)
        size = 3 * 4096 + 5
        seg = c.create(name, size)
        seg.write(b"\\x01" * size)
        ptr = seg.ptr
        syncs = fake.fake_syncs()
        seg.release()
        assert seg.released and live() == dict(zero, reserved=1), live()
        assert fake.fake_syncs() > syncs                               # waited for the GPU first
        assert c.evict(name).tier == "host"
        seg.reacquire()
        assert seg.ptr == ptr and live() == one and seg.read() == b"\\x01" * size, live()

        w = gpushm.connect()
        nv = w.create(name, size, next_version=True)
        nv.write(b"\\x02" * size)
        nv.commit()
        del nv
        assert live() == one, live()
        assert seg.stale() and seg.refresh() is True and seg.ptr == ptr and seg.version == 2
        assert seg.read() == b"\\x02" * size and live() == one, live()

        x = np.arange(6, dtype=np.float32)
        c.put_tensors(name + "b", {"x": x}).close()
        b = c.tensors(name + "b", readonly=True)
        at = b["x"].ptr
        w.put_tensors(name + "b", {"x": x + 1}, next_version=True).close()
        assert b.segment.refresh() is True and b["x"].ptr == at     # its header read through a mapping of its own
        assert np.frombuffer(b["x"].tobytes(), dtype=np.float32).tolist() == (x + 1).tolist()
        assert live() == dict(one, reserved=2, mapped=2), live()
        w.put_tensors(name + "b", {"x": (x + 2).reshape(2, 3)}, next_version=True).close()
        try:
            b.segment.refresh()
            raise AssertionError("refreshed onto another layout")
        except gpushm.InvalidError:
            pass
        assert live() == dict(one, reserved=2, mapped=2), live()
        del b
        seg.release()
        del seg
        gc.collect()
        assert live() == zero, live()
        assert [(s.name, s.opens) for s in w.list() if s.name.startswith(name) and s.opens] == []
        print("ok")
    """)
    assert out.strip() == "ok"
