"""The Python client against a real daemon on the host backend: what CI runs
on machines without a GPU."""

import ctypes
import errno
import gc
import json
import os
import shutil
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

import gpushm
from gpushm import _dlpack
from conftest import Peer, child


def test_default_socket(monkeypatch):
    """Where the daemon listens when given no socket: the user's own."""
    monkeypatch.setenv("GPUSHM_SOCKET", "/x/y.sock")
    assert gpushm.default_socket() == "/x/y.sock"
    monkeypatch.delenv("GPUSHM_SOCKET")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert gpushm.default_socket() == "/run/gpushm/gpushm.sock"
    monkeypatch.setattr(os, "geteuid", lambda: 1234)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1234")
    assert gpushm.default_socket() == "/run/user/1234/gpushm/gpushm.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.delenv("TMPDIR", raising=False)
    assert gpushm.default_socket() == "/tmp/gpushm-1234/gpushm.sock"


def test_socket_candidates(monkeypatch):
    """Where a client looks: the user's own socket, then the node's; root's
    own is the node's, tried once; $GPUSHM_SOCKET alone when set."""
    monkeypatch.setenv("GPUSHM_SOCKET", "/x/y.sock")
    assert gpushm.socket_candidates() == ["/x/y.sock"]
    monkeypatch.delenv("GPUSHM_SOCKET")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1234")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert gpushm.socket_candidates() == ["/run/gpushm/gpushm.sock"]
    monkeypatch.setattr(os, "geteuid", lambda: 1234)
    assert gpushm.socket_candidates() == ["/run/user/1234/gpushm/gpushm.sock", "/run/gpushm/gpushm.sock"]
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    monkeypatch.setenv("TMPDIR", "/scratch")
    assert gpushm.socket_candidates() == ["/scratch/gpushm-1234/gpushm.sock", "/run/gpushm/gpushm.sock"]


def test_client_finds_the_nodes_daemon(monkeypatch, tmp_path, daemon):
    """A user with no daemon of its own reaches the node's; when none
    answers, the error names every path tried and the variable."""
    from gpushm import _core
    monkeypatch.delenv("GPUSHM_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "xdg"))
    monkeypatch.setattr(os, "geteuid", lambda: 1234)
    own = str(tmp_path / "xdg" / "gpushm" / "gpushm.sock")
    hint = " (is 'gpushm daemon' running? set $GPUSHM_SOCKET to choose a socket)"

    system = str(tmp_path / "run" / "gpushm.sock")
    monkeypatch.setattr(_core, "SYSTEM_SOCKET", system)
    with pytest.raises(FileNotFoundError) as e:
        gpushm.connect()
    assert str(e.value) == f"[Errno 2] gpushm: cannot reach a daemon: {own}: no such file; {system}: no such file{hint}"
    # A socket nobody serves any more: refused, and named as such.
    os.mkdir(tmp_path / "run")
    import socket
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(system)
    s.close()
    with pytest.raises(ConnectionRefusedError) as e:
        gpushm.connect()
    assert str(e.value) == f"[Errno 111] gpushm: cannot reach a daemon: {own}: no such file; {system}: connection refused{hint}"

    monkeypatch.setenv("GPUSHM_SOCKET", str(tmp_path / "nowhere.sock"))
    with pytest.raises(FileNotFoundError) as e:
        gpushm.connect()
    assert str(e.value) == (f"[Errno 2] gpushm: cannot reach a daemon: {tmp_path}/nowhere.sock: no such file "
                            "(is 'gpushm daemon' running? the path is $GPUSHM_SOCKET)")
    monkeypatch.delenv("GPUSHM_SOCKET")

    monkeypatch.setattr(_core, "SYSTEM_SOCKET", daemon.socket)
    with gpushm.connect() as c:
        assert c.socket == daemon.socket
        assert c.info()["backend"] == "host"


def test_unreachable_daemon_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"cannot reach daemon at .*is 'gpushm daemon' running\?"):
        gpushm.connect(str(tmp_path / "nothing.sock"))


