"""The client core: a connection to the daemon and the segments opened
through it. It speaks the wire protocol of docs/protocol.md: a
SOCK_SEQPACKET connection, one JSON object per packet, descriptors by
SCM_RIGHTS.

It names no feature. Channels, bundles and gpushm.torch sit one floor up
(gpushm._client composes them into Client); what a feature holds of the
daemon besides its segments' leases (a channel's role) it hands to the core
through a hook, _hold: the core takes it back after a reconnection and
closes it with the client, knowing nothing more of it (the Go client's
holder). python/tests/client/test_imports.py checks that the core imports
none of them.

Locking: one lock serializes round trips. Mappings end their leases from
finalizers, which may run at any allocation, also inside a round trip on the
same thread; so a finalizer never waits for the lock: it queues the close and
takes the lock only if it is free, and whoever holds the lock sends what is
queued before letting go.
"""

from __future__ import annotations

import array
import collections
import ctypes
import errno
import itertools
import json
import os
import select
import socket
import struct
import threading
import time
import weakref

from . import _cuda, _dlpack, _mapping, _trust
from ._errors import (BusyError, Error, ExistsError, InvalidError, NoSpaceError, NotCommittedError, NotFoundError,  # noqa: F401
                      OutOfMemoryError, PermissionDeniedError, StaleError, WaitTimeoutError, error)
from ._info import HeldVersion, SegmentInfo  # noqa: F401
from ._segment import Segment
from ._tensors import Layout, layout_of
from ._trust import UntrustedSocketError

MAX_MESSAGE = 65536
VERSION = 1
# One encoder and decoder for every message: json.dumps with separators
# builds a new encoder each call, and json.loads of bytes sniffs the
# encoding, which the protocol fixes (UTF-8).
_encode = json.JSONEncoder(separators=(",", ":")).encode
_decode = json.JSONDecoder().decode


SYSTEM_SOCKET = "/run/gpushm/gpushm.sock"
"""Where a daemon run as root listens by default ('gpushm install-systemd',
the Kubernetes DaemonSet): the node's daemon, which every local user may
reach (the Go client's SystemSocket)."""


def default_socket() -> str:
    """Where 'gpushm daemon' listens when given no socket: $GPUSHM_SOCKET,
    else the user's own socket: SYSTEM_SOCKET for root, else
    $XDG_RUNTIME_DIR/gpushm/gpushm.sock, else $TMPDIR/gpushm-UID/gpushm.sock
    (/tmp by default; the Go client's DefaultSocket). A client given no
    socket looks in socket_candidates()."""
    if os.environ.get("GPUSHM_SOCKET"):
        return os.environ["GPUSHM_SOCKET"]
    return _user_socket()


def _user_socket() -> str:
    if os.geteuid() == 0:
        return SYSTEM_SOCKET
    if os.environ.get("XDG_RUNTIME_DIR"):
        return os.path.join(os.environ["XDG_RUNTIME_DIR"], "gpushm", "gpushm.sock")
    return os.path.join(os.environ.get("TMPDIR") or "/tmp", f"gpushm-{os.geteuid()}", "gpushm.sock")


def socket_candidates() -> list[str]:
    """Where connect() with no socket looks for the daemon, in order:
    $GPUSHM_SOCKET alone when it is set; else the user's own socket
    (default_socket(): a daemon the user runs), then SYSTEM_SOCKET (the
    node's daemon, run as root); for root the two are one, tried once. The
    next is tried when nothing listens at a path (no such file, connection
    refused), or when a path found this way fails the checks of who owns it
    (docs/security.md, "Finding the daemon"). The Go client's
    SocketCandidates."""
    return [p for p, _ in _candidates()]


def _candidates() -> list[tuple[str, str]]:
    """socket_candidates(), each with how it was found (_trust.GIVEN, OWN,
    NODE)."""
    if os.environ.get("GPUSHM_SOCKET"):
        return [(os.environ["GPUSHM_SOCKET"], _trust.GIVEN)]
    own = _user_socket()
    if own == SYSTEM_SOCKET:
        return [(own, _trust.NODE)]
    return [(own, _trust.OWN), (SYSTEM_SOCKET, _trust.NODE)]


# Dial errors that mean nothing listens at a path, so that the next
# candidate may be tried; any other (permission denied, a timeout) may be
# a daemon that is there, and ends the search.
_NOTHING_LISTENS = (errno.ENOENT, errno.ECONNREFUSED)


def _dial_reason(e: OSError) -> str:
    if e.errno == errno.ENOENT:
        return "no such file"
    reason = e.strerror or str(e)
    return reason[:1].lower() + reason[1:]  # as Go writes errnos


# ---- the client -----------------------------------------------------------

class _Lost(ConnectionError):
    """The daemon hung up: the request may be sent again on a new
    connection."""


_ANCILLARY = socket.CMSG_SPACE(4 * 4)  # room to notice a packet with too many fds
# Plain ints: arithmetic on the socket module's IntFlag members costs
# microseconds a request.
_CLOEXEC, _DONTWAIT = int(socket.MSG_CMSG_CLOEXEC), int(socket.MSG_DONTWAIT)
_TRUNC, _CTRUNC = int(socket.MSG_TRUNC), int(socket.MSG_CTRUNC)


