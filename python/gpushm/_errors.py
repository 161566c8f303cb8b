"""The errors the daemon reports, as Python exceptions (docs/protocol.md,
"Errors"). It imports nothing of gpushm's, so every module can use it."""

from __future__ import annotations

import errno


class Error(OSError):
    """An error reported by the daemon. .code is the protocol's errno name
    ("ENOENT"), .errno the number; the message is the daemon's. Each is also
    the matching builtin: FileNotFoundError, FileExistsError,
    PermissionError, MemoryError or ValueError."""

    code = "EIO"


class NotFoundError(Error, FileNotFoundError):
    pass


class ExistsError(Error, FileExistsError):
    pass


class PermissionDeniedError(Error, PermissionError):
    pass


class OutOfMemoryError(Error, MemoryError):
    pass


class InvalidError(Error, ValueError):
    pass


class BusyError(Error):
    """EBUSY: the segment is in use in a way that forbids the operation (a
    channel's producer or consumer role that another process holds)."""


class NoSpaceError(Error):
    """ENOSPC: no room: a quota, or a GPU's budget that evicting every
    segment that may move would not bring under (the message says which)."""


class NotCommittedError(Error, BlockingIOError):
    """EAGAIN: the segment is still being written; its writer has not
    committed it (open it with wait= to wait for that)."""


class WaitTimeoutError(Error, TimeoutError):
    """ETIMEDOUT: an open's wait for a commit, or a wait for a new version
    (Segment.wait_version), ran out."""


class StaleError(Error):
    """ESTALE: Segment.reacquire of a version its name no longer names (a
    newer one was made current); Segment.refresh maps that one."""


_ERRORS = {"ENOENT": NotFoundError, "EEXIST": ExistsError, "EACCES": PermissionDeniedError,
           "EPERM": PermissionDeniedError, "ENOMEM": OutOfMemoryError, "EINVAL": InvalidError,
           "ENAMETOOLONG": InvalidError, "ENODEV": InvalidError, "EBUSY": BusyError,
           "EAGAIN": NotCommittedError, "ETIMEDOUT": WaitTimeoutError, "ENOSPC": NoSpaceError, "ESTALE": StaleError}


def error(code: str, message: str) -> Error:
    cls = _ERRORS.get(code, Error)
    e = cls(getattr(errno, code, errno.EIO), f"gpushm: {message}")
    e.code = code
    return e