def test_numpy_array_shared_both_ways_between_processes(client, daemon, name):
    seg = client.create(name, shape=(4, 5), dtype="float64")
    a = seg.numpy()
    a[:] = np.arange(20).reshape(4, 5)
    peer = Peer(daemon.socket, """
        import sys, numpy as np, gpushm
        c = gpushm.connect()
        a = c.open(sys.argv[1]).numpy()           # typed by the segment's meta
        assert a.dtype == np.float64 and a.shape == (4, 5), (a.dtype, a.shape)
        assert (a == np.arange(20).reshape(4, 5)).all(), a
        a *= 2                                    # write back
        print("written")
        assert input() == "check"
        assert (a == -1).all(), a                 # sees the parent's write
        print("ok")
    """, name)
    peer.expect("written")
    assert (a == 2 * np.arange(20).reshape(4, 5)).all()
    a[:] = -1
    peer.send("check")
    peer.expect("ok")
    peer.close()


def test_open_gives_back_the_typed_tensor(client, daemon, name):
    src = np.arange(24, dtype=np.int16).reshape(2, 3, 4)
    seg = client.share(name, src)
    assert (seg.dtype, seg.shape, seg.strides, seg.offset) == ("int16", (2, 3, 4), None, 0)
    assert seg.meta == {"kind": "tensor", "dtype": "int16", "shape": [2, 3, 4], "strides": None, "offset": 0}
    out = child(daemon.socket, """
        import sys, numpy as np, gpushm
        s = gpushm.connect().open(sys.argv[1])
        print(s.dtype, s.shape, np.asarray(s).sum(), np.from_dlpack(s)[1, 2, 3])
    """, name)
    assert out.split(None, 1)[0] == "int16"
    assert out.strip().endswith(f"{src.sum()} 23")


@pytest.mark.parametrize("make", [
    lambda: np.arange(12, dtype=np.float32).reshape(3, 4).T,     # transposed: strides kept
    lambda: np.arange(10, dtype=np.int64)[::-1],                 # negative stride: offset kept
    lambda: np.arange(6, dtype=np.uint8).reshape(2, 3)[:, ::-1],
    lambda: np.zeros((0, 3), dtype=np.float32),                  # empty
    lambda: np.array(7.5, dtype=np.float64),                     # 0-d
    lambda: np.array([True, False, True]),
    lambda: np.arange(4, dtype=np.complex64),
])
def test_share_keeps_dense_layouts(client, daemon, name, make):
    src = make()
    seg = client.share(name, src)
    got = np.asarray(client.open(name))
    assert got.dtype == src.dtype and got.shape == src.shape
    assert got.strides == src.strides or src.size == 0
    np.testing.assert_array_equal(got, src)
    out = child(daemon.socket, """
        import sys, numpy as np, gpushm
        print(np.asarray(gpushm.connect().open(sys.argv[1])).tolist())
    """, name)
    assert out.strip() == str(src.tolist())
    del seg


def test_share_refuses_gaps(client, name):
    with pytest.raises(ValueError, match="gaps in memory.*contiguous"):
        client.share(name, np.arange(10)[::2])
    with pytest.raises(FileNotFoundError):
        client.stat(name)


def test_readonly_open(client, name):
    client.create(name, shape=(8,), dtype="uint8")
    ro = client.open(name, readonly=True)
    assert ro.readonly and not ro.numpy().flags.writeable
    assert ro.memoryview().readonly
    with pytest.raises(PermissionError, match="read-only"):
        ro.write(b"x")
    cap = ro.__dlpack__(max_version=(1, 0))
    assert _read_capsule(cap)["flags"] & _dlpack.FLAG_READ_ONLY


def test_read_write_and_memoryview(client, name):
    seg = client.create(name, 100)
    assert (seg.dtype, seg.shape, seg.meta) == ("uint8", (100,), None)
    assert seg.write(b"hello", 10) == 5
    assert seg.read(5, 10) == b"hello"
    mv = seg.memoryview()
    assert mv.format == "B" and len(mv) == 100 and bytes(mv[10:15]) == b"hello"
    mv[0:2] = b"hi"
    assert seg.read(2) == b"hi"
    seg.write(bytearray(b"ba"), 98)
    seg.write(np.array([1, 2], dtype=np.uint8), 0)
    assert seg.read(2, 98) == b"ba" and seg.read(2) == b"\x01\x02"
    with pytest.raises(ValueError, match="outside the segment"):
        seg.write(b"xx", 99)
    v = seg.view("int32", (2,), offset=4)
    v.numpy()[:] = [7, 8]
    assert struct.unpack_from("<ii", seg.read(8, 4)) == (7, 8)