def _lifetime(temporary: bool, ttl) -> dict:
    f = {}
    if temporary:
        f["lifetime"] = "connection"
    if ttl is not None:
        if not ttl > 0:
            raise ValueError(f"gpushm: ttl {ttl!r}: want a positive number of seconds")
        f["ttl_seconds"] = float(ttl)
    return f


def _seconds_env(name: str, default: float) -> float:
    """$name in seconds, or as a duration such as "30s", "500ms"; default
    when unset or unreadable."""
    v = os.environ.get(name, "").strip()
    if not v:
        return default
    for suffix, scale in (("ms", 1e-3), ("us", 1e-6), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if v.endswith(suffix):
            try:
                return float(v[:-len(suffix)]) * scale
            except ValueError:
                break
    try:
        return float(v)
    except ValueError:
        return default


def _reconnect_default() -> float:
    """$GPUSHM_RECONNECT ("0" never reconnects), else 30 seconds, as the Go
    client."""
    return _seconds_env("GPUSHM_RECONNECT", 30.0)


# How long the daemon may take over a pull (wire.PullTime).
PULL_TIME = 1800.0


def _timeout_default() -> float:
    """$GPUSHM_TIMEOUT ("0" waits for ever), else 60 seconds, as the Go
    client."""
    return _seconds_env("GPUSHM_TIMEOUT", 60.0)


def _set_timeouts(s, seconds):
    """Bounds every blocking call on s by the socket's own timeouts (0: no
    bound): the call then fails with EAGAIN, and a round trip pays nothing
    for it (settimeout would poll before every call). They bound connect
    too, which waits while the daemon's backlog is full."""
    sec = int(seconds)
    usec = max(int((seconds - sec) * 1e6), 0 if sec or seconds <= 0 else 1)
    tv = struct.pack("@ll", sec, usec)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


# How often (seconds) a client that holds segments or channels checks,
# between its calls, whether the daemon ended its connection. After a
# restart the daemon keeps what clients held for its grace period (10 s by
# default) and no longer: a client that maps a segment and makes no call
# would otherwise lose its lease, and the segment could be evicted or expire
# under it. One thread per process watches every client.
WATCH_INTERVAL = 1.0

_watched = weakref.WeakSet()
_watcher = None
_watch_lock = threading.Lock()


def _after_fork():
    # The watch thread may have held the lock at the fork; the child has
    # no such thread.
    global _watch_lock
    _watch_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork)


def _watch(client):
    global _watcher
    with _watch_lock:
        _watched.add(client)
        # A forked child has the set but not the thread.
        if _watcher is None or not _watcher.is_alive():
            _watcher = threading.Thread(target=_watch_loop, name="gpushm-watch", daemon=True)
            _watcher.start()


def _watch_loop():
    while True:
        time.sleep(WATCH_INTERVAL)
        # Weak references, each made strong only while its client is looked
        # at: the watch must not keep a client nobody else holds alive (its
        # finalizer unmaps its epoch pages).
        with _watch_lock:
            refs = [weakref.ref(c) for c in _watched]
        for r in refs:
            c = r()
            if c is None:
                continue
            try:
                c._rejoin()
            except Exception:
                pass  # the client's next call meets the same trouble, and says it
            del c


