"""The safetensors hook's trust, attacked the ways test_hook_trust.py does
not: another user who may write a bundle (its group), who owns the file a
bundle was filled from, who can crash the serving process or flood the
journal, who writes through the FUSE view, or who lies in hello. Each test
plays the attacker as user nobody (uid and gid 65534) against a real
daemon; the victim is root, whose bundles the hook trusts."""

import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import textwrap
import time

import numpy as np
import pytest

import gpushm
from gpushm import safetensors as gst
from gpushm._info import SegmentInfo
from conftest import Daemon, child, env_for
from helpers.stfiles import bundle_meta, put_file, write
from test_hook_trust import NOBODY, _as_nobody, _model, _served, shared_dir  # noqa: F401 (a fixture)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")

EVIL = 666.0


@pytest.fixture(autouse=True)
def _socket(daemon, monkeypatch):
    monkeypatch.setenv("GPUSHM_SOCKET", daemon.socket)
    monkeypatch.delenv("GPUSHM_CPU_TENSORS", raising=False)
    monkeypatch.delenv("GPUSHM_SAFETENSORS", raising=False)
    gst._holdings.clear()


def _nobody_proc(daemon, shared_dir, code, *args):
    """nobody running code, driven through its standard input and output."""
    return subprocess.Popen([sys.executable, "-u", "-c", textwrap.dedent(code), *map(str, args)],
                            env=dict(env_for(daemon.socket), PYTHONPATH=os.path.join(shared_dir, "pkg")),
                            user=NOBODY, group=NOBODY, cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _expect(p, want):
    line = p.stdout.readline().strip()
    if line != want:
        p.kill()
        pytest.fail(f"nobody said {line!r}, want {want!r}:\n{p.stderr.read()}")


def _fresh(path):
    gst._holdings.clear()
    return _served(path)


def _big_model(shared_dir, mib=64):
    path = os.path.join(shared_dir, "big.safetensors")
    write(path, {"w": np.ones((mib << 20) // 4, np.float32)})
    os.chmod(path, 0o644)
    evil = os.path.join(shared_dir, "evil")
    with open(evil, "wb") as f:
        f.write(struct.pack("<f", EVIL) * (os.path.getsize(path) // 4 + 1))
    os.chmod(evil, 0o644)
    return path, evil


# nobody, in the bundle's group, fills it from its own file through a
# read-only open (which gives no write access to anyone's memory), each
# time it is told to.
_GROUP_FILL = """
    import os, sys, gpushm
    c = gpushm.connect()
    seg = c.open(sys.argv[1], readonly=True)
    fd = os.open(sys.argv[2], os.O_RDONLY)
    n = int(sys.argv[3])
    print("ready")
    for line in sys.stdin:
        c._call("fill", fd, segment=seg.info.id, offset=0, at=0, size=n)
        print("filled")
"""


def test_a_fill_by_another_writer_is_never_trusted(client, daemon, name, shared_dir):
    # Root's bundle lets its group (nobody's) write, as one shared for a
    # while; root means to take that away (chmod 0640) before loading.
    path, evil = _big_model(shared_dir)
    size = os.path.getsize(path)
    (n,) = struct.unpack("<Q", open(path, "rb").read(8))
    child(daemon.socket, """
        import json, sys, gpushm
        seg = gpushm.connect()._create(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), None, 0o660, False)
    """, name, size, json.dumps(bundle_meta(n, 1)), group=NOBODY)
    assert (client.stat(name).uid, client.stat(name).gid) == (0, NOBODY)
    p = _nobody_proc(daemon, shared_dir, _GROUP_FILL, name, evil, size)
    _expect(p, "ready")
    seg = client.open(name)
    try:
        # The daemon writes both fills: it sees them, but the two copies
        # run side by side and their bytes interleave. Root's record of
        # its own fill once stood over nobody's bytes (served: up to all of
        # them, here).
        for _ in range(3):
            p.stdin.write("go\n")
            p.stdin.flush()
            with open(path, "rb") as f:
                seg.fill(f)
            _expect(p, "filled")
            client._call("chmod", name=name, mode=0o640)
            got = _fresh(path)
            client._call("chmod", name=name, mode=0o660)
            assert got is None or not (got["w"] == EVIL).any(), f"{int((got['w'] == EVIL).sum())} of nobody's elements served"
        # Once another user had the daemon write it, nothing is recorded
        # again, a later fill of root's alone included.
        with open(path, "rb") as f:
            seg.fill(f)
    finally:
        p.stdin.close()
        p.wait(30)
        seg.close()
    assert client.stat(name).sources == ()
    client._call("chmod", name=name, mode=0o640)
    assert gst.held(path) is None
    assert _fresh(path) is None


_WRITE_LOOP = """
    import json, os, select, sys
    fd = os.open(sys.argv[1], os.O_WRONLY)
    n = os.path.getsize(sys.argv[1])
    print("ready")
    i, log = 0, []
    while not select.select([sys.stdin], [], [], 0)[0]:
        i += 1
        off = (i * 4096 * 7919) % (n - 4096)
        os.pwrite(fd, bytes([i & 0xff]) * 4096, off)
        log.append((off, i & 0xff, os.fstat(fd).st_ctime_ns))
    print(json.dumps(log))
"""


def test_writes_to_the_file_during_a_fill_are_seen(client, daemon, name, shared_dir):
    # nobody owns the file root puts (a model nobody downloaded, say) and
    # writes it while the daemon copies: the bundle would hold a mix that
    # no state of the file ever was. Each write(2) moves the file's ctime
    # (finer than a clock tick once an fstat has read it), so a fill that
    # a write ran through is not recorded, and a fill recorded under ctime
    # C holds exactly the file with the writes made by C. nobody logs each
    # write with the ctime it left, from which the test makes that state.
    path, _ = _big_model(shared_dir, mib=16)
    os.chown(path, NOBODY, NOBODY)
    seg = client._create(name, os.path.getsize(path), None, None, 0o644, False)
    seen = 0
    for _ in range(4):
        state = bytearray(open(path, "rb").read())
        p = _nobody_proc(daemon, shared_dir, _WRITE_LOOP, path)
        _expect(p, "ready")
        try:
            with open(path, "rb") as f:
                seg.fill(f)
        finally:
            p.stdin.write("stop\n")
            p.stdin.close()
            log = json.loads(p.stdout.readline())
            p.wait(30)
        srcs = client.stat(name).sources
        if not srcs:
            seen += 1
            continue
        for off, v, ctime in log:
            if ctime <= srcs[0].ctime_ns:
                state[off:off + 4096] = bytes([v]) * 4096
        assert seg.tobytes() == bytes(state), "a fill recorded under the file's ctime holds another state of the file"
    print(f"{seen} of 4 fills seen written")
    with open(path, "rb") as f:
        seg.fill(f)
    assert len(client.stat(name).sources) == 1, "a fill of the file at rest was not recorded"
    seg.close()


def test_a_file_made_again_alike_is_not_served(client, name, shared_dir):
    # nobody's file, put by root, is replaced by another file of nobody's
    # with other bytes, the same size and mtime, and (on ext4, which
    # reuses a freed inode at once) the same inode: its ctime, which
    # nobody cannot set, tells them apart.
    mine = os.path.join(shared_dir, "nobody")
    os.mkdir(mine)
    os.chown(mine, NOBODY, NOBODY)
    path = _model(shared_dir, owner=NOBODY)
    path = os.rename(path, os.path.join(mine, "model.safetensors")) or os.path.join(mine, "model.safetensors")
    put_file(client, name, path, mode=0o644)
    assert _fresh(path) is not None
    old = os.stat(path)
    code = """
        import os, sys, shutil
        path, ino, mtime = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
        data = bytearray(open(path, "rb").read())
        data[-24:] = b"\\x00\\x80\\x26\\x44" * 6
        for i in range(200):
            os.unlink(path)
            with open(path, "wb") as f:
                f.write(data)
            if os.stat(path).st_ino == ino:
                break
        os.utime(path, ns=(mtime, mtime))
        print(os.stat(path).st_ino == ino)
    """
    same_ino = child(client.socket, code, path, old.st_ino, old.st_mtime_ns, user=NOBODY, group=NOBODY,
                     cwd="/").split() == ["True"]
    new = os.stat(path)
    assert (new.st_size, new.st_mtime_ns, new.st_dev) == (old.st_size, old.st_mtime_ns, old.st_dev)
    assert gst.held(path) is None
    assert _fresh(path) is None
    if not same_ino:
        pytest.skip("the file system gave the new file another inode: what was left to tell them apart "
                    "is checked, the case of the same inode is not")


def test_another_user_cannot_put_its_bundle_under_a_trusted_name(client, daemon, name, shared_dir):
    path = _model(shared_dir)
    put_file(client, name, path, mode=0o644)
    out = _as_nobody(daemon, shared_dir, """
        import os, sys, gpushm
        name, path = sys.argv[1], sys.argv[2]
        c = gpushm.connect()
        # A bundle of its own, filled by the daemon from root's file (which
        # nobody may read): the daemon records nobody's fill.
        seg = c.create(name + "-mine", nbytes=os.path.getsize(path), mode=0o644)
        with open(path, "rb") as f:
            seg.fill(f)
        seg.write(b"\\x00\\x80\\x26\\x44" * 6, seg.size - 24)
        for what, call in [
            ("rename over", lambda: c._call("rename", name=name + "-mine", to=name)),
            ("next version", lambda: c._create(name, 64, None, None, 0o644, False, next_version=True)),
            ("unlink", lambda: c.unlink(name)),
        ]:
            try:
                call()
                print(what, "allowed")
            except gpushm.Error as e:
                print(what, e.code)
    """, name, path)
    assert out.split("\n")[:3] == ["rename over EPERM", "next version EPERM", "unlink EPERM"], out
    got = _fresh(path)
    assert got is not None and all((got[k] == 1.0).all() for k in got), got
    assert gst.held(path).name == name


def test_a_next_version_serves_the_file_as_it_is_now(client, name, shared_dir):
    path = _model(shared_dir, value=1.0)
    put_file(client, name, path, mode=0o644)
    first = client.stat(name).id
    _model(shared_dir, value=2.0)  # the file changes: the first version no longer holds it
    assert _fresh(path) is None
    data = open(path, "rb").read()
    nv = client._create(name, len(data), client.stat(name).meta, None, None, False, next_version=True)
    with open(path, "rb") as f:
        nv.fill(f)
    nv.commit()
    assert client.stat(name).id != first
    h = gst.held(path)
    assert h is not None and h.id == client.stat(name).id
    got = _fresh(path)
    assert got is not None and all((got[k] == 2.0).all() for k in got), got


def test_memory_others_may_write_unseen_records_nothing(client, name, tmp_path):
    path = tmp_path / "m.safetensors"
    write(path, {"x": np.full(4, 1.0, np.float32)})
    size = os.path.getsize(path)
    # Published memory: its publisher keeps the memfd and writes it unseen.
    fd = os.memfd_create("published", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    try:
        client._call("publish", _send_fd=fd, name=name, size=4096, mode=0o644)
    finally:
        os.close(fd)
    seg = client.open(name)
    with open(path, "rb") as f:
        seg.fill(f, 0, 0, size)
    assert client.stat(name).sources == ()
    seg.close()
    # A channel: the daemon copies nothing into one.
    ch = client.channel(name + "-ch", nbytes=size, slots=1, framework=None, wait_for_consumer=False)
    with open(path, "rb") as f, pytest.raises(gpushm.Error) as e:
        client._call("fill", f.fileno(), segment=client.stat(name + "-ch").id, offset=0, at=0, size=size)
    assert e.value.code == "EINVAL", e.value


def test_a_fill_over_tensor_data_from_another_file_ends_the_serving(client, name, tmp_path):
    # Root fills its bundle from the file, then part of a tensor from a
    # memfd of its own (as put fills headers): the file's record goes,
    # and the file is read from disk again.
    path = tmp_path / "m.safetensors"
    write(path, {"x": np.full(4, 1.0, np.float32), "y": np.full(4, 2.0, np.float32)})
    seg = put_file(client, name, str(path), mode=0o644)
    assert _fresh(str(path)) is not None
    size = os.path.getsize(path)
    fd = os.memfd_create("pieces")
    os.write(fd, struct.pack("<f", EVIL) * 2)
    rw = client.open(name)
    rw.fill(fd, 0, size - 4, 4)  # the last element of y
    rw.close()
    seg.close()
    assert [src.ino for src in client.stat(name).sources] == [os.fstat(fd).st_ino]
    os.close(fd)
    assert gst.held(str(path)) is None
    assert _fresh(str(path)) is None


def test_hello_s_peer_is_the_kernel_s_word(daemon, shared_dir):
    # SO_PEERCRED says who connected; a client cannot claim another uid.
    out = _as_nobody(daemon, shared_dir, """
        import json, socket, sys
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.connect(sys.argv[1])
        s.send(json.dumps({"op": "hello", "version": 1, "id": 1, "peer": {"uid": 0, "gid": 0},
                           "uid": 0}).encode())
        rep = json.loads(s.recv(65536))
        print(json.dumps(rep.get("peer") or rep.get("error", {}).get("code")))
    """, daemon.socket)
    got = json.loads(out)
    assert got == "EPROTO" or got == {"uid": NOBODY, "gid": NOBODY}, got
    c = gpushm.connect(daemon.socket)
    assert c.peer_uid == 0
    c.close()


# nobody makes its own segment's journal record as large as it can: the
# largest meta, and as many sources as are kept, each of a byte of a
# sparse file far from the one before, with the largest offsets it has.
_FLOOD = """
    import os, sys, gpushm
    c = gpushm.connect()
    size = 1 << 30
    seg = c._create("f" * 200 + sys.argv[1][-12:], size, {"x": "y" * (32 * 1024 - 16)}, None, 0o600, False)
    fd = os.open(sys.argv[2], os.O_RDONLY)
    end = os.fstat(fd).st_size
    for i in range(int(sys.argv[3])):
        c._call("fill", fd, segment=seg.info.id, offset=end - 2 - 2 * i, at=size - 2 - 2 * i, size=1)
    print(len(c.stat(seg.info.name).sources))
"""


@pytest.fixture
def cdaemon():
    d = Daemon("host")
    yield d
    d.stop()


def _crash(sock):
    """SIGKILLs the serving process and waits for the supervisor's next."""
    with gpushm.connect(sock, reconnect=0) as c:
        old = c.info()["pid"]
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with gpushm.connect(sock, reconnect=0) as c:
                if c.info()["pid"] != old:
                    return
        except OSError:
            pass
        time.sleep(0.01)
    pytest.fail("no new serving process within 30s")


def test_foreign_outlives_a_crash_whatever_others_journal(cdaemon, name, shared_dir, monkeypatch):
    monkeypatch.setenv("GPUSHM_SOCKET", cdaemon.socket)
    sparse = os.path.join(shared_dir, "sparse")
    with open(sparse, "wb") as f:
        f.truncate(1 << 43)  # ext4 and tmpfs hold that much, sparse
    os.chmod(sparse, 0o644)
    path = _model(shared_dir)
    c = gpushm.connect(cdaemon.socket)
    put_file(c, name, path, mode=0o644)
    # A record too large for the journal broke the serving process's link
    # to its supervisor: each change dropped until a new supervisor took
    # the whole state, which the record kept too large to send. A change
    # made meanwhile (another user's write access to root's bundle) was
    # lost with the next crash, and the bundle's records came back.
    kept = int(_as_nobody(cdaemon, shared_dir, _FLOOD, name, sparse, 1024))
    assert kept <= 128, f"{kept} sources kept"  # segment.MaxSources
    c._call("chmod", name=name, mode=0o666)
    _as_nobody(cdaemon, shared_dir, """
        import sys, gpushm
        gpushm.connect().open(sys.argv[1])
    """, name)
    c._call("chmod", name=name, mode=0o644)
    assert c.stat(name).sources == ()
    c.close()
    _crash(cdaemon.socket)
    c = gpushm.connect(cdaemon.socket)
    assert c.stat(name).sources == (), "another user's write access was forgotten in a crash"
    assert _fresh(path) is None
    c.close()
    assert "the supervisor died" not in cdaemon.logs(), cdaemon.logs()


def test_on_a_gpu_a_bundle_others_may_read_is_not_served(client, name, shared_dir, monkeypatch):
    # The hook's half of test_gpu_hook_trust.py, on any machine: the
    # bundle is told to be GPU memory, where a reader can write.
    path = _model(shared_dir)
    put_file(client, name, path, mode=0o644)
    assert gst.held(path) is not None  # host memory: a reader cannot write
    orig = SegmentInfo.from_wire
    monkeypatch.setattr(SegmentInfo, "from_wire", classmethod(lambda cls, d: orig(dict(d, handle_type="cuda_fd"))))
    gst._holdings.clear()
    assert gst.held(path) is None, "a GPU bundle others may read is served"
    client._call("chmod", name=name, mode=0o600)
    gst._holdings.clear()
    assert gst.held(path) is not None



@pytest.fixture
def fdaemon():
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse to mount the view on")
    mnt = tempfile.mkdtemp(prefix="gpushm-view-")
    os.chmod(mnt, 0o755)
    d = Daemon("host", "--mount", mnt)
    d.mnt = mnt
    yield d
    d.stop()
    subprocess.run(["umount", "-l", mnt], capture_output=True)
    os.rmdir(mnt)


def test_a_write_through_the_view_is_never_trusted(fdaemon, name, shared_dir, monkeypatch):
    # Root's bundle lets its group (nobody's) write; nobody writes it
    # through the FUSE view. The daemon makes each write itself, but an
    # open for writing counts as write access all the same: its writes may
    # run beside a fill of root's, as another user's fill may.
    monkeypatch.setenv("GPUSHM_SOCKET", fdaemon.socket)
    path = _model(shared_dir)
    c = gpushm.connect(fdaemon.socket)
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    child(fdaemon.socket, """
        import json, sys, gpushm
        gpushm.connect()._create(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), None, 0o660, False)
    """, name, len(data), json.dumps(bundle_meta(n, 2)), group=NOBODY)
    seg = c.open(name)
    with open(path, "rb") as f:
        seg.fill(f)
    seg.close()
    assert len(c.stat(name).sources) == 1
    _as_nobody(fdaemon, shared_dir, """
        import os, struct, sys
        with open(os.path.join(sys.argv[1], sys.argv[2]), "r+b") as f:
            f.seek(int(sys.argv[3]) - 24)
            f.write(struct.pack("<f", 666.0) * 6)
    """, fdaemon.mnt, name, len(data))
    assert c.stat(name).sources == ()
    c._call("chmod", name=name, mode=0o640)
    assert _fresh(path) is None
    # For good: root's next fill is not recorded either.
    seg = c.open(name)
    with open(path, "rb") as f:
        seg.fill(f)
    seg.close()
    assert c.stat(name).sources == ()
    c.close()
