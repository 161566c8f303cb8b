"""gpushm: named GPU memory segments shared between processes ("/dev/shm
for GPUs"). This is the Python client of the gpushm daemon; docs/python.md
describes it and docs/protocol.md the protocol it speaks.

    import gpushm, torch
    c = gpushm.connect()
    c.share("x", torch.arange(10, device="cuda"))       # one process; lives while c does
    x = torch.from_dlpack(gpushm.connect().open("x"))   # another, no copy
"""

from ._binary import binary
from ._bundle import Bundle
from ._channel import BrokenMessageError, Channel, ChannelRemovedError, Message, NoConsumerError
from ._client import Client, connect
from ._core import SYSTEM_SOCKET, default_socket, socket_candidates
from ._cuda import CUDAError
from ._errors import (BusyError, Error, ExistsError, InvalidError, NoSpaceError, NotCommittedError, NotFoundError,
                      OutOfMemoryError, PermissionDeniedError, StaleError, WaitTimeoutError)
from ._info import HeldVersion, SegmentInfo
from ._segment import Segment
from ._trust import UntrustedSocketError
from ._view import View

__all__ = ["BrokenMessageError", "Bundle", "BusyError", "CUDAError", "Channel", "ChannelRemovedError", "Client",
           "Error", "ExistsError", "HeldVersion", "InvalidError", "Message", "NoConsumerError", "NoSpaceError",
           "NotCommittedError", "NotFoundError",
           "OutOfMemoryError", "PermissionDeniedError", "Segment", "SegmentInfo", "StaleError", "UntrustedSocketError",
           "View", "WaitTimeoutError", "connect", "binary", "default_socket", "socket_candidates", "SYSTEM_SOCKET"]
__version__ = "0.1.0"


def __getattr__(name):
    # gpushm.torch and gpushm.transformers import torch, which most users of
    # gpushm need not pay for; gpushm.safetensors imports them when asked.
    if name in ("torch", "transformers", "safetensors"):
        import importlib
        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'gpushm' has no attribute {name!r}")
