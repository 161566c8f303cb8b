"""libgpushm_alloc.so, gpushm's CUDA allocator, through ctypes: where it
is, and export(), which turns a pointer into its memory into a descriptor
for the daemon (Client.publish). It imports neither torch nor the client:
gpushm.torch routes PyTorch's allocations to the library, and the client
publishes what it allocated. docs/allocator.md describes the library."""

from __future__ import annotations

import ctypes
import os
import pathlib
import shutil
import subprocess
import tempfile
import threading

_lock = threading.Lock()
_lib = None


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
        # The source includes the Go package's VMM header.
        newest = max(p.stat().st_mtime for p in (src, src.parent.parent / "internal" / "cuda" / "vmm.h") if p.exists())
        if not out.exists() or out.stat().st_mtime < newest:
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
