"""PyTorch and gpushm: tensors of a bundle as a state dict, and an allocator
whose memory can be exported.

    import gpushm.torch
    sd = gpushm.torch.state_dict("llama")          # zero-copy, read-only
    model.load_state_dict(sd, assign=True)

    with gpushm.torch.shareable():
        model = torch.nn.Linear(4096, 4096).cuda()   # exportable memory
    gpushm.connect().publish("w", model.weight)       # no copy

state_dict() maps a bundle once per process and makes a torch tensor of
each of its tensors. shareable() routes PyTorch's allocations to
native/libgpushm_alloc.so through torch.cuda.memory.CUDAPluggableAllocator
and a MemPool; export() turns any pointer into such memory into a
descriptor for the daemon. See docs/allocator.md for the library, and for
LD_PRELOAD, its way to do the same for unmodified programs.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading

import torch

_lock = threading.Lock()
_clients = {}  # socket -> Client, one per process
_lib = None
_allocator = None
# Pools live as long as the process: a tensor allocated from a pool must not
# outlive it, and nothing tells us when the last one goes.
_pools = []


def library_path() -> str:
    """Finds libgpushm_alloc.so: $GPUSHM_ALLOC_LIB, beside this package, or
    built from the repository's native/gpushm_alloc.c with cc into a cache
    (it needs no CUDA toolkit)."""
    env = os.environ.get("GPUSHM_ALLOC_LIB")
    if env:
        return env
    here = pathlib.Path(__file__).resolve().parent
    for p in (here / "libgpushm_alloc.so", here.parent.parent / "native" / "libgpushm_alloc.so"):
        if p.exists():
            return str(p)
    src = here.parent.parent / "native" / "gpushm_alloc.c"
    cc = shutil.which("cc") or shutil.which("gcc")
    if src.exists() and cc:
        cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "gpushm"
        cache.mkdir(parents=True, exist_ok=True)
        out = cache / "libgpushm_alloc.so"
        if not out.exists() or out.stat().st_mtime < src.stat().st_mtime:
            tmp = tempfile.mktemp(dir=cache, suffix=".so")
            subprocess.run([cc, "-std=c11", "-shared", "-fPIC", "-O2", "-o", tmp, str(src), "-ldl", "-lpthread"],
                           check=True, capture_output=True)
            os.replace(tmp, out)
        return str(out)
    raise FileNotFoundError("gpushm: libgpushm_alloc.so not found: set GPUSHM_ALLOC_LIB, or build it with 'make -C native'")


def _library():
    global _lib
    with _lock:
        if _lib is None:
            lib = ctypes.CDLL(library_path())
            lib.gpushm_export.argtypes = [ctypes.c_uint64, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64),
                                          ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_int)]
            lib.gpushm_export.restype = ctypes.c_int
            lib.gpushm_alloc_stats.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64)]
            lib.gpushm_alloc_stats.restype = ctypes.c_int
            lib.gpushm_last_error.restype = ctypes.c_char_p
            _lib = lib
        return _lib


def _pluggable():
    global _allocator
    with _lock:
        if _allocator is None:
            _allocator = torch.cuda.memory.CUDAPluggableAllocator(library_path(), "gpushm_malloc", "gpushm_free")
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


def export(ptr: int):
    """Exports the allocation holding device address ptr: returns (fd, base,
    alloc_size, device); the caller owns fd. Fails for memory that did not
    come from the gpushm allocator."""
    lib = _library()
    fd, base, size, dev = ctypes.c_int(-1), ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_int()
    r = lib.gpushm_export(ptr, ctypes.byref(fd), ctypes.byref(base), ctypes.byref(size), ctypes.byref(dev))
    if r != 0:
        why = (lib.gpushm_last_error() or b"").decode(errors="replace")
        raise ValueError(f"gpushm: address {ptr:#x} is not in exportable memory ({why or r}): allocate the tensor "
                         "under gpushm.torch.shareable(), or run the program with gpushm's LD_PRELOAD library")
    return fd.value, base.value, size.value, dev.value


def stats():
    """(live allocations, live bytes) of the gpushm allocator in this process."""
    n, b = ctypes.c_uint64(), ctypes.c_uint64()
    _library().gpushm_alloc_stats(ctypes.byref(n), ctypes.byref(b))
    return n.value, b.value


def _client(c=None):
    """c, or this process's shared connection to the default daemon."""
    if c is not None:
        return c
    from . import _client
    sock = _client.default_socket()
    with _lock:
        got = _clients.get(sock)
        if got is None or got._closed or got._broken or got._pid != os.getpid():
            got = _clients[sock] = _client.connect(sock)
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
    b = _client(client).tensors(name, readonly=readonly)
    with torch.inference_mode() if readonly else contextlib.nullcontext():
        return {k: torch.from_dlpack(v) for k, v in b.items()}
