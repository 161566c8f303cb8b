"""gpushm.connect() with no socket, played against as another user would
(docs/security.md, "Finding the daemon"): a user with no $GPUSHM_SOCKET
nor $XDG_RUNTIME_DIR looks for its own socket in $TMPDIR/gpushm-UID, a
path any other user may take first. Whatever the other user puts there,
the victim skips it, says why, and sends it nothing; the node's daemon is
reached instead. The victim, the attacker and the client in a user
namespace each run in a process of their own uid."""

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

import gpushm

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="playing two users needs root")

VICTIM, ATTACKER = 4242, 4243
HINT = " (is 'gpushm daemon' running? set $GPUSHM_SOCKET to choose a socket)"

# The victim: connects as a program given no socket does, with the node's
# socket at argv[2] if given, and creates argv[1] where it got to.
VICTIM_CODE = """
    import sys, gpushm
    from gpushm import _core
    if sys.argv[2]:
        _core.SYSTEM_SOCKET = sys.argv[2]
    try:
        c = gpushm.connect(timeout=3, reconnect=0)
    except OSError as e:
        print(type(e).__name__, e.strerror)
    else:
        c.create(sys.argv[1], 16)
        print("reached", c.socket)
"""

# A trap where a daemon would be, run by the attacker: it reports, for
# each connection, what the client sent before hanging up or going quiet.
TRAP_CODE = """
    import os, select, socket, sys
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(sys.argv[1])
    os.chmod(sys.argv[1], 0o666)
    s.listen(16)
    print("listening", flush=True)
    while True:
        ready, _, _ = select.select([s, sys.stdin], [], [])
        if s in ready:
            c, _ = s.accept()
            c.settimeout(1)
            try:
                got = c.recv(65536)
            except TimeoutError:
                got = b"?"
            print("sent", repr(got[:40]) if got else "nothing", flush=True)
            c.close()
        if sys.stdin in ready and not sys.stdin.readline():
            break
"""


def _others_can_run(path):
    path = os.path.realpath(path)
    parts = path.split("/")
    dirs = ["/".join(parts[:i]) or "/" for i in range(1, len(parts))]
    return all(os.stat(d).st_mode & 0o001 for d in dirs) and os.stat(path).st_mode & 0o001


