"""Who a client talks to (docs/security.md, "Finding the daemon"), as the
Go client decides it (trust.go): a socket found by convention only in a
directory no other user could have made or could write, and, on every
connection, before anything is sent, a daemon whose SO_PEERCRED uid is the
caller's, root's or $GPUSHM_DAEMON_UID's. The messages are the Go
client's, word for word."""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct

# How a client came to a socket path.
GIVEN = "given"  # connect()'s argument or $GPUSHM_SOCKET: the operator's choice
OWN = "own"      # the user's own socket, found by convention (/tmp: anybody could make it first)
NODE = "node"    # SYSTEM_SOCKET, found by convention

_UCRED = struct.Struct("iII")  # pid, uid, gid


class UntrustedSocketError(PermissionError):
    """A socket, or the daemon answering on it, failed the client's checks
    of who owns it: the client sent it nothing."""

    def __init__(self, text: str):
        super().__init__(errno.EACCES, text)
        self.text = text


def _refuse(what: str, why: str) -> UntrustedSocketError:
    return UntrustedSocketError(f"{what}: {why}")


# Who the overflow uid may be, where root is one of them.
_UNSURE = "the overflow uid: root's, or any user this user namespace does not map"


def _dedicated(uid: int) -> str:
    return f"set GPUSHM_DAEMON_UID={uid} if that user runs the node's daemon"


def _open_mode(st, d: str) -> str:
    return f"mode {stat.S_IMODE(st.st_mode):04o} lets group or others replace the socket: skipped (chmod go-w {d})"


def _read_int(path: str, default: int) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return default


def _maps_root(uid_map: str) -> bool:
    """Whether a uid_map maps the outer uid 0 into this user namespace."""
    for line in uid_map.splitlines():
        f = line.split()
        if len(f) == 3 and f[1] == "0" and int(f[2]) > 0:
            return True
    return False


class Trust:
    """Who a client accepts as the owner of a socket and as the daemon
    answering on it: itself, root, and the node's dedicated daemon user if
    $GPUSHM_DAEMON_UID names one. In a user namespace that does not map
    root, the node's daemon reads as the overflow uid, as does any other
    user the namespace does not map: it is trusted only on a path given
    explicitly."""

    def __init__(self):
        self.euid = os.geteuid()
        self.daemon_uid = -1
        v = os.environ.get("GPUSHM_DAEMON_UID")
        if v:
            if not v.isdigit() or int(v) >= 1 << 31:
                raise ValueError(f"gpushm: GPUSHM_DAEMON_UID=\"{v}\" is not a uid: "
                                 "set it to the node daemon's numeric uid, or unset it")
            self.daemon_uid = int(v)
        self.overflow = _read_int("/proc/sys/kernel/overflowuid", 65534)
        try:
            with open("/proc/self/uid_map") as f:
                self.root_unmapped = not _maps_root(f.read())
        except OSError:
            self.root_unmapped = False

    def trusted(self, uid: int) -> bool:
        return uid in (self.euid, 0) or (self.daemon_uid >= 0 and uid == self.daemon_uid)

    def unmapped_root(self, uid: int) -> bool:
        return self.root_unmapped and uid == self.overflow

    def check_path(self, path: str, origin: str):
        """Refuses a socket found by convention whose directory (or, for the
        user's own, the socket itself) another user could have made or
        could replace; lstat's errors (no such file) pass through."""
        if origin == OWN:
            self._check_own_dir(os.path.dirname(path))
            self._check_own_socket(path)
        elif origin == NODE:
            self._check_node_dir(path)

    def _check_own_dir(self, d: str):
        st = os.lstat(d)
        if stat.S_ISLNK(st.st_mode):
            raise _refuse(d, "a symbolic link, not a directory: skipped (another user may have made it)")
        if not stat.S_ISDIR(st.st_mode):
            raise _refuse(d, "not a directory: skipped")
        if st.st_uid != self.euid:
            raise _refuse(d, f"owned by uid {st.st_uid}, not you: skipped (another user may have made it)")
        if st.st_mode & 0o022:
            raise _refuse(d, _open_mode(st, d))

    def _check_own_socket(self, path: str):
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            raise _refuse(path, "not a socket: skipped")
        if st.st_uid not in (self.euid, 0):
            raise _refuse(path, f"owned by uid {st.st_uid}, neither you nor root: "
                                "skipped (another user may have put it there)")

    def _check_node_dir(self, path: str):
        # Only root may make a directory in /run: a symbolic link there is
        # root's, and is followed.
        d = os.path.dirname(path)
        st = os.stat(d)
        if not stat.S_ISDIR(st.st_mode):
            raise _refuse(d, "not a directory: skipped")
        uid = st.st_uid
        if self.unmapped_root(uid):
            raise _refuse(d, f"owned by uid {uid}, {_UNSURE}: skipped (set GPUSHM_SOCKET={path} to trust it)")
        if not self.trusted(uid):
            raise _refuse(d, f"owned by uid {uid}, neither root nor you: skipped "
                             f"(another user may have made it; {_dedicated(uid)})")
        if st.st_mode & 0o022:
            raise _refuse(d, _open_mode(st, d))

    def check_peer(self, s: socket.socket, path: str, origin: str):
        """Refuses the daemon at the other end of s, connected to path and
        sent nothing yet, unless it is trusted."""
        _, uid, _ = _UCRED.unpack(s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        if self.trusted(uid) or (self.unmapped_root(uid) and origin == GIVEN):
            return
        if self.unmapped_root(uid):
            raise _refuse(path, f"the daemon answering reads as uid {uid}, {_UNSURE}: "
                                f"refused, nothing sent (set GPUSHM_SOCKET={path} to trust it)")
        raise _refuse(path, f"the daemon answering runs as uid {uid}, neither you (uid {self.euid}) nor root: "
                            f"refused, nothing sent (another user may run it; {_dedicated(uid)})")
