"""PyTorch and gpushm: tensors of a bundle as a state dict, an allocator
whose memory can be exported, and publish(), which names a tensor in such
memory where it lies.

    import gpushm.torch
    sd = gpushm.torch.state_dict("llama")          # zero-copy, read-only
    model.load_state_dict(sd, assign=True)

    with gpushm.torch.shareable():
        model = torch.nn.Linear(4096, 4096).cuda()   # exportable memory
    gpushm.torch.publish(gpushm.connect(), "w", model.weight)   # no copy

state_dict() maps a bundle once per process and makes a torch tensor of
each of its tensors. release(), reacquire() and refresh() give the memory
behind a model's tensors back, map it again, or move it to the name's
newest version, all at the same addresses (docs/python.md, "Release,
reacquire and versions"):

    gpushm.torch.release(model)        # GPU memory free for others; addresses kept
    gpushm.torch.reacquire(model)      # the same tensors work again
    gpushm.torch.refresh(model)        # the weights a writer made current shareable() routes PyTorch's allocations to
native/libgpushm_alloc.so through torch.cuda.memory.CUDAPluggableAllocator
and a MemPool; export() turns any pointer into such memory into a
descriptor for the daemon. See docs/allocator.md for the library, and for
LD_PRELOAD, its way to do the same for unmodified programs.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading

import torch

from . import _alloc, _mapping
from ._alloc import export, library_path, stats  # noqa: F401  (gpushm.torch.export, as documented)
from ._client import connect
from ._core import socket_candidates
from ._publish import publish  # noqa: F401  (gpushm.torch.publish, as documented)
from ._segment import Segment
from ._view import View

_lock = threading.Lock()
_clients = {}  # socket_candidates() -> Client, one per process
_allocator = None
# Pools live as long as the process: a tensor allocated from a pool must not
# outlive it, and nothing tells us when the last one goes.
_pools = []


def _pluggable():
    global _allocator
    with _lock:
        if _allocator is None:
            _allocator = torch.cuda.memory.CUDAPluggableAllocator(_alloc.library_path(), "gpushm_malloc", "gpushm_free")
        return _allocator


@contextlib.contextmanager
def shareable(device=None):
    """Inside the block, CUDA allocations on device (default: the current
    one) come from a pool of exportable memory; tensors made there can be
    published."""
    pool = torch.cuda.MemPool(_pluggable().allocator())
    _pools.append(pool)
    with torch.cuda.use_mem_pool(pool, device=device):
        yield pool


def _client(c=None):
    """c, or this process's shared connection to the default daemon."""
    if c is not None:
        return c
    where = tuple(socket_candidates())
    with _lock:
        got = _clients.get(where)
        if got is None or got._closed or got._broken or got._pid != os.getpid():
            got = _clients[where] = connect()
        return got


def state_dict(name: str, readonly: bool = True, client=None) -> dict:
    """The tensors of bundle name as torch tensors by name, in header
    order, sharing the segment's memory (nothing is copied; on a GPU they
    live on the segment's GPU).

    With readonly (the default) the segment is mapped read-only, and the
    tensors are made as inference tensors (inside torch.inference_mode()),
    so that an in-place update outside inference mode raises RuntimeError
    ("Inplace update to inference tensor outside InferenceMode is not
    allowed") before any kernel runs. A write that gets past that (inside
    inference mode, or by a kernel given the address) faults on the GPU's
    read-only mapping: CUDA reports an illegal memory access and this
    process's CUDA context is lost, while the shared copy stays intact for
    every other process. docs/python.md has the details."""
    return _torch_tensors(_client(client).tensors(name, readonly=readonly), readonly)


def _torch_tensors(bundle, readonly: bool) -> dict:
    """Torch tensors of a Bundle's Views, each its own storage as a
    checkpoint loader makes them (save_pretrained and safetensors tell
    tensors apart by storage). Each is made from a DLPack capsule handed
    to torch directly: given the View, torch would negotiate a version and
    a stream for every tensor, for nothing (gpushm queues no work on the
    memory, see View.__dlpack__)."""
    from_dlpack = torch.from_dlpack
    with torch.inference_mode() if readonly else contextlib.nullcontext():
        return {k: from_dlpack(v.__dlpack__()) for k, v in bundle.items()}


# ---- release, reacquire, refresh -------------------------------------------

def release(obj) -> None:
    """Releases the gpushm segments behind obj's tensors (Segment.release):
    their memory goes back to the daemon, which may evict it to host memory,
    and their addresses stay reserved, so that the tensors, and CUDA graphs
    captured over them, work again after reacquire() or refresh(); until
    then touching them faults. obj is an nn.Module (its parameters and
    buffers), a state dict or any dict of tensors, a tensor, a gpushm View,
    or a list or tuple of those; each segment is released once. Tensors
    not made from gpushm memory are left alone; if none is, ValueError."""
    for m in _mappings(obj, "release"):
        m.release()


def reacquire(obj) -> None:
    """Maps the released segments behind obj's tensors again at the same
    addresses (Segment.reacquire): the tensors hold the same bytes as
    before. A segment whose name names a newer version now raises
    gpushm.StaleError and stays released; refresh() maps the new one."""
    for m in _mappings(obj, "reacquire"):
        m.remap(False)


def refresh(obj) -> bool:
    """Maps the version each segment behind obj's tensors names now at the
    same addresses (Segment.refresh), and reports whether any changed. A
    bundle (put_tensors, 'gpushm put') switches as a whole: its new version
    must lay out the same tensors (names, dtypes, shapes, offsets) as the
    mapped one, since the tensors made before point at those offsets;
    otherwise refresh raises gpushm.InvalidError and leaves that segment's
    old version mapped. Segments are refreshed one after another: an error
    leaves those before it refreshed and those after it as they were.
    Synchronizes each segment's GPU first; the work of other threads and
    processes on the old version must be over."""
    changed = False
    for m in _mappings(obj, "refresh"):
        changed |= m.remap(True)
    return changed


def segments(obj) -> list:
    """The gpushm Segments behind obj's tensors (as release() finds them),
    one per mapping, in the order first met: their version, stale(),
    wait_version() and refresh() act on the memory the tensors use."""
    return [Segment(m, False) for m in _mappings(obj, "segments")]


def _mappings(obj, what: str) -> list:
    ptrs = []
    _pointers(obj, ptrs)
    found = _mapping.behind(ptrs)
    if not found:
        raise ValueError(f"gpushm: {what}: no tensor of the {type(obj).__name__} given lies in gpushm memory")
    return found


def _pointers(obj, out: list):
    """Appends the data pointers of the tensors in obj to out."""
    if isinstance(obj, torch.Tensor):
        out.append(obj.data_ptr())
    elif isinstance(obj, torch.nn.Module):
        out.extend(t.data_ptr() for t in itertools.chain(obj.parameters(), obj.buffers()))
    elif isinstance(obj, View):
        out.append(obj.ptr)
    elif isinstance(obj, dict):
        for v in obj.values():
            _pointers(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _pointers(v, out)
    else:
        raise TypeError(f"gpushm: {type(obj).__name__} is not a module, a tensor, or a dict or list of them")
