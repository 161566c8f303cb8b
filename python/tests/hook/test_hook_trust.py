"""The safetensors hook's trust, played by an attacker (issue: a model load
poisoned through the hook). A file is served from a bundle only where the
daemon itself filled the bundle from that file, as it is now, in a bundle of
root's or the caller's that nobody else may write; the tensors are laid out
by the file's own header. Another user (nobody, uid 65534, as host files of
unmapped owners show in a user namespace) forges bundles every other way."""

import json
import os
import shutil
import stat
import struct
import sys
import tempfile

import numpy as np
import pytest

from gpushm import safetensors as gst
from conftest import child
from helpers.stfiles import bundle_meta, put_dir, put_file, record, write

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")


@pytest.fixture(autouse=True)
def _socket(daemon, monkeypatch):
    monkeypatch.setenv("GPUSHM_SOCKET", daemon.socket)
    monkeypatch.delenv("GPUSHM_CPU_TENSORS", raising=False)
    monkeypatch.delenv("GPUSHM_SAFETENSORS", raising=False)
    gst._holdings.clear()


@pytest.fixture
def shared_dir():
    """A directory every user may read, with a copy of the package nobody
    may import (the test tree may be private to root)."""
    d = tempfile.mkdtemp(prefix="gpushm-trust-")
    os.chmod(d, 0o755)
    pkg = os.path.join(d, "pkg")
    shutil.copytree(os.path.dirname(gst.__file__), os.path.join(pkg, "gpushm"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    for root, dirs, files in os.walk(pkg):
        os.chmod(root, 0o755)
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)
    yield d
    shutil.rmtree(d)


def _as_nobody(daemon, shared_dir, code, *args):
    if not all(os.stat(p).st_mode & stat.S_IXOTH for p in ("/", os.path.dirname(sys.executable))):
        pytest.skip(f"user nobody cannot run {sys.executable}")
    return child(daemon.socket, code, *args, user=NOBODY, group=NOBODY, cwd="/",
                 env={"PYTHONPATH": os.path.join(shared_dir, "pkg")})


def _model(shared_dir, owner=0, value=1.0):
    path = os.path.join(shared_dir, "model.safetensors")
    write(path, {"w": np.full(4, value, np.float32), "b": np.full(2, value, np.float32)})
    os.chmod(path, 0o644)
    os.chown(path, owner, owner)
    return path


def _served(path):
    """The tensors the hook's entry gives for path, or None when it reads
    the file itself."""
    f = gst._hook_open(path, "numpy", "cpu")
    return None if f is None else {k: np.array(f.get_tensor(k)) for k in f.keys()}


# What nobody's client writes: a bundle of its own bytes whose meta claims
# the file, with every field of the file's identity copied from stat.
_FORGE = """
    import json, struct, sys, gpushm
    name, path, ident = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                         "b": {"dtype": "F32", "shape": [2], "data_offsets": [16, 24]}}).encode()
    header += b" " * (-(8 + len(header)) % 8)
    data = struct.pack("<Q", len(header)) + header + struct.pack("<6f", *[666.0] * 6)
    meta = {"kind": "bundle", "format": "safetensors", "header_bytes": len(header), "tensors": 2,
            "origin": {"dir": ident.pop("dir"), "files": [ident]}}
    c = gpushm.connect()
    seg = c._create(name, len(data), meta, None, 0o644, False, uncommitted=True)
    seg.write(data, 0)
    seg.commit()
    print(seg.id)
"""


def test_a_forged_origin_is_not_served(client, daemon, name, shared_dir):
    # The file's owner shows as nobody (a host file in a user namespace, or
    # nobody's own): the old rule trusted bundles of the file's owner.
    path = _model(shared_dir, owner=NOBODY)
    ident = dict(record(path), dir=os.path.realpath(shared_dir))
    _as_nobody(daemon, shared_dir, _FORGE, name + "-forged", path, json.dumps(ident))
    assert client.stat(name + "-forged").uid == NOBODY
    assert gst.held(path) is None, "a bundle nobody wrote itself is served for the file"
    assert _served(path) is None

    # Root's bundle of the same file, filled by the daemon, is served, the
    # forged one beside it (newer or not) changes nothing.
    put_file(client, name, path, mode=0o644)
    h = gst.held(path)
    assert h is not None and h.name == name
    got = _served(path)
    assert got is not None and all((got[k] == 1.0).all() for k in ("w", "b")), got


# nobody puts the file it owns as 'gpushm put' would (the daemon fills
# it), then writes other bytes through its own read-write mapping.
_FILL_THEN_WRITE = """
    import struct, sys, gpushm
    name, path = sys.argv[1], sys.argv[2]
    c = gpushm.connect()
    size = __import__("os").path.getsize(path)
    seg = c._create(name, size, {"kind": "bundle", "format": "safetensors", "header_bytes": 0, "tensors": 0},
                    None, 0o644, False, uncommitted=True)
    with open(path, "rb") as f:
        seg.fill(f)
    seg.commit()
    print(len(c.stat(name).sources))
    rw = c.open(name)
    rw.write(struct.pack("<6f", *[666.0] * 6), size - 24)
"""


def test_the_daemon_s_record_of_another_user_is_not_trusted(client, daemon, name, shared_dir):
    path = _model(shared_dir, owner=NOBODY)
    out = _as_nobody(daemon, shared_dir, _FILL_THEN_WRITE, name, path)
    assert out.split() == ["1"], out  # the daemon recorded nobody's fill
    assert client.stat(name).uid == NOBODY
    assert gst.held(path) is None, "nobody's bundle is served to root"
    assert _served(path) is None


def test_a_bundle_others_may_write_is_not_served(client, daemon, name, shared_dir):
    path = _model(shared_dir)
    put_file(client, name, path, mode=0o644)
    assert gst.held(path) is not None
    # Writable by others: whatever they write would be served.
    client._call("chmod", name=name, mode=0o666)
    assert gst.held(path) is None
    client._call("chmod", name=name, mode=0o644)
    assert gst.held(path) is not None
    # Once another user had write access, the daemon forgets what it filled,
    # for good: that user may still hold a writable mapping.
    client._call("chmod", name=name, mode=0o666)
    _as_nobody(daemon, shared_dir, """
        import sys, gpushm
        gpushm.connect().open(sys.argv[1])
    """, name)
    client._call("chmod", name=name, mode=0o644)
    assert client.stat(name).sources == ()
    assert gst.held(path) is None


def test_the_bundle_s_own_header_is_not_taken(client, name, tmp_path):
    # A directory's bundle whose combined header swaps two tensors (its
    # writer's mistake, or worse): by name the bundle says what it says; by
    # the file's path, the file's own header places each tensor.
    a = tmp_path / "model-00001-of-00001.safetensors"
    write(a, {"x": np.full(4, 1.0, np.float32), "y": np.full(4, 2.0, np.float32)})
    seg = put_dir(client, name, [a], mode=0o644)
    (n,) = struct.unpack("<Q", seg.read(8))
    header = json.loads(seg.read(n, 8))
    header["x"]["data_offsets"], header["y"]["data_offsets"] = header["y"]["data_offsets"], header["x"]["data_offsets"]
    js = json.dumps(header).encode()
    assert len(js) <= n
    seg.close()
    # Written as its owner would, through a mapping: the daemon cannot see
    # it, and the owner is trusted not to. The bytes the hook serves still
    # come from where the daemon filled them.
    rw = client.open(name)
    rw.write(js + b" " * (n - len(js)), 8)
    rw.close()
    assert float(np.asarray(client.tensors(name, readonly=True)["x"])[0]) == 2.0
    got = _served(str(a))
    assert got is not None and (got["x"] == 1.0).all() and (got["y"] == 2.0).all(), got


def test_a_tensor_outside_what_the_daemon_filled_is_refused(client, name, tmp_path, capfd):
    # The data were filled only in part: the rest is the writer's word.
    path = tmp_path / "m.safetensors"
    write(path, {"x": np.full(4, 1.0, np.float32), "y": np.full(4, 2.0, np.float32)})
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    meta = bundle_meta(n, 2)
    seg = client._create(name, size, meta, None, 0o600, False, uncommitted=True)
    seg.write(open(path, "rb").read(), 0)
    with open(path, "rb") as f:
        seg.fill(f, 0, 0, size - 16)  # all but y
    seg.commit()
    assert gst.held(str(path)) is not None
    assert _served(str(path)) is None
    assert "holds no range the daemon filled with tensor 'y'" in capfd.readouterr().err
