"""A segment mapped into this process, and the lease that goes with it.

Lifetime: a Mapping is referenced by the Segments and views made from it and,
through DLPack, by every framework tensor made from those. When the last
reference goes, a weakref finalizer unmaps the memory and ends the lease(s)
with the daemon. Nothing unmaps memory that a live object can still reach, so
closing a Segment while a tensor made from it lives is safe: the tensor keeps
the mapping.

Host segments are mapped with libc's mmap through ctypes rather than Python's
mmap module, which would hold a duplicate of the descriptor for as long as
the mapping lives (one fd per mapped segment, against RLIMIT_NOFILE).
"""

from __future__ import annotations

import ctypes
import os
import warnings
import weakref

from . import _cuda

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
PROT_READ, PROT_WRITE, MAP_SHARED = 1, 2, 1


def mmap(fd: int, length: int, writable: bool) -> int:
    p = _libc.mmap(None, length, PROT_READ | (PROT_WRITE if writable else 0), MAP_SHARED, fd, 0)
    if p is None or p == _MAP_FAILED:
        e = ctypes.get_errno()
        raise OSError(e, f"gpushm: mmap of {length} bytes: {os.strerror(e)}")
    return p


def munmap(ptr: int, length: int) -> None:
    if _libc.munmap(ptr, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"gpushm: munmap: {os.strerror(e)}")


class Lease:
    """The daemon-side opens behind one mapping. They end when the mapping
    goes; the client sends the closes when it safely can (see
    Client._release)."""

    __slots__ = ("client", "segment", "count")

    def __init__(self, client, segment: int):
        self.client, self.segment, self.count = client, segment, 1

    def end(self):
        client, self.client = self.client, None
        if client is not None:
            client._release(self.segment, self.count)


def _unmap(dev, ptr, alloc, lease):
    try:
        if dev is None:
            munmap(ptr, alloc)
        else:
            dev.unmap(ptr, alloc)
    except Exception as e:
        # Leaving the range mapped leaks it; unmapping harder is impossible.
        warnings.warn(f"gpushm: unmapping a segment failed, its memory stays mapped: {e}", RuntimeWarning)
    finally:
        lease.end()


class Mapping:
    __slots__ = ("info", "ptr", "size", "alloc", "dev", "readonly", "epoch", "lease", "cache", "_fin", "__weakref__")

    def __init__(self, client, info, fd: int, readonly: bool, devices=None):
        """Maps fd (which this call closes, always) as the segment info
        describes; the lease taken by the open that sent fd becomes this
        mapping's."""
        self.info, self.readonly = info, readonly
        self.size, self.alloc = info.size, info.alloc_size
        self.epoch = 0
        self.cache = {}  # parsed views of the segment: layout, bundle
        lease = Lease(client, info.id)
        try:
            if info.handle_type == "memfd":
                self.dev = None
                self.ptr = mmap(fd, self.alloc, not readonly)
            elif info.handle_type == "cuda_fd":
                # Tensors live on the first GPU that asked for access: the
                # address is valid there through the mapping (UVA).
                home = _cuda.ordinal_of(info.uuid) if info.uuid else info.device
                access = list(devices) if devices else [home]
                self.dev = _cuda.device(access[0])
                self.ptr = self.dev.import_map(fd, self.alloc, readonly, access)
            else:
                raise OSError(f"gpushm: segment {info.name!r} has handle type {info.handle_type!r}, which this client cannot map")
        except BaseException:
            lease.end()
            raise
        finally:
            os.close(fd)
        self.lease = lease
        self._fin = weakref.finalize(self, _unmap, self.dev, self.ptr, self.alloc, lease)
        # At exit the process unmaps everything anyway; unmapping earlier,
        # while frameworks may still hold tensors, could only crash.
        self._fin.atexit = False

    @property
    def device(self):
        """The GPU ordinal, or None for host memory."""
        return None if self.dev is None else self.dev.ordinal

    def check(self, off: int, n: int):
        if off < 0 or n < 0 or off + n > self.size:
            raise ValueError(f"gpushm: {n} bytes at offset {off} are outside the segment's {self.size} bytes")

    def read(self, off: int, n: int) -> bytes:
        self.check(off, n)
        if self.dev is None:
            return ctypes.string_at(self.ptr + off, n)
        buf = ctypes.create_string_buffer(n)
        _cuda.copy(ctypes.addressof(buf), None, self.ptr + off, self.dev, n)
        return buf.raw

    def write(self, data, off: int) -> int:
        if self.readonly:
            raise PermissionError(f"gpushm: segment {self.info.name!r} is mapped read-only")
        mv = memoryview(data).cast("B")
        self.check(off, len(mv))
        if mv.readonly:
            src = ctypes.c_char_p(mv.tobytes()) if not isinstance(data, bytes) else ctypes.c_char_p(data)
            keep = src
        else:
            keep = (ctypes.c_char * len(mv)).from_buffer(mv)
        _cuda.copy(self.ptr + off, self.dev, ctypes.cast(keep, ctypes.c_void_p).value or 0, None, len(mv))
        return len(mv)

    def memoryview(self, off: int, n: int) -> memoryview:
        """A view of host memory that keeps this mapping alive."""
        if self.dev is not None:
            raise TypeError(f"gpushm: segment {self.info.name!r} is GPU memory; use DLPack (torch.from_dlpack) or read()")
        self.check(off, n)
        arr = (ctypes.c_ubyte * n).from_address(self.ptr + off)
        arr._gpushm_mapping = self
        mv = memoryview(arr)
        try:
            # ctypes exports format "<B", which memoryview cannot index or
            # assign to; a numpy array over it exports plain "B" and keeps
            # arr, and so this mapping, alive.
            import numpy

            mv = memoryview(numpy.frombuffer(arr, dtype=numpy.uint8))
        except ImportError:
            pass
        return mv.toreadonly() if self.readonly else mv