class Core:
    """The core of a Client (gpushm._client): a connection to the daemon
    and the segments opened through it. Close it (or use it as a context
    manager) to end its leases; memory still used by live tensors stays
    mapped until they go."""

    def __init__(self, path: str | None = None, *, timeout: float | None = None, spin_us: int = 0,
                 reconnect: float | None = None):
        # The daemon's socket: path, or the candidate that answered; how it
        # was found, and who is trusted there, at every connection.
        self.socket = path
        self._origin = _trust.GIVEN
        self._trust = _trust.Trust()
        self._spin_ns = int(spin_us * 1000)
        self._timeout = _timeout_default() if timeout is None else float(timeout)
        self._reconnect = _reconnect_default() if reconnect is None else float(reconnect)
        # Names this client across reconnections: the daemon gives a
        # restarted connection back its temporary segments by it.
        self._session = os.urandom(16).hex()
        self._reconnects = 0
        self._devices = None  # the daemon's devices by UUID, for _daemon_device
        self.peer_uid = None  # this process's uid as the daemon sees it (hello)
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._pending = collections.deque()  # segment ids whose lease ends
        self._broken = None
        self._closed = False
        self._by_name = weakref.WeakValueDictionary()  # (name, readonly, devices) -> Mapping
        self._by_id = weakref.WeakValueDictionary()  # (segment id, readonly, devices) -> Mapping
        self._held = weakref.WeakSet()  # what features hold besides segments (_hold)
        if path:
            try:
                self._sock = self._dial()
            except UntrustedSocketError as e:
                raise UntrustedSocketError("gpushm: " + e.text) from None
            except OSError as e:
                hint = ("a daemon's socket is there, but this user may not connect: its group and mode say who may, "
                        "as 'ls -l' shows" if e.errno in (errno.EACCES, errno.EPERM) else "is 'gpushm daemon' running?")
                raise type(e)(e.errno, f"gpushm: cannot reach daemon at {self.socket} ({hint}): {e.strerror}") from None
        else:
            self._sock = self._find()
        try:
            with self._lock:
                try:
                    self._hello()
                except _Lost as lost:
                    # Ended before its hello was answered (a serving process
                    # restarting, or handing over as it accepted): made
                    # again, as a request's connection would be.
                    self._reconnect_now(lost)
        except BaseException:
            self._sock.close()
            raise
        _watch(self)

    def _find(self):
        """Dials the first of socket_candidates() that answers, and makes it
        self.socket."""
        tried = []
        for cand, origin in _candidates():
            self.socket, self._origin = cand, origin
            try:
                return self._dial()
            except UntrustedSocketError as e:
                tried.append((cand, e))
            except OSError as e:
                tried.append((cand, e))
                if e.errno not in _NOTHING_LISTENS:
                    break  # a daemon may be there: say so rather than reach another
        last = tried[-1][1]
        paths = "; ".join(e.text if isinstance(e, UntrustedSocketError) else f"{p}: {_dial_reason(e)}" for p, e in tried)
        hint = ("the path is $GPUSHM_SOCKET" if os.environ.get("GPUSHM_SOCKET")
                else "set $GPUSHM_SOCKET to choose a socket")
        msg = f"gpushm: cannot reach a daemon: {paths} (is 'gpushm daemon' running? {hint})"
        if isinstance(last, UntrustedSocketError):
            raise UntrustedSocketError(msg) from None
        raise type(last)(last.errno, msg) from None

    def _dial(self):
        """Connects to self.socket, sending nothing, and checks who it
        reached (_trust): every connection, the first and every
        reconnection, comes here."""
        self._trust.check_path(self.socket, self._origin)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            _set_timeouts(s, self._timeout)
            try:
                s.connect(self.socket)
            except BlockingIOError:
                raise TimeoutError(errno.ETIMEDOUT, f"the daemon accepted no connection within {self._timeout:g}s") from None
            self._trust.check_peer(s, self.socket, self._origin)
        except OSError:
            s.close()
            raise
        return s

    def _hello(self):
        """Greets the daemon on self._sock and maps its epoch page; the lock
        is held."""
        rep, fd = self._exchange("hello", {"version": VERSION, "session": self._session}, -1)
        err = rep.get("error")
        if err:
            if fd >= 0:
                os.close(fd)
            raise error(err.get("code", "EIO"), err.get("message") or "hello failed")
        if fd < 0 or not rep.get("epoch"):
            raise error("EPROTO", "hello: daemon sent no epoch page")
        try:
            if os.fstat(fd).st_size < 8:
                raise error("EPROTO", "hello: the epoch page is smaller than 8 bytes")
            ptr = _mapping.mmap(fd, 4096, False)
        finally:
            os.close(fd)
        # An aligned 8-byte load is atomic on the 64-bit machines CUDA runs on.
        self._epoch = ctypes.c_uint64.from_address(ptr)
        self.server, self.backend = rep.get("server", ""), rep.get("backend", "")
        # This process as the daemon knows it (SO_PEERCRED): in a user
        # namespace, not what os.geteuid() says. None from older daemons.
        peer = rep.get("peer")
        self.peer_uid = peer.get("uid") if isinstance(peer, dict) and isinstance(peer.get("uid"), int) else None
        # Earlier pages stay mapped until the client goes: another thread
        # may be reading one.
        weakref.finalize(self, _mapping.munmap, ptr, 4096).atexit = False

    def __repr__(self):
        return f"<gpushm.Client {self.socket} backend={self.backend}>"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _hold(self, h):
        """Has this client take h back after each reconnection, and close it
        at close, until _unhold. h is what a feature holds of the daemon
        besides its segments' leases (a channel's end): h._reclaim(exchange)
        takes it back on the new connection, the lock held, through
        exchange (a round trip that raises _Lost when the connection is lost
        again, which stops the reclaim); h.close() ends it and calls
        _unhold. Held weakly: what nobody else keeps is not held."""
        self._held.add(h)

    def _unhold(self, h):
        """Ends what _hold began."""
        self._held.discard(h)

    def close(self):
        """Closes what this client's features hold (channels: see
        Channel.close) and ends every lease this connection holds. Memory that tensors still use stays
        mapped until they go."""
        if not self._closed and self._pid == os.getpid():
            for h in list(self._held):
                try:
                    h.close()
                except Exception:
                    pass  # the connection is going anyway, and the role with it
        with self._lock:
            if self._closed:
                return
            if self._broken is None and self._pid == os.getpid():
                self._end_lost_connection()
            self._closed = True
            self._broken = "the client was closed"
            self._pending.clear()
            self._sock.close()
        with _watch_lock:
            _watched.discard(self)

    def _end_lost_connection(self):
        """Ends the temporary segments of a connection that a crash of the
        daemon's serving process took since the last call: the new serving
        process keeps them for as long as this process lives, waiting for
        this session. A hello with it on a new connection, closed at once,
        takes them back to end with it. If the daemon does not answer in
        time, they end when this process exits. The lock is held."""
        if self._reconnect <= 0 or not self._hung_up():
            return
        try:
            self._fresh_connection(min(self._reconnect, 5.0))
        except Exception:
            pass

    def _fresh_connection(self, timeout=None):
        """Dials the daemon and says hello with this client's session on a
        new connection (with timeout, if given), which replaces the old one.
        If either fails, the old connection and _broken stay as they were,
        and the error is raised. The lock is held."""
        old, broken = self._sock, self._broken
        try:
            self._sock = self._dial()
            if timeout is not None:
                _set_timeouts(self._sock, timeout)
            self._hello()
        except BaseException:
            # A failed hello may have marked the connection broken; the
            # client is not.
            if self._sock is not old:
                self._sock.close()
            self._sock, self._broken = old, broken
            raise
        old.close()

    def _hung_up(self):
        """Whether the daemon closed this client's connection, without
        waiting."""
        p = select.poll()
        p.register(self._sock, select.POLLIN | select.POLLRDHUP)
        return any(ev & (select.POLLHUP | select.POLLRDHUP | select.POLLERR) for _, ev in p.poll(0))

    # ---- round trips --------------------------------------------------

    def _usable(self):
        if self._pid != os.getpid():
            raise RuntimeError(f"gpushm: this client was connected in process {self._pid}; connect again in this process (a forked child cannot share the connection)")
        if self._broken:
            raise ConnectionError(f"gpushm: connection to {self.socket} unusable: {self._broken}")

    def _call(self, op: str, _send_fd: int = -1, _keep_control: bool = False, **fields):
        """Sends a request (with _send_fd attached, if not -1) and returns
        (reply, fd); fd is -1 or a descriptor the caller owns. A daemon error
        is raised as Error. A channel's control block descriptor, when one
        came, is in reply["control_fd"] with _keep_control (the caller owns
        it), else closed."""
        self._usable()
        with self._lock:
            try:
                rep, fd = self._round_trip(op, fields, _send_fd, retry_close=op == "close")
            finally:
                self._drain()
        self._flush()
        cfd = rep.pop("control_fd", -1)
        if cfd >= 0 and not _keep_control:
            os.close(cfd)
            cfd = -1
        err = rep.get("error")
        if err:
            raise error(err.get("code", "EIO"), err.get("message") or err.get("code", "EIO"))
        if cfd >= 0:
            rep["control_fd"] = cfd
        return rep, fd

    def _round_trip(self, op, fields, send_fd=-1, retry_close=False):
        """One request and its reply. If the daemon went away (its serving
        process died or was replaced), reconnects and sends the request
        again with the same id: a create or publish the first attempt
        applied is found again by its id, an unlink or rename that finds its
        name gone had been applied, and a close needs nothing (the lease
        ended with the connection), unless retry_close: a channel's role
        outlives a crashed serving process, so its close reconnects, reclaims
        it with the others, and ends it."""
        rid = next(self._ids)
        retried = False
        start, wait = time.monotonic(), fields.get("wait")
        while True:
            if retried and wait:
                # An open waiting for a commit waits what is left of its time.
                fields["wait"] = max(wait - (time.monotonic() - start), 0.001)
            try:
                rep, fd = self._exchange(op, fields, send_fd, rid)
            except _Lost as lost:
                if op == "close" and not retry_close:
                    return {"id": rid}, -1
                while True:
                    try:
                        self._reconnect_now(lost)
                        break
                    except _Lost as again:  # gone again while reclaiming
                        lost = again
                retried = True
                continue
            if retried and op in ("unlink", "rename") and (rep.get("error") or {}).get("code") == "ENOENT":
                return {"id": rid}, -1
            return rep, fd

    def _reconnect_now(self, cause):
        """Dials the daemon again until it answers or the reconnect window
        passes, says hello with the same session, and reclaims the leases of
        every segment this client has mapped; the lock is held."""
        self._sock.close()
        if self._reconnect <= 0:
            self._fail(cause.__cause__ or cause)
            raise ConnectionError(f"gpushm: connection to {self.socket} lost: {cause}")
        deadline = time.monotonic() + self._reconnect
        wait = 0.002
        while True:
            try:
                self._sock = self._dial()
                self._hello()
                break
            except _Lost:
                self._sock.close()
            except OSError as e:
                if not isinstance(e, (ConnectionError, FileNotFoundError)):
                    self._fail(e)
                    raise
            if time.monotonic() > deadline:
                self._broken = f"the daemon went away and did not come back within {self._reconnect:g}s"
                raise ConnectionError(f"gpushm: {self._broken} ({self.socket})")
            time.sleep(wait)
            wait = min(2 * wait, 0.1)
        self._reconnects += 1
        self._reclaim()

    def _rejoin(self):
        """From the watcher thread, between calls: if the daemon ended this
        client's connection while it holds leases or channels, reconnects at
        once and reclaims them, so that they outlast the daemon's grace
        period. When the daemon does not answer yet, the old connection
        stays, for the next tick or call to find ended. The lock is only
        taken when the connection ended and no call holds it."""
        if self._closed or self._broken or self._pid != os.getpid() or self._reconnect <= 0:
            return
        if not self._holds() or not self._hung_up() or not self._lock.acquire(blocking=False):
            return
        try:
            if self._closed or self._broken or not self._hung_up():
                return
            try:
                self._fresh_connection()
            except Exception:
                return
            self._reconnects += 1
            try:
                self._reclaim()
            except _Lost:
                pass  # ended again: the next tick or call finds it
        finally:
            self._lock.release()
        self._flush()

    def _holds(self):
        """Whether this client holds a lease or something of a feature's
        (_hold: a channel's role)."""
        try:
            return bool(self._held) or any(m.lease.client is self and m.lease.count > 0
                                               for m in _mapping.live())
        except RuntimeError:  # changed while read: look again next time
            return True

    def _reclaim(self):
        """Takes back, on a new connection, the leases of every segment this
        client has mapped and what its features hold (_hold); the lock is
        held."""
        # Leases of the old connection ended with it; names may mean other
        # segments now.
        self._pending.clear()
        self._by_name.clear()
        for m in _mapping.live():
            if m.client is self:
                # The epoch it was read at may not hold for the new serving
                # process: the next stale() or refresh() asks.
                m.epoch = -1
            lease = m.lease
            # A released mapping's lease has ended (client None): nothing
            # to take back; reacquire takes a new one.
            if lease.client is not self or lease.count <= 0:
                continue
            fields = {"segment": lease.segment, "count": lease.count}
            if m.readonly:
                fields["readonly"] = True
            rep, fd = self._exchange("reclaim", fields, -1)
            if fd >= 0:
                os.close(fd)
            if rep.get("error"):
                # Gone, or no longer ours: the mapping still works, but there
                # is no lease left to end.
                lease.client = None
        # What a feature holds (a channel's role, in its control block,
        # which the new serving process watches) it takes back itself.
        for h in list(self._held):
            h._reclaim(self._exchange)

    def _exchange(self, op, fields, send_fd=-1, rid=None):
        """Sends one request and reads its reply; raises _Lost when the
        daemon hung up (the request may be sent again)."""
        if rid is None:
            rid = next(self._ids)
        req = {"id": rid, "op": op}
        req.update(fields)
        b = _encode(req).encode()
        if len(b) > MAX_MESSAGE:
            raise ValueError(f"gpushm: {op} request is {len(b)} bytes, over the protocol's {MAX_MESSAGE} (meta too large?)")
        # The daemon answers a waiting open when the wait is over, a pull
        # when the bytes are here (within PULL_TIME).
        limit = self._timeout + (fields.get("wait") or 0) + (PULL_TIME if op == "pull" else 0)
        waits = self._timeout > 0 and limit != self._timeout
        try:
            if waits:
                # The daemon answers a waiting open when the wait is over.
                _set_timeouts(self._sock, limit)
            if send_fd >= 0:
                self._sock.sendmsg([b], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [send_fd]))])
            else:
                self._sock.send(b)
            while True:
                rep, fd, dropped = self._recv()
                if rep.get("id") == rid:
                    break
                if rep.get("id") == 0 and rep.get("error"):
                    # The daemon could not read this request's id. Requests
                    # go one at a time, so the error answers this one: it is
                    # not a stale reply to skip.
                    break
                # A reply to a request given up on: discard it.
                if fd >= 0:
                    os.close(fd)
            if waits:
                _set_timeouts(self._sock, self._timeout)
        except _Lost:
            raise
        except (BrokenPipeError, ConnectionResetError) as e:
            raise _Lost(str(e)) from e
        except BlockingIOError:
            e = self._timed_out(op, limit)
            self._fail(e)
            raise e from None
        except (OSError, ValueError) as e:
            self._fail(e)
            raise
        if dropped:
            if rep.get("fd") and isinstance(rep.get("segment"), dict):
                self._pending.append(rep["segment"]["id"])
            raise OSError(errno.EMFILE, f"gpushm: {op}: the daemon's descriptor was dropped in transit: this process is out of file descriptors (raise 'ulimit -n')")
        if rep.get("fd") and fd < 0 and not rep.get("error"):
            e = error("EPROTO", f"{op}: reply promised a descriptor and carried none")
            self._fail(e)
            raise e
        if rep.get("control") and not rep.get("error"):
            # A channel's control block follows, in a packet of its own.
            try:
                rep["control_fd"] = self._control(op, rid)
            except BaseException:
                if fd >= 0:
                    os.close(fd)
                raise
        if fd >= 0 and not (rep.get("fd") or rep.get("epoch")):
            os.close(fd)
            fd = -1
        return rep, fd

    def _control(self, op, rid):
        """Reads the packet that carries a channel's control block after
        the reply to request rid, and returns its descriptor."""
        try:
            rep, fd, dropped = self._recv()
        except _Lost:
            raise
        except (BrokenPipeError, ConnectionResetError) as e:
            raise _Lost(str(e)) from e
        except BlockingIOError:
            e = self._timed_out(op, self._timeout)
            self._fail(e)
            raise e from None
        except (OSError, ValueError) as e:
            self._fail(e)
            raise
        if rep.get("id") != rid or not rep.get("control_fd") or fd < 0:
            if fd >= 0:
                os.close(fd)
            e = error("EPROTO", f"{op}: the channel's control block did not follow the reply")
            self._fail(e)
            raise e
        if dropped:
            os.close(fd)
            raise OSError(errno.EMFILE, f"gpushm: {op}: the channel's control block descriptor was dropped in transit: this process is out of file descriptors (raise 'ulimit -n')")
        return fd

    def _recv(self):
        if self._spin_ns:
            deadline = time.perf_counter_ns() + self._spin_ns
            while True:
                try:
                    msg, anc, flags, _ = self._sock.recvmsg(MAX_MESSAGE + 1, _ANCILLARY,
                                                            _CLOEXEC | _DONTWAIT)
                    break
                except BlockingIOError:
                    if time.perf_counter_ns() >= deadline:
                        msg, anc, flags, _ = self._sock.recvmsg(MAX_MESSAGE + 1, _ANCILLARY, _CLOEXEC)
                        break
        else:
            msg, anc, flags, _ = self._sock.recvmsg(MAX_MESSAGE + 1, _ANCILLARY, _CLOEXEC)
        fds = array.array("i")
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
        if not msg and not fds:
            raise _Lost(f"the daemon at {self.socket} closed the connection")
        if flags & _TRUNC or len(msg) > MAX_MESSAGE or len(fds) > 1:
            for fd in fds:
                os.close(fd)
            raise error("EPROTO", "reply over 65536 bytes or with more than one descriptor")
        try:
            rep = _decode(msg.decode())
        except ValueError:
            for fd in fds:
                os.close(fd)
            raise error("EPROTO", f"reply is not JSON: {msg[:200]!r}") from None
        return rep, (fds[0] if fds else -1), bool(flags & _CTRUNC)

    def _timed_out(self, op, limit):
        # A blocking call failing with EAGAIN: the socket's timeout ran out.
        return TimeoutError(errno.ETIMEDOUT, f"gpushm: {op}: the daemon at {self.socket} did not answer within "
                            f"{limit:g}s (stuck? $GPUSHM_TIMEOUT or connect(timeout=...) sets the limit)")

    def _fail(self, e):
        # After a timeout or a protocol error the stream of replies can no
        # longer be trusted.
        self._broken = f"{type(e).__name__}: {e}"
        self._sock.close()

    def _release(self, segment: int, count: int):
        """Ends leases, from a mapping's finalizer: never blocks on the lock."""
        if self._closed or self._broken or self._pid != os.getpid():
            return
        self._pending.extend([segment] * count)
        self._flush()

    def _flush(self):
        while self._pending and self._lock.acquire(blocking=False):
            try:
                self._drain()
            finally:
                self._lock.release()

    def _drain(self):
        """Sends the queued closes; the lock is held."""
        while self._pending and not self._broken:
            seg = self._pending.popleft()
            try:
                self._round_trip("close", {"segment": seg})
            except Exception:
                return  # the connection is unusable, and its leases gone with it

    # ---- operations -----------------------------------------------------

    def info(self) -> dict:
        """The daemon's backend, devices, usage and the node's GPUs (docs/protocol.md, info)."""
        rep, _ = self._call("info")
        return {"server": self.server, "backend": rep.get("backend"), "devices": rep.get("devices", []),
                "usage": rep.get("usage", {}), "gpu": rep.get("gpu"), "pid": rep.get("pid", 0),
                "supervisor_pid": rep.get("supervisor_pid", 0), "restarts": rep.get("restarts", 0),
                "grace_seconds": rep.get("grace_seconds", 0.0), "pool": rep.get("pool"),
                "tiers": rep.get("tiers")}

    def evict(self, name: str, to: str = "host") -> SegmentInfo:
        """Moves a segment nobody has open to host memory now (to="disk":
        to the daemon's disk tier), freeing its GPU memory; the next open
        (or load) brings it back. Owner or root; a segment open somewhere,
        pinned or a channel raises EBUSY (docs/python.md, "More models than
        GPU memory")."""
        fields = {"name": name}
        if to != "host":
            fields["to"] = to
        rep, _ = self._call("evict", **fields)
        return SegmentInfo.from_wire(rep["segment"])

    def offer(self, name: str, on: bool = True) -> SegmentInfo:
        """Offers a segment to the daemon's peers on other nodes, or with
        on=False takes it back (docs/peers.md). Owner or root."""
        fields = {"name": name}
        if on:
            fields["offer"] = True
        rep, _ = self._call("offer", **fields)
        return SegmentInfo.from_wire(rep["segment"])

    def pull(self, name: str, peer: str | None = None) -> SegmentInfo:
        """Has the daemon copy a segment a peer on another node offers into
        a new segment of the same name here (from peer, or any connected
        peer that offers it), committed once every chunk checked
        (docs/peers.md). Root, or the user it belongs to here."""
        fields = {"name": name}
        if peer:
            fields["from"] = peer
        rep, _ = self._call("pull", **fields)
        return SegmentInfo.from_wire(rep["segment"])

    def peers(self):
        """The daemon's peers on other nodes and what each offers, as the
        protocol's peers report (a dict), or None when it has none."""
        rep, _ = self._call("peers")
        return rep.get("peers")

    def sync(self, name: str) -> SegmentInfo:
        """Writes a durable segment (create or put_tensors with
        persist=True) to the daemon's disk tier now, and returns once the
        copy is durable (docs/disk.md). Owner or root."""
        rep, _ = self._call("sync", name=name)
        return SegmentInfo.from_wire(rep["segment"])

    def load(self, name: str) -> SegmentInfo:
        """Brings an evicted segment back to its GPU ahead of an open (a
        prefetch), evicting others if the GPU's budget needs room."""
        rep, _ = self._call("load", name=name)
        return SegmentInfo.from_wire(rep["segment"])

    def pin(self, name: str, on: bool = True) -> SegmentInfo:
        """Keeps a segment on its GPU (restoring it first if it was
        evicted), or with on=False lets it be evicted again. Owner or root."""
        fields = {"name": name}
        if on:
            fields["pin"] = True
        rep, _ = self._call("pin", **fields)
        return SegmentInfo.from_wire(rep["segment"])

    def _daemon_device(self, local: int) -> int:
        """The daemon's number for this process's GPU local: the daemon may
        see the node's GPUs in another order (a container,
        CUDA_VISIBLE_DEVICES), so they are matched by UUID. A daemon that
        reports no UUIDs is taken to number them as this process does."""
        uuid = _cuda.uuid_of(local)
        if uuid is None:
            raise ValueError(f"gpushm: this process has no GPU {local}")
        devs = self._devices
        if devs is None:
            devs = self._devices = {(d.get("uuid") or "").lower(): d["index"] for d in self.info()["devices"]}
        if not any(devs):
            return local
        if uuid not in devs:
            raise ValueError(f"gpushm: this process's GPU {local} ({uuid}) is not one the daemon serves")
        return devs[uuid]

    @property
    def reconnects(self) -> int:
        """How many times this client reconnected to a daemon that went away
        (a serving process that crashed or was replaced)."""
        return self._reconnects

    def stat(self, name: str) -> SegmentInfo:
        rep, _ = self._call("stat", name=name)
        return SegmentInfo.from_wire(rep["segment"])

    def list(self) -> list:
        """Every named segment, in byte order of name, without meta."""
        out, after = [], ""
        while True:
            rep, _ = self._call("list", **({"after": after} if after else {}))
            out.extend(SegmentInfo.from_wire(s) for s in rep.get("segments", []))
            after = rep.get("next", "")
            if not after:
                return out

    def unlink(self, name: str) -> None:
        """Removes the name now; the memory goes when the last user is done."""
        self._call("unlink", name=name)

    def open(self, name: str, readonly: bool = False, *, devices=None, wait: float | None = None) -> Segment:
        """Opens a segment by name. A name this client already has mapped is
        served from the mapping, without a message, as long as the daemon's
        epoch says no name has changed since.

        devices lists the GPUs that will use a cuda segment (default: its
        own GPU); all get access in one cuMemSetAccess call, reaching the
        segment's GPU over NVLink, and tensors made from it are on the first
        one listed.

        wait (seconds, at most 3600) waits for the name to name a committed
        segment: one that does not exist yet, or that its writer is still
        filling (create(uncommitted=True)). It raises WaitTimeoutError when
        the time is up, and NotFoundError when the writer it waited for went
        without committing. Without wait such an open raises at once
        (NotFoundError, or NotCommittedError). This client sends nothing
        else while it waits."""
        if self._closed:
            raise ValueError("gpushm: open on a closed client")
        readonly = bool(readonly)
        devs = tuple(int(d) for d in devices) if devices else None
        m = self._by_name.get((name, readonly, devs))
        if m is not None and m.epoch == self._epoch.value and self._pid == os.getpid():
            return Segment(m, False)
        fields = {"readonly": True} if readonly else {}
        if wait is not None:
            if not 0 < wait <= 3600:
                raise ValueError(f"gpushm: open {name!r}: wait {wait!r}: want more than 0 and at most 3600 seconds")
            fields["wait"] = float(wait)
        # Read the epoch before asking: a name changing after this makes the
        # entry look stale early, never fresh late.
        ep = self._epoch.value
        rep, fd = self._call("open", name=name, **fields)
        return Segment(self._adopt(rep["segment"], fd, readonly, ep, devs), False)

    def _adopt(self, seg: dict, fd: int, readonly: bool, ep: int, devs=None):
        info = SegmentInfo.from_wire(seg)
        m = self._by_id.get((info.id, readonly, devs))
        if m is not None:
            # Already mapped (through another name, or before the epoch
            # moved): keep the one mapping, and its lease count.
            os.close(fd)
            m.lease.count += 1
        else:
            m = _mapping.Mapping(self, info, fd, readonly, devs)
            _mapping.track(m)
            self._by_id[(info.id, readonly, devs)] = m
        m.epoch = ep
        if not info.uncommitted:
            # Nobody, this client included, opens it by name until commit.
            self._by_name[(info.name, readonly, devs)] = m
        return m

    def _forget(self, m):
        """Takes m out of the caches of opens: released or remapped, it no
        longer maps what a new open of its name or id would get."""
        for cache, key in ((self._by_name, (m.info.name, m.readonly, m.devices)),
                           (self._by_id, (m.info.id, m.readonly, m.devices))):
            if cache.get(key) is m:
                try:
                    del cache[key]
                except KeyError:  # gone meanwhile
                    pass

    def create(self, name: str, nbytes: int | None = None, *, shape=None, dtype=None, device: int | None = None,
               mode: int | None = None, exist_ok: bool = False, temporary: bool = False,
               ttl: float | None = None, uncommitted: bool = False, pin: bool = False,
               next_version: bool = False, persist: bool = False) -> Segment:
        """Creates a segment and opens it read-write.

        With shape and dtype it holds one tensor (nbytes defaults to what the
        tensor needs) and opens as that tensor anywhere; with nbytes alone it
        is raw bytes. device is the GPU ordinal (None: the daemon's default);
        mode the permission bits (None: 0o600, and for a next version the
        current version's).
        With exist_ok an existing segment of the same size, device and
        tensor is opened instead (.created tells which). temporary ends the
        segment when this client's connection closes (exit and crash
        included); ttl (seconds) ends it once nobody has had it open that
        long.

        uncommitted=True makes a segment nobody else can open until this
        client commits it (Segment.commit()): fill it, commit it, and no
        reader ever sees it half written. Its name is taken at once; it is
        listed with .uncommitted set; and it goes if this client lets go of
        it (every view of it gone, or close()) or its connection ends
        before the commit. Not with exist_ok.

        pin=True keeps it on its GPU: the daemon never evicts it to host
        memory to make room for others.

        persist=True makes it durable (a daemon with --disk): its bytes go
        to disk after its commit and at each sync(), and it is listed again
        after a reboot (docs/disk.md).

        next_version=True makes the next version of the name (implies
        uncommitted): the new segment takes no name while this client fills
        it, and commit() makes it the name's current version in one step,
        in place of the one readers have, who move to it with
        Segment.refresh(). A writer that goes before its commit leaves the
        current version. It needs the right to remove the current version
        (its owner, or root), and takes its owner, and its mode unless mode
        is given; a name that does not exist yet is simply created at the
        commit. The commit replaces only what the name named at this
        create, and only while this client may still remove it: else it
        raises (ExistsError, NotFoundError, PermissionDeniedError) and the
        version stays uncommitted (docs/python.md, "Release, reacquire and
        versions")."""
        lay = None
        if shape is not None or dtype is not None:
            lay = layout_of(shape, dtype, nbytes, "create")
            if nbytes is None:
                nbytes = lay.nbytes
            elif nbytes < lay.nbytes:
                raise ValueError(f"gpushm: nbytes {nbytes} is smaller than the {lay.nbytes} bytes of {lay.dtype.name}{list(lay.shape)}")
            # The daemon allocates at least a byte; the meta keeps the shape.
            nbytes = max(nbytes, 1)
        elif nbytes is None:
            raise TypeError("gpushm: create needs nbytes, or shape and dtype")
        return self._create(name, nbytes, lay.meta() if lay else None, device, mode, exist_ok, temporary, ttl,
                            uncommitted, pin, next_version, persist)

    def _create(self, name, nbytes, meta, device, mode, exist_ok, temporary=False, ttl=None,
                uncommitted=False, pin=False, next_version=False, persist=False) -> Segment:
        fields = {"name": name, "size": int(nbytes), "open": True}
        if mode is not None:  # else 0o600, or a next version's current version's
            fields["mode"] = int(mode)
        fields.update(_lifetime(temporary, ttl))
        if uncommitted or next_version:
            fields["uncommitted"] = True
        if next_version:
            fields["next_version"] = True
        if pin:
            fields["pin"] = True
        if persist:
            fields["persist"] = True
        if device is not None:
            fields["device"] = int(device)
        if meta is not None:
            fields["meta"] = meta
        if exist_ok:
            fields["exist_ok"] = True
        ep = self._epoch.value
        rep, fd = self._call("create", **fields)
        seg = Segment(self._adopt(rep["segment"], fd, False, ep), bool(rep.get("created")))
        if not seg.created and meta is not None and seg.meta != meta:
            raise error("EEXIST", f"create: segment {name!r} exists with meta {json.dumps(seg.meta)}, not {json.dumps(meta)}")
        return seg

    # ---- tensors ----------------------------------------------------------

    def share(self, name: str, tensor, *, device: int | None = None, mode: int = 0o600,
              temporary: bool = True, ttl: float | None = None) -> Segment:
        """Copies a tensor (torch, CuPy, JAX, numpy, or anything with
        __dlpack__) into a new segment that opens as the same tensor. A GPU
        tensor goes to a segment on its GPU; a host tensor to the daemon's
        default device (host memory on a host daemon). A shared tensor is
        temporary by default: it ends with this client's connection, so a
        crashed producer leaves nothing behind; pass temporary=False to keep
        it until unlinked."""
        with _dlpack.borrow(tensor) as src:
            lay = Layout(src.dtype, src.shape, src.strides)
            if not lay.dense:
                raise ValueError(f"gpushm: share {name!r}: the tensor has gaps in memory (a strided slice); make it contiguous first")
            # Keep a dense layout as it lies (a transpose stays a transpose):
            # copy its extent, and note where element 0 falls in it.
            lo, span = lay.lo, lay.hi - lay.lo
            lay = Layout(lay.dtype, lay.shape, lay.strides, -lo)
            if device is None and src.on_gpu and self.backend == "cuda":
                device = self._daemon_device(src.device_id)
            seg = self._create(name, max(span, 1), lay.meta(), device, mode, False, temporary, ttl, True)
            try:
                _dlpack.copy_in(seg._m, 0, src, src.ptr + lo, span)
                seg.commit()
            except BaseException:
                self._abandon(seg)
                raise
        return seg

    def _commit(self, m):
        """Commits the uncommitted segment m maps (Segment.commit)."""
        if m.dev is not None:
            # The writes of every stream of this process to it are done.
            m.dev.synchronize()
        ep = self._epoch.value
        rep, _ = self._call("commit", segment=m.info.id)
        m.info = SegmentInfo.from_wire(rep["segment"])
        # A next version's commit moves the epoch itself: the next stale()
        # or refresh() of this mapping asks once.
        m.epoch = ep
        self._by_name.setdefault((m.info.name, m.readonly, None), m)

    def _abandon(self, seg):
        """Ends a segment this client created uncommitted and could not
        fill: the daemon removes it once its lease ends."""
        m = seg._m
        seg.close()
        if m is not None and m.info.uncommitted:
            m.lease.end()