def test_close_keeps_arrays_valid_and_then_frees(client, name):
    seg = client.create(name, shape=(1000,), dtype="float32")
    seg.numpy()[:] = 3
    a = seg.numpy()
    t = np.from_dlpack(seg)
    seg.close()
    with pytest.raises(ValueError, match="is closed"):
        seg.numpy()
    gc.collect()
    assert client.stat(name).opens == 1      # the arrays hold the lease
    assert a.sum() == 3000 and t.sum() == 3000
    del a, t
    assert client.stat(name).opens == 0
    with client.open(name) as s:            # context manager
        assert s.numpy().sum() == 3000
    assert client.stat(name).opens == 0


def test_segment_lent_as_owner_stays_mapped(client, name):
    seg = client.create(name, shape=(4,), dtype="int32")
    arr = np.asarray(seg)                    # arr's base is seg itself
    seg.close()
    arr[:] = 5                               # still mapped
    del arr, seg
    assert client.stat(name).opens == 0


def _read_capsule(cap):
    api = ctypes.pythonapi
    api.PyCapsule_GetName.restype = ctypes.c_char_p
    api.PyCapsule_GetName.argtypes = [ctypes.py_object]
    name = api.PyCapsule_GetName(cap)
    addr = api.PyCapsule_GetPointer(cap, name)
    if name == b"dltensor_versioned":
        mt = _dlpack.DLManagedTensorVersioned.from_address(addr)
        v = (mt.version.major, mt.version.minor)
        flags = mt.flags
    else:
        mt = _dlpack.DLManagedTensor.from_address(addr)
        v, flags = None, 0
    t = mt.dl_tensor
    shape = tuple((ctypes.c_int64 * t.ndim).from_address(t.shape)) if t.ndim else ()
    return {"name": name, "version": v, "flags": flags, "data": t.data, "shape": shape,
            "device": (t.device.device_type, t.device.device_id), "dtype": (t.dtype.code, t.dtype.bits, t.dtype.lanes)}


def test_dlpack_capsules(client, name):
    seg = client.create(name, shape=(2, 3), dtype="float32")
    seg.numpy()[:] = 1
    legacy = _read_capsule(seg.__dlpack__())
    assert legacy["name"] == b"dltensor" and legacy["shape"] == (2, 3) and legacy["dtype"] == (2, 32, 1)
    assert legacy["device"] == (_dlpack.kDLCPU, 0) and legacy["data"] == seg.ptr
    v = _read_capsule(seg.__dlpack__(max_version=(1, 2), stream=None))
    assert v["name"] == b"dltensor_versioned" and v["version"] == (1, 0) and v["flags"] == 0
    # An unconsumed capsule frees its tensor when it goes.
    cap = seg.__dlpack__()
    seg.close()
    assert client.stat(name).opens == 1
    del cap
    assert client.stat(name).opens == 0

    seg = client.open(name)
    c = _read_capsule(seg.__dlpack__(copy=True, max_version=(1, 0)))
    assert c["flags"] & _dlpack.FLAG_IS_COPIED and c["data"] != seg.ptr
    copied = np.from_dlpack(_Capsule(seg.__dlpack__(copy=True)))
    seg.numpy()[:] = 9
    assert copied.sum() == 6                 # a private copy
    assert _read_capsule(seg.__dlpack__(dl_device=(1, 0)))["data"] == seg.ptr
    with pytest.raises(BufferError, match="copy=False"):
        seg.__dlpack__(dl_device=(2, 0), copy=False)


class _Capsule:
    """Hands a ready capsule to a from_dlpack that wants an object."""

    def __init__(self, cap):
        self.cap = cap

    def __dlpack__(self, **kw):
        return self.cap

    def __dlpack_device__(self):
        return (1, 0)


def test_errors_are_builtin_exceptions(client, name):
    def check(exc, code, fn, *a, **kw):
        with pytest.raises(exc) as ei:
            fn(*a, **kw)
        e = ei.value
        assert isinstance(e, gpushm.Error) and isinstance(e, OSError)
        assert e.code == code and e.errno == getattr(errno, code)
        assert str(e).startswith(f"[Errno {e.errno}] gpushm: "), str(e)
        return e

    e = check(FileNotFoundError, "ENOENT", client.open, name)
    assert f'no such segment: "{name}"' in str(e)
    check(FileNotFoundError, "ENOENT", client.stat, name)
    check(FileNotFoundError, "ENOENT", client.unlink, name)
    client.create(name, 10)
    check(FileExistsError, "EEXIST", client.create, name, 10)
    check(FileExistsError, "EEXIST", client.create, name, 11, exist_ok=True)
    check(ValueError, "EINVAL", client.create, "a/b", 10)
    check(ValueError, "EINVAL", client.create, name + "z", 0)
    check(ValueError, "ENAMETOOLONG", client.create, "n" * 256, 10)
    check(ValueError, "ENODEV", client.create, name + "d", 10, device=7)


