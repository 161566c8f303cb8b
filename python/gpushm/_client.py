"""Client: the client core (_core) with its features, channels (_channel),
bundles (_bundle) and publish (_publish), composed; and connect. The core
names none of them: a feature adds its methods here, and what it holds of
the daemon besides its segments' leases it hands to the core through its
hook (Core._hold), as the Go client's features do through holder."""

from __future__ import annotations

from . import _publish
from ._bundle import Bundles
from ._channel import Channels
from ._core import Core
from ._info import SegmentInfo


class Client(Core, Channels, Bundles):
    """A connection to the daemon. Close it (or use it as a context manager)
    to end its leases; memory still used by live tensors stays mapped until
    they go."""

    def publish(self, name: str, tensor, *, mode: int = 0o600, temporary: bool = False,
                ttl: float | None = None) -> SegmentInfo:
        """Names a torch CUDA tensor where it lies, without a copy:
        gpushm.torch.publish(self, name, tensor, ...), whose help says how
        and what memory it takes."""
        return _publish.publish(self, name, tensor, mode=mode, temporary=temporary, ttl=ttl)


def connect(socket: str | None = None, *, timeout: float | None = None, spin_us: int = 0,
            reconnect: float | None = None) -> Client:
    """Connects to the daemon at socket, else at the first of
    socket_candidates() that answers; the client's socket attribute is the
    one it reached, and it reconnects there, never to another candidate.
    When none answers, the error (FileNotFoundError, ConnectionRefusedError,
    PermissionError, ... as the last path's) names every path tried.

    Before it sends anything, on every connection, reconnections included,
    the client checks who it talks to (docs/security.md, "Finding the
    daemon"): the daemon's SO_PEERCRED uid must be the caller's, root's, or
    $GPUSHM_DAEMON_UID; a candidate found by convention must be in a
    directory no other user could have made or could write, else it is
    skipped with the reason. A refused socket raises UntrustedSocketError
    (a PermissionError) when it is the last or the only one.

    timeout bounds each wait for a reply (and for the daemon to take a
    request), in seconds (default $GPUSHM_TIMEOUT or 60; 0 waits for ever),
    so that a daemon that never answers cannot hang the caller: the call
    raises TimeoutError, and the client is unusable after it. spin_us polls
    for each reply that long before sleeping: CPU traded for latency where
    waking a sleeping thread is slow (virtual machines). reconnect is how long, in
    seconds, an operation waits for a daemon that went away (restarted,
    upgraded) to come back (default $GPUSHM_RECONNECT or 30; 0 never
    reconnects): the client then reclaims its leases and temporary segments
    and retries the operation; mappings keep working throughout."""
    return Client(socket, timeout=timeout, spin_us=spin_us, reconnect=reconnect)