@pytest.fixture(scope="module")
def world():
    """A directory every user may enter: the package and the gpushm binary,
    for the other users' processes."""
    if not _others_can_run(sys.executable):
        pytest.skip(f"other users cannot run {sys.executable}")
    d = tempfile.mkdtemp(prefix="gpushm-sockets-")
    os.chmod(d, 0o755)
    shutil.copytree(os.path.dirname(gpushm.__file__), os.path.join(d, "pkg", "gpushm"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.environ["GPUSHM_BIN"], os.path.join(d, "gpushm"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tmp(world):
    """The victim's $TMPDIR, which anyone may write, as /tmp; a lair of the
    attacker's in it, which the victim may enter."""
    d = tempfile.mkdtemp(prefix="t-", dir=world)
    os.chmod(d, 0o1777)
    mkdir(os.path.join(d, "lair"), 0o755, ATTACKER)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def mkdir(path, mode, uid):
    os.mkdir(path)
    os.chown(path, uid, uid)
    os.chmod(path, mode)


def env(world, **kw):
    e = {k: v for k, v in os.environ.items() if k not in ("GPUSHM_SOCKET", "XDG_RUNTIME_DIR", "TMPDIR", "PYTHONSTARTUP")}
    e["PYTHONPATH"] = os.path.join(world, "pkg")
    e.update(kw)
    return e


def victim(world, name, node="", **kw):
    """The victim's line: "reached PATH", or the error's type and text."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(VICTIM_CODE), name, node], env=env(world, **kw),
                       user=VICTIM, group=VICTIM, extra_groups=[], cwd="/", capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


class Trap:
    def __init__(self, world, path):
        self.p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(TRAP_CODE), path], env=env(world),
                                  user=ATTACKER, group=ATTACKER, extra_groups=[], cwd="/",
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.p.stdout.readline() == "listening\n"

    def sent(self):
        """What was sent on the connections that sent anything, once the
        trap is stopped."""
        out, _ = self.p.communicate("", timeout=30)
        return [line for line in out.splitlines() if line.startswith("sent ") and line != "sent nothing"]


class AttackerDaemon:
    """An ordinary 'gpushm daemon', run by the attacker."""

    def __init__(self, world, path):
        self.bin, self.path = os.path.join(world, "gpushm"), path
        self.p = subprocess.Popen([self.bin, "daemon", "--socket", path, "--backend", "host", "--supervise=false",
                                   "--nvml", "off"], user=ATTACKER, group=ATTACKER, extra_groups=[],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while self.cli("info").returncode != 0:
            assert time.monotonic() < deadline and self.p.poll() is None, "the attacker's daemon did not start"
            time.sleep(0.02)

    def cli(self, *args):
        return subprocess.run([self.bin, "--socket", self.path, *args], user=ATTACKER, group=ATTACKER, extra_groups=[],
                              capture_output=True, text=True, timeout=30)

    def names(self):
        """The segments it holds, as its own user lists them."""
        r = self.cli("ls")
        assert r.returncode == 0, r.stderr
        return [line.split()[0] for line in r.stdout.splitlines()[1:]]

    def stop(self):
        self.p.terminate()
        self.p.wait(10)


@as_root
def test_squatted_directory(world, tmp, daemon, name):
    """The attacker made $TMPDIR/gpushm-UID first and runs a daemon there."""
    own = os.path.join(tmp, f"gpushm-{VICTIM}")
    mkdir(own, 0o755, ATTACKER)
    bad = AttackerDaemon(world, os.path.join(own, "gpushm.sock"))
    try:
        assert victim(world, name, daemon.socket, TMPDIR=tmp) == "reached " + daemon.socket
        nowhere = os.path.join(daemon.dir, "nowhere.sock")
        assert victim(world, name + "x", nowhere, TMPDIR=tmp) == (
            f"FileNotFoundError gpushm: cannot reach a daemon: {own}: owned by uid {ATTACKER}, not you: skipped "
            f"(another user may have made it); {nowhere}: no such file{HINT}")
        assert bad.names() == []
    finally:
        bad.stop()
    with gpushm.connect(daemon.socket) as c:
        assert c.stat(name).uid == VICTIM


@as_root
@pytest.mark.parametrize("how", ["open to all", "symbolic link", "another's socket"])
def test_planted_socket(world, tmp, daemon, name, how):
    """The attacker's socket where the victim looks: in the victim's
    directory left open to all (moved in, as anyone may there), through a
    symbolic link in $TMPDIR, or in the victim's own directory."""
    own, lair = os.path.join(tmp, f"gpushm-{VICTIM}"), os.path.join(tmp, "lair")
    trap = Trap(world, os.path.join(lair, "gpushm.sock"))
    if how == "symbolic link":
        os.symlink(lair, own)
        os.lchown(own, ATTACKER, ATTACKER)
        why = f"{own}: a symbolic link, not a directory: skipped (another user may have made it)"
    else:
        mkdir(own, 0o777 if how == "open to all" else 0o700, VICTIM)
        os.rename(os.path.join(lair, "gpushm.sock"), os.path.join(own, "gpushm.sock"))
        why = (f"{own}: mode 0777 lets group or others replace the socket: skipped (chmod go-w {own})" if how == "open to all"
               else f"{own}/gpushm.sock: owned by uid {ATTACKER}, neither you nor root: skipped (another user may have put it there)")
    assert victim(world, name, daemon.socket, TMPDIR=tmp) == "reached " + daemon.socket
    nowhere = os.path.join(daemon.dir, "nowhere.sock")
    assert victim(world, name + "x", nowhere, TMPDIR=tmp) == (
        f"FileNotFoundError gpushm: cannot reach a daemon: {why}; {nowhere}: no such file{HINT}")
    assert trap.sent() == []


@as_root
def test_daemon_of_another_user(world, tmp, name):
    """A daemon answering as another user is refused before it is sent
    anything, even on a path given explicitly; $GPUSHM_DAEMON_UID trusts a
    dedicated daemon user."""
    sock = os.path.join(tmp, "lair", "gpushm.sock")
    trap = Trap(world, sock)
    refused = (f"{sock}: the daemon answering runs as uid {ATTACKER}, neither you (uid %d) nor root: refused, nothing sent "
               f"(another user may run it; set GPUSHM_DAEMON_UID={ATTACKER} if that user runs the node's daemon)")
    assert victim(world, name, GPUSHM_SOCKET=sock) == (
        f"UntrustedSocketError gpushm: cannot reach a daemon: {refused % VICTIM} "
        "(is 'gpushm daemon' running? the path is $GPUSHM_SOCKET)")
    with pytest.raises(gpushm.UntrustedSocketError) as e:
        gpushm.connect(sock)
    assert str(e.value) == f"[Errno 13] gpushm: {refused % 0}"
    assert trap.sent() == []

    os.unlink(sock)
    dedicated = AttackerDaemon(world, sock)
    try:
        assert victim(world, name, GPUSHM_SOCKET=sock, GPUSHM_DAEMON_UID=str(ATTACKER)) == "reached " + sock
        assert dedicated.names() == [name]
    finally:
        dedicated.stop()


@as_root
def test_nodes_daemon_from_a_user_namespace(world, daemon, name):
    """As root of a user namespace that does not map root (a pod with
    hostUsers: false): the node's daemon and its directory read as the
    overflow uid. Found by convention, refused with the variable that
    trusts it; given in $GPUSHM_SOCKET, trusted."""
    enter = ["setpriv", "--reuid", str(VICTIM), "--regid", str(VICTIM), "--clear-groups",
             "unshare", "--user", "--map-root-user", "--mount"]
    if shutil.which("setpriv") is None or shutil.which("unshare") is None:
        pytest.skip("needs setpriv and unshare (util-linux)")
    if subprocess.run(enter + ["true"], capture_output=True).returncode != 0:
        pytest.skip(f"this kernel does not let uid {VICTIM} make a user namespace")
    with open("/proc/sys/kernel/overflowuid") as f:
        overflow = f.read().strip()
    node = "/run/gpushm/" + os.path.basename(daemon.socket)
    run = 'mount -t tmpfs -o mode=0755 gpushm-test /run && mkdir /run/gpushm && '
    host_path = run + 'mount --bind "$SOCKET_DIR" /run/gpushm && '
    socket_only = run + f'touch {node} && mount --bind "$SOCKET_DIR/{os.path.basename(node)}" {node} && '
    child = 'exec "$0" -c "$CODE" "$NAME" ' + node
    unsure = ": root's, or any user this user namespace does not map: "
    cases = [
        (host_path, "", f"UntrustedSocketError gpushm: cannot reach a daemon: /run/gpushm: owned by uid {overflow}, the overflow uid"
                        f"{unsure}skipped (set GPUSHM_SOCKET={node} to trust it){HINT}"),
        (socket_only, "", f"UntrustedSocketError gpushm: cannot reach a daemon: {node}: the daemon answering reads as uid {overflow}, "
                          f"the overflow uid{unsure}refused, nothing sent (set GPUSHM_SOCKET={node} to trust it){HINT}"),
        (host_path, node, "reached " + node),
        (socket_only, node, "reached " + node),
    ]
    for i, (mounts, given, want) in enumerate(cases):
        e = env(world, SOCKET_DIR=daemon.dir, CODE=textwrap.dedent(VICTIM_CODE), NAME=f"{name}-{i}")
        if given:
            e["GPUSHM_SOCKET"] = given
        r = subprocess.run(enter + ["sh", "-c", mounts + child, sys.executable], env=e, cwd="/",
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.strip() == want, (mounts, given)
    with gpushm.connect(daemon.socket) as c:
        held = {s.name for s in c.list()}
    assert [f"{name}-{i}" in held for i in range(4)] == [False, False, True, True]


def test_daemon_uid_must_be_a_uid(monkeypatch, daemon):
    monkeypatch.setenv("GPUSHM_DAEMON_UID", "daemon")
    with pytest.raises(ValueError, match=r'GPUSHM_DAEMON_UID="daemon" is not a uid'):
        gpushm.connect(daemon.socket)


@as_root
def test_reconnect_checks_the_daemon(world, name):
    """Every connection is checked, reconnections too: when the client's
    daemon went away and another user's took the path (a directory open to
    all, sticky as /tmp), the next call is refused and sends it nothing."""
    d = tempfile.mkdtemp(prefix="r-", dir=world)
    os.chmod(d, 0o1777)
    sock = os.path.join(d, "gpushm.sock")
    p = subprocess.Popen([os.environ["GPUSHM_BIN"], "daemon", "--socket", sock, "--backend", "host", "--supervise=false",
                          "--nvml", "off"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                c = gpushm.connect(sock, reconnect=5)
                break
            except OSError:
                assert time.monotonic() < deadline and p.poll() is None, "the daemon did not start"
                time.sleep(0.02)
        c.create(name, 16)
    finally:
        p.terminate()
        p.wait(10)
    trap = Trap(world, sock)
    with pytest.raises(gpushm.UntrustedSocketError, match=f"the daemon answering runs as uid {ATTACKER}, neither you"):
        c.create(name + "x", 16)
    assert trap.sent() == []
    shutil.rmtree(d, ignore_errors=True)


@as_root
def test_a_socket_this_user_may_not_open(world, tmp):
    """A socket that is there but refuses this user (its mode) is said to
    be so, as permission denied, not as no daemon."""
    sock = os.path.join(tmp, "gpushm.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.bind(sock)
    os.chmod(sock, 0o600)
    s.listen(1)
    try:
        code = "import sys, gpushm\ntry:\n    gpushm.connect(sys.argv[1])\nexcept OSError as e:\n    print(type(e).__name__, e)\n"
        r = subprocess.run([sys.executable, "-c", code, sock], env=env(world), user=VICTIM, group=VICTIM, extra_groups=[],
                           cwd="/", capture_output=True, text=True, timeout=60)
        assert r.stdout.startswith("PermissionError"), (r.stdout, r.stderr)
        assert "this user may not connect" in r.stdout and "is 'gpushm daemon' running" not in r.stdout, r.stdout
    finally:
        s.close()