@pytest.mark.parametrize("code,builtin", [
    ("ENOENT", FileNotFoundError), ("EEXIST", FileExistsError), ("EACCES", PermissionError),
    ("EPERM", PermissionError), ("ENOMEM", MemoryError), ("EINVAL", ValueError),
    ("ENAMETOOLONG", ValueError), ("ENODEV", ValueError), ("ENOSPC", OSError), ("EBUSY", OSError),
    ("EPROTO", OSError), ("EIO", OSError), ("EWHATEVER", OSError),
])
def test_error_mapping(code, builtin):
    from gpushm._errors import error
    e = error(code, "what the daemon said")
    assert isinstance(e, builtin) and isinstance(e, gpushm.Error) and isinstance(e, OSError)
    assert e.errno == getattr(errno, code, errno.EIO) and e.code == code
    assert "what the daemon said" in str(e)


def _others_can_run(path):
    """Whether a user other than the owner can execute path: every directory
    on the way searchable, the file executable, by others."""
    path = os.path.realpath(path)
    parts = path.split("/")
    dirs = ["/".join(parts[:i]) or "/" for i in range(1, len(parts))]
    return all(os.stat(d).st_mode & 0o001 for d in dirs) and os.stat(path).st_mode & 0o001


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as another user")
def test_permission_errors_for_another_user(client, daemon, name):
    if not _others_can_run(sys.executable):
        pytest.skip(f"user nobody cannot run {sys.executable}")
    # A copy of the package where nobody can read it.
    pkg = os.path.join(daemon.dir, "pkg")
    if not os.path.isdir(pkg):
        shutil.copytree(os.path.dirname(gpushm.__file__), os.path.join(pkg, "gpushm"),
                        ignore=shutil.ignore_patterns("__pycache__"))
    client.create(name, shape=(4,), dtype="uint8", mode=0o604)   # others may read
    client.create(name + "p", 16)                                   # 0600
    out = child(daemon.socket, """
        import sys, gpushm
        c = gpushm.connect()
        for what, fn in [("rw", lambda: c.open(sys.argv[1])), ("private", lambda: c.open(sys.argv[1] + "p")),
                         ("unlink", lambda: c.unlink(sys.argv[1]))]:
            try:
                fn()
                print(what, "allowed")
            except PermissionError as e:
                print(what, e.code)
        print("ro", c.open(sys.argv[1], readonly=True).read(4))
    """, name, user=65534, group=65534, cwd="/", env={"PYTHONPATH": pkg})
    assert out.split("\n")[:4] == ["rw EACCES", "private EACCES", "unlink EPERM", "ro b'\\x00\\x00\\x00\\x00'"]


def _counts():
    """Descriptors, mappings of memfds (segments, epoch pages) and all
    mappings of this process."""
    with open("/proc/self/maps") as f:
        lines = f.readlines()
    return len(os.listdir("/proc/self/fd")), sum("/memfd:" in l for l in lines), len(lines)


def test_10000_open_drop_cycles_leak_nothing(client, name):
    seg = client.create(name, shape=(16,), dtype="int64")
    seg.close()
    gc.collect()
    fds, memfds, maps = _counts()
    opens = client.info()["usage"]["opens"]
    seen = 0
    for i in range(10000):
        s = client.open(name)
        if i % 2:
            a = s.numpy()                                # array interface
            a[0] += 1
        else:
            a = np.from_dlpack(s)                        # DLPack (numpy makes it read-only)
            seen += int(a[0])
        del s, a                                         # unmapped here: the next open maps anew
    gc.collect()
    assert _counts() == (fds, memfds, maps)
    assert client.info()["usage"]["opens"] == opens
    assert client.open(name).numpy()[0] == 5000 and seen == sum(range(5000))


