"""publish: a torch CUDA tensor named where it lies, without a copy
(gpushm.torch.publish, Client.publish). The tensor's allocation goes to the
daemon as a descriptor (_alloc.export); the client core only carries the
request."""

from __future__ import annotations

import os
import weakref

from . import _alloc
from ._core import _lifetime
from ._info import SegmentInfo
from ._tensors import Layout

# client -> {name: tensor}: a published tensor is referenced as long as the
# client that published it, so that PyTorch's caching allocator cannot hand
# its memory to another tensor meanwhile.
_published = weakref.WeakKeyDictionary()


def publish(client, name: str, tensor, *, mode: int = 0o600, temporary: bool = False,
            ttl: float | None = None) -> SegmentInfo:
    """Names a torch CUDA tensor where it lies, without a copy: the
    daemon receives its allocation's descriptor and keeps it, so the name
    stays valid after this process exits, until unlinked. The tensor must
    live in exportable memory: allocated under gpushm.torch.shareable(),
    or in a program run with gpushm's LD_PRELOAD library. Its dtype,
    shape, strides and offset travel in the segment's meta, so open(name)
    gives the same tensor back. The client keeps a reference to the
    tensor, so PyTorch's caching allocator cannot hand its memory to
    another tensor while it is published. The whole allocation is shared
    (neighbouring tensors included): see docs/security.md."""
    import torch  # here: importing gpushm must not import torch
    if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
        raise TypeError("gpushm: publish takes a torch CUDA tensor (use share to copy anything else)")
    # The daemon and importers see the bytes as they are now: finish the
    # writes queued on the tensor's device.
    torch.cuda.synchronize(tensor.device)
    fd, base, alloc, dev = _alloc.export(tensor.data_ptr())
    try:
        lay = Layout(tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()),
                     tensor.data_ptr() - base)
        fields = {"name": name, "size": int(alloc), "device": client._daemon_device(int(dev)), "mode": int(mode),
                  "meta": lay.meta()}
        fields.update(_lifetime(temporary, ttl))
        rep, _ = client._call("publish", _send_fd=fd, **fields)
    finally:
        os.close(fd)
    _published.setdefault(client, {})[name] = tensor
    return SegmentInfo.from_wire(rep["segment"])