def test_reopen_is_served_from_the_mapping_until_the_epoch_moves(client, name):
    a = client.create(name, shape=(4,), dtype="int32")
    a.numpy()[:] = 1
    b = client.open(name)
    assert b.ptr == a.ptr and client.stat(name).opens == 1   # no second lease
    client.create(name + "x", 1)
    client.unlink(name + "x")                                 # epoch moves
    c = client.open(name)
    assert c.ptr == a.ptr                                     # same segment id: same mapping
    client.unlink(name)
    new = client.create(name, shape=(4,), dtype="int32")
    new.numpy()[:] = 2
    d = client.open(name)
    assert d.id == new.id != a.id and d.numpy().tolist() == [2, 2, 2, 2]
    assert a.numpy().tolist() == [1, 1, 1, 1]                 # the old one lives on while held
    before = client.info()["usage"]["segments"]
    del a, b, c
    assert client.info()["usage"]["segments"] == before - 1   # its memory is freed


def test_list_stat_unlink(client, name):
    names = [f"{name}-{i:03d}" for i in range(300)]            # more than one page (256)
    for i, n in enumerate(names):
        client.create(n, i + 1, mode=0o640).close()
    listed = [s for s in client.list() if s.name.startswith(name)]
    assert [s.name for s in listed] == names
    assert all(s.meta is None for s in listed)
    st = client.stat(names[9])
    assert (st.size, st.alloc_size, st.mode, st.device, st.handle_type, st.opens) == (10, 4096, 0o640, 0, "memfd", 0)
    assert st.uid == os.geteuid() and st.created <= time.time_ns()
    for n in names:
        client.unlink(n)
    assert not [s for s in client.list() if s.name.startswith(name)]
    inf = client.info()
    assert inf["backend"] == "host" and inf["devices"][0]["index"] == 0 and inf["server"]


def test_unlink_while_open(client, name):
    seg = client.create(name, shape=(3,), dtype="float32")
    seg.numpy()[:] = 4
    client.unlink(name)
    with pytest.raises(FileNotFoundError):
        client.open(name)
    assert seg.numpy().sum() == 12                            # still mapped
    held = client.info()["usage"]["segments"]
    del seg
    assert client.info()["usage"]["segments"] == held - 1


_RACER = """
    import sys, gpushm
    c = gpushm.connect()
    name, exist_ok = sys.argv[1], sys.argv[2] == "1"
    sys.stdin.readline()                     # start together
    try:
        s = c.create(name, shape=(1024,), dtype="float32", exist_ok=exist_ok)
        print("created" if s.created else "opened", s.id, flush=True)
    except FileExistsError as e:
        print("exists", e.code, flush=True)
    sys.stdin.readline()                     # hold the lease until told
"""


@pytest.mark.parametrize("exist_ok", [True, False])
def test_exist_ok_races_between_processes(client, daemon, name, exist_ok):
    peers = [subprocess.Popen([sys.executable, "-c", __import__("textwrap").dedent(_RACER), name, str(int(exist_ok))],
                              env=__import__("conftest").env_for(daemon.socket), stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(8)]
    time.sleep(0.5)  # let every interpreter start and connect
    for p in peers:
        p.stdin.write("\n")
        p.stdin.flush()
    results = [p.stdout.readline().split() for p in peers]
    for p in peers:
        p.stdin.write("\n")
        p.stdin.close()
        assert p.wait(30) == 0
    kinds = sorted(r[0] for r in results)
    if exist_ok:
        assert kinds == ["created"] + ["opened"] * 7
        assert len({r[1] for r in results}) == 1
    else:
        assert kinds == ["created"] + ["exists"] * 7
        assert {r[1] for r in results if r[0] == "exists"} == {"EEXIST"}
    assert client.stat(name).opens == 0


def test_exist_ok_checks_the_tensor(client, name):
    client.create(name, shape=(4,), dtype="float32")
    assert not client.create(name, shape=(4,), dtype="float32", exist_ok=True).created
    with pytest.raises(FileExistsError, match="exists with meta"):
        client.create(name, shape=(2, 2), dtype="float32", exist_ok=True)
    gc.collect()
    assert client.stat(name).opens == 0


BUNDLE = {
    "embed": np.arange(64 * 4, dtype=np.float32).reshape(64, 4),
    "scale": np.float16(1.5) * np.ones(3, dtype=np.float16),
    "ids": np.arange(5, dtype=np.int64),
    "mask": np.array([True, False, True]),
    "u8": np.arange(7, dtype=np.uint8),
    "i16": np.arange(9, dtype=np.int16),
    "u16": np.arange(2, dtype=np.uint16),
    "i32": np.arange(3, dtype=np.int32),
    "u32": np.arange(3, dtype=np.uint32),
    "u64": np.arange(3, dtype=np.uint64),
    "f64": np.linspace(0, 1, 5),
    "c64": np.arange(2, dtype=np.complex64),
    "i8": np.arange(-3, 3, dtype=np.int8),
    "scalar": np.array(2.0, dtype=np.float32),
    "empty": np.zeros((0, 5), dtype=np.float32),
}


def _check_safetensors(raw: bytes):
    """What the safetensors library demands of a file, checked by hand."""
    (n,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8:8 + n])
    assert raw[8:9] == b"{" and (8 + n) % 64 == 0
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    end = 0
    for b, e in spans:
        assert b == end, f"gap or overlap at {b}"
        end = e
    assert 8 + n + end == len(raw)
    return header


def test_bundle_roundtrip(client, daemon, name):
    seg = client.put_tensors(name, BUNDLE, metadata={"model": "test"})
    raw = seg.read()
    header = _check_safetensors(raw)
    assert seg.meta == {"kind": "bundle", "format": "safetensors", "header_bytes": len(raw) - 8 - sum(a.nbytes for a in BUNDLE.values()),
                        "tensors": len(BUNDLE)}
    assert header["__metadata__"] == {"model": "test"} and header["embed"]["dtype"] == "F32"
    b = client.tensors(name)
    assert list(b) == list(BUNDLE) and b.metadata == {"model": "test"}
    for k, v in b.items():
        got = np.asarray(v)
        assert got.dtype == BUNDLE[k].dtype and got.shape == BUNDLE[k].shape, k
        np.testing.assert_array_equal(got, BUNDLE[k])
        assert v.ptr % BUNDLE[k].dtype.itemsize == 0, k
        if BUNDLE[k].nbytes % 64 == 0:
            assert v.offset % 64 == 0, k
    out = child(daemon.socket, """
        import sys, numpy as np, gpushm
        b = gpushm.connect().tensors(sys.argv[1], readonly=True)
        print(np.asarray(b["embed"]).sum(), np.asarray(b["ids"]).tolist(), b.metadata["model"])
    """, name)
    assert out.split() == [str(BUNDLE["embed"].sum()), "[0,", "1,", "2,", "3,", "4]", "test"]


def test_bundle_is_a_safetensors_file_for_the_cli(client, daemon, name, tmp_path):
    client.put_tensors(name, BUNDLE)
    path = tmp_path / "m.safetensors"
    env = dict(os.environ, GPUSHM_SOCKET=daemon.socket)
    subprocess.run([os.environ["GPUSHM_BIN"], "get", name, str(path)], env=env, check=True)
    _check_safetensors(path.read_bytes())
    subprocess.run([os.environ["GPUSHM_BIN"], "put", name + "2", str(path)], env=env, check=True)
    # put also records where the file came from (its origin), for gpushm.run.
    meta = dict(client.stat(name + "2").meta)
    origin = meta.pop("origin")
    assert meta == client.stat(name).meta
    assert origin["dir"] == os.path.realpath(tmp_path) and origin["files"][0]["name"] == "m.safetensors"
    for k, v in client.tensors(name + "2").items():
        np.testing.assert_array_equal(np.asarray(v), BUNDLE[k])
    try:
        import safetensors.numpy
    except ImportError:
        return
    loaded = safetensors.numpy.load_file(str(path))
    for k, v in BUNDLE.items():
        np.testing.assert_array_equal(loaded[k], v)


def test_bundle_errors(client, name):
    with pytest.raises(ValueError, match="not C-contiguous"):
        client.put_tensors(name, {"a": np.arange(6).reshape(2, 3).T})
    with pytest.raises(TypeError, match="str to str"):
        client.put_tensors(name, {"a": np.arange(3)}, metadata={"n": 1})
    with pytest.raises(TypeError, match="safetensors has no complex128"):
        client.put_tensors(name, {"a": np.arange(3, dtype=np.complex128)})
    with pytest.raises(FileNotFoundError):
        client.stat(name)                           # nothing left behind
    client.create(name, 100)
    with pytest.raises(ValueError, match="not a tensor bundle"):
        client.tensors(name)


def test_dtype_names():
    from gpushm._tensors import dtype_of
    assert dtype_of(np.float32).name == "float32"
    assert dtype_of(np.dtype("<f8")).name == "float64"
    assert dtype_of("half").name == "float16"
    assert dtype_of(np.bool_).name == "bool"
    with pytest.raises(TypeError, match="not supported"):
        dtype_of("float128x")


def test_client_is_unusable_in_a_forked_child(client, name, monkeypatch):
    # Forking here could copy a CUDA context (the GPU tests run in this
    # process too), so pretend: what the client checks is the pid.
    client.create(name, 1)
    monkeypatch.setattr(client, "_pid", os.getpid() + 1)
    with pytest.raises(RuntimeError, match="connect again in this process"):
        client.stat(name)
    monkeypatch.undo()
    assert client.stat(name).size == 1


def test_torch_cpu(client, daemon, name):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    seg = client.create(name, shape=(3, 4), dtype="float32")
    t = torch.from_dlpack(seg)
    t.fill_(2)
    assert seg.numpy().sum() == 24
    shared = client.share(name + "b", torch.arange(6, dtype=torch.int32).reshape(2, 3).t())
    r = torch.from_dlpack(client.open(name + "b"))
    assert not r.is_contiguous() and r.tolist() == [[0, 3], [1, 4], [2, 5]]
    del shared
    seg.close()
    client.close()
    t += 1                                          # the tensor keeps the mapping
    assert float(t.sum()) == 36


def test_bad_tensor_meta_still_opens_as_bytes(client, name):
    bad = {"kind": "tensor", "dtype": "float32", "shape": [1000], "strides": None, "offset": 0}
    client._create(name, 16, bad, None, 0o600, False)     # as any client may
    seg = client.open(name)
    assert seg.read(4) == b"\0\0\0\0" and seg.shape == (16,)
    with pytest.raises(ValueError, match="reaches outside its 16 bytes"):
        np.from_dlpack(seg)
    with pytest.raises(ValueError, match="reaches outside its 16 bytes"):
        np.asarray(seg)


def test_spinning_client(daemon, name):
    with gpushm.connect(daemon.socket, spin_us=100) as c:
        c.create(name, shape=(3,), dtype="int8")
        assert c.open(name).numpy().tolist() == [0, 0, 0]
        assert c.stat(name).opens == 0


def wait_gone(c, name, within=5.0):
    deadline = time.time() + within
    while True:
        try:
            c.stat(name)
        except FileNotFoundError:
            return
        if time.time() > deadline:
            pytest.fail(f"{name} still exists {within}s later")
        time.sleep(0.02)


def test_share_is_temporary_by_default(client, daemon, name):
    # A producer process shares and is killed: its temporary segment goes
    # with its connection; one kept with temporary=False stays.
    peer = Peer(daemon.socket, """
        import sys, numpy as np, gpushm
        c = gpushm.connect()
        c.share(sys.argv[1], np.arange(6, dtype=np.int32))
        c.share(sys.argv[1] + "-kept", np.arange(6, dtype=np.int32), temporary=False)
        print("shared")
        input()
    """, name)
    peer.expect("shared")
    assert client.stat(name).meta["dtype"] == "int32"
    peer.p.kill()
    peer.p.wait()
    wait_gone(client, name)
    with client.open(name + "-kept") as seg:
        assert (seg.numpy() == np.arange(6)).all()
    client.unlink(name + "-kept")


def test_ttl(client, name):
    seg = client.create(name, 4096, ttl=0.5)
    time.sleep(1.0)
    assert client.stat(name).name == name, "an open segment expired"
    seg.close()
    gc.collect()
    wait_gone(client, name)
    with pytest.raises(ValueError):
        client.create(name, 4096, ttl=0)


def test_open_with_devices_is_cached_apart(client, name):
    # On host memory devices= changes nothing but the cache key: a plain
    # open and one naming devices are separate mappings of the same bytes.
    seg = client.create(name, shape=(4,), dtype="uint8")
    seg.numpy()[:] = 7
    a = client.open(name)
    b = client.open(name, devices=[0])
    assert (b.numpy() == 7).all()
    assert client.open(name, devices=[0]).ptr == b.ptr
    for s in (a, b, seg):
        s.close()
