"""A segment mapped into this process, and the lease that goes with it.

Lifetime: a Mapping is referenced by the Segments and views made from it and,
through DLPack, by every framework tensor made from those. When the last
reference goes, a weakref finalizer unmaps the memory and ends the lease(s)
with the daemon. Nothing unmaps memory that a live object can still reach, so
closing a Segment while a tensor made from it lives is safe: the tensor keeps
the mapping.

Release, reacquire and refresh (docs/python.md, "Release, reacquire and
versions") change what a mapping holds while its addresses stay: release
gives the memory and the lease back and keeps the address range (host: an
inaccessible anonymous mapping over it; cuda: the range stays reserved);
reacquire and refresh map a segment there again under a new lease. The
finalizer's state (_Held) is changed in place, so that it frees what the
mapping holds when it goes: the range alone once released, and the lease
current then, not the first one.

Host segments are mapped with libc's mmap through ctypes rather than Python's
mmap module, which would hold a duplicate of the descriptor for as long as
the mapping lives (one fd per mapped segment, against RLIMIT_NOFILE).
"""

from __future__ import annotations

import bisect
import ctypes
import os
import threading
import warnings
import weakref

from . import _cuda
from ._errors import InvalidError, error
from ._tensors import Layout, decode_bundle, is_bundle, layout_from_meta
from ._info import SegmentInfo

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
PROT_NONE, PROT_READ, PROT_WRITE = 0, 1, 2
# Linux's values, the same on x86-64 and arm64.
MAP_SHARED, MAP_PRIVATE, MAP_FIXED, MAP_ANONYMOUS, MAP_NORESERVE = 0x1, 0x2, 0x10, 0x20, 0x4000


def mmap(fd: int, length: int, writable: bool, at: int | None = None) -> int:
    """Maps fd's first length bytes shared, anywhere, or at address at in
    place of what is mapped there (MAP_FIXED)."""
    flags = MAP_SHARED | (MAP_FIXED if at is not None else 0)
    p = _libc.mmap(at, length, PROT_READ | (PROT_WRITE if writable else 0), flags, fd, 0)
    if p is None or p == _MAP_FAILED:
        e = ctypes.get_errno()
        raise OSError(e, f"gpushm: mmap of {length} bytes: {os.strerror(e)}")
    return p


def munmap(ptr: int, length: int) -> None:
    if _libc.munmap(ptr, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"gpushm: munmap: {os.strerror(e)}")


def keep_range(ptr: int, length: int) -> None:
    """Puts inaccessible anonymous memory, which reserves nothing, over
    [ptr, ptr+length) in place of what is mapped there: the memory goes,
    the addresses stay this process's, and touching them faults."""
    p = _libc.mmap(ptr, length, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0)
    if p is None or p == _MAP_FAILED:
        e = ctypes.get_errno()
        raise OSError(e, f"gpushm: mmap over a released range of {length} bytes: {os.strerror(e)}")


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

    def end_now(self, quiet: bool = False):
        """Ends the lease and waits for the daemon's answers: after it the
        daemon counts the segment as not held by this client. A close cut
        off by a restart is sent again after the client reclaimed the
        lease (it still holds it then). quiet swallows errors, for the
        paths that raise one of their own."""
        client = self.client
        try:
            if client is None or client._closed or client._broken:
                return  # ended with the connection
            while self.client is client and self.count > 0:
                try:
                    client._call("close", segment=self.segment)
                except InvalidError:
                    # This connection holds no open of it (a close applied
                    # before a crash cut off its reply): ended, as wanted.
                    break
                self.count -= 1
        except Exception:
            if not quiet:
                raise
        finally:
            self.client, self.count = None, 0


class _Held:
    """What a mapping holds, for its finalizer: the address range (reserved
    bytes at ptr), the memory mapped at its start (alloc bytes; none while
    released), and the lease on the segment mapped."""

    __slots__ = ("dev", "ptr", "alloc", "reserved", "released", "lease")

    def __init__(self, dev, ptr, alloc, lease):
        self.dev, self.ptr, self.alloc, self.reserved = dev, ptr, alloc, alloc
        self.released, self.lease = False, lease


def _unmap(held):
    try:
        if held.dev is None:
            munmap(held.ptr, held.reserved)
        elif held.released:
            held.dev.free_range(held.ptr, held.reserved)
        elif held.alloc == held.reserved:
            held.dev.unmap(held.ptr, held.alloc)
        else:  # refreshed onto a smaller version
            held.dev.unmap_keep(held.ptr, held.alloc)
            held.dev.free_range(held.ptr, held.reserved)
    except Exception as e:
        # Leaving the range mapped leaks it; unmapping harder is impossible.
        warnings.warn(f"gpushm: unmapping a segment failed, its memory stays mapped: {e}", RuntimeWarning)
    finally:
        held.lease.end()


# Every segment mapping a client made and that is alive, for reconnection
# (a client reclaims the leases it holds) and for finding the mappings
# behind pointers (gpushm.torch's release, reacquire and refresh).
_live = weakref.WeakSet()


def track(m) -> None:
    _live.add(m)


def live() -> list:
    """The live mappings, as a list: another thread may be adding one."""
    while True:
        try:
            return list(_live)
        except RuntimeError:  # changed while copied
            continue


def behind(ptrs) -> list:
    """The mappings whose address ranges hold the pointers, each once, in
    the order first met; pointers into no mapping are skipped."""
    ranges = sorted(((m.ptr, m.ptr + m.reserved, m) for m in live()), key=lambda r: r[0])
    starts = [r[0] for r in ranges]
    out, seen = [], set()
    for p in ptrs:
        i = bisect.bisect_right(starts, p) - 1
        if i >= 0 and p < ranges[i][1]:
            m = ranges[i][2]
            if id(m) not in seen:
                seen.add(id(m))
                out.append(m)
    return out


class Mapping:
    __slots__ = ("info", "ptr", "size", "alloc", "dev", "readonly", "epoch", "cache", "client", "devices", "home",
                 "access", "_held", "_fin", "_remap", "__weakref__")

    def __init__(self, client, info, fd: int, readonly: bool, devices=None):
        """Maps fd (which this call closes, always) as the segment info
        describes; the lease taken by the open that sent fd becomes this
        mapping's."""
        self.info, self.readonly, self.client, self.devices = info, readonly, client, devices
        self.size, self.alloc = info.size, info.alloc_size
        self.epoch = 0
        self.cache = {}  # parsed views of the segment: layout, bundle
        self.home = self.access = None
        lease = Lease(client, info.id)
        try:
            if info.handle_type == "memfd":
                self.dev = None
                self.ptr = mmap(fd, self.alloc, not readonly)
            elif info.handle_type == "cuda_fd":
                # Tensors live on the first GPU that asked for access: the
                # address is valid there through the mapping (UVA).
                self.home = _home(info)
                self.access = tuple(devices) if devices else (self.home,)
                self.dev = _cuda.device(self.access[0])
                self.ptr = self.dev.import_map(fd, self.alloc, readonly, self.access)
            else:
                raise OSError(f"gpushm: segment {info.name!r} has handle type {info.handle_type!r}, which this client cannot map")
        except BaseException:
            lease.end()
            raise
        finally:
            os.close(fd)
        self._held = _Held(self.dev, self.ptr, self.alloc, lease)
        self._fin = weakref.finalize(self, _unmap, self._held)
        # At exit the process unmaps everything anyway; unmapping earlier,
        # while frameworks may still hold tensors, could only crash.
        self._fin.atexit = False
        self._remap = threading.Lock()

    @property
    def lease(self) -> Lease:
        """The lease on the segment mapped now (ended while released)."""
        return self._held.lease

    @property
    def released(self) -> bool:
        """Whether the memory was given back (release): the addresses are
        kept, and touching them faults."""
        return self._held.released

    @property
    def reserved(self) -> int:
        """The address range's length: alloc at the first map."""
        return self._held.reserved

    # ---- release, reacquire, refresh ----------------------------------

    def release(self) -> None:
        """Gives the memory and the lease back and keeps the address range
        (Segment.release). Releasing twice is a no-op."""
        with self._remap:
            if self._held.released:
                return
            self.client._forget(self)
            self._give_back()
            self._held.lease.end_now()

    def _give_back(self):
        held = self._held
        if self.dev is None:
            keep_range(self.ptr, held.reserved)
        else:
            # Waits for the work queued on the device first.
            self.dev.unmap_keep(self.ptr, held.alloc)
        held.released = True

    def remap(self, any_version: bool) -> bool:
        """Maps the segment the name names now at this mapping's addresses
        under a new lease, and ends the old lease: reacquire
        (any_version=False: only the released segment itself, else
        StaleError) and refresh. Returns whether the segment changed."""
        with self._remap:
            client, held = self.client, self._held
            released, name, old = held.released, self.info.name, self.info.id
            if not released and (not any_version or self.epoch == client._epoch.value):
                return False  # mapped, and (by the epoch) still the current version
            ep = client._epoch.value
            rep, fd = client._call("open", name=name, **({"readonly": True} if self.readonly else {}))
            try:
                info = SegmentInfo.from_wire(rep["segment"])
                new = Lease(client, info.id)
                try:
                    if info.id == old and not released:
                        new.end_now(quiet=True)  # the same version, still mapped
                        self.epoch = ep
                        return False
                    if info.id != old and not any_version:
                        raise error("ESTALE", f"reacquire {name!r}: segment {old} (version {self.info.version}) was released, "
                                    f"and the name names segment {info.id} (version {info.version}) now: refresh() maps it")
                    cache = self._fits(info, fd)
                    client._forget(self)
                    try:
                        self._map(fd, info)
                    except BaseException:
                        if held.released and not released:
                            held.lease.end_now(quiet=True)  # released now, as release() leaves it
                        raise
                except BaseException:
                    new.end_now(quiet=True)
                    raise
            finally:
                os.close(fd)
            oldlease = held.lease
            held.lease, held.alloc, held.released = new, info.alloc_size, False
            self.info, self.size, self.alloc, self.epoch, self.cache = info, info.size, info.alloc_size, ep, cache
            if not released:
                oldlease.end_now()
            return info.id != old

    def _fits(self, info, fd) -> dict:
        """Refuses a segment this mapping cannot take in place of the one it
        maps: one larger than the address range, of another kind or GPU, or
        one that views made before would not fit (smaller, another tensor
        layout, another bundle header: their offsets and shapes stay).
        Returns the new parsed-view cache."""
        v = f"{info.name!r} version {info.version} (segment {info.id})"
        if info.alloc_size > self._held.reserved:
            raise error("EFBIG", f"refresh {v}: it needs {info.alloc_size} bytes of addresses, "
                        f"and the mapping keeps {self._held.reserved} (open it anew)")
        want = "memfd" if self.dev is None else "cuda_fd"
        if info.handle_type != want:
            raise error("EINVAL", f"refresh {v}: handle type {info.handle_type!r} in place of {want!r}")
        if self.dev is not None and _home(info) != self.home:
            raise error("EXDEV", f"refresh {v}: it lives on GPU {_home(info)}, this mapping's range on GPU {self.home}")
        if info.size < self.size:
            raise error("EINVAL", f"refresh {v}: it is {info.size} bytes, and views of the mapped version may reach byte {self.size}")
        lay = self.cache.get("layout")
        if isinstance(self.info.meta, dict) and self.info.meta.get("kind") == "tensor" and isinstance(lay, Layout):
            try:
                got = layout_from_meta(info.meta, info.size)
            except ValueError as e:
                got = e
            if got != lay:
                raise error("EINVAL", f"refresh {v}: its tensor is {_describe(got)}, the mapped one's {_describe(lay)}")
        cache = {}
        parsed = self.cache.get("bundle")
        if parsed is not None:
            cache["bundle"] = self._same_bundle(parsed, info, fd, v)
        return cache

    def _same_bundle(self, parsed, info, fd, v):
        """The new version's parsed bundle header, if it lays out the same
        tensors at the same offsets as the mapped one's (parsed)."""
        n = info.meta.get("header_bytes") if is_bundle(info.meta) else None
        if not isinstance(n, int) or n < 2 or 8 + n > info.size:
            raise error("EINVAL", f"refresh {v}: it is not a tensor bundle like the mapped version (meta {info.meta!r})")
        try:
            got = decode_bundle(self._peek(fd, info, 8 + n), info.size)
        except ValueError as e:
            raise error("EINVAL", f"refresh {v}: {e}") from None
        old, new = dict(parsed[1]), dict(got[1])
        if old != new:
            diff = sorted(set(old) ^ set(new)) or [k for k in old if old[k] != new[k]]
            raise error("EINVAL", f"refresh {v}: its tensors are laid out unlike the mapped version's, which the "
                        f"tensors made before point into ({', '.join(map(str, diff[:5]))}{', ...' if len(diff) > 5 else ''}): open it anew")
        return got

    def _peek(self, fd, info, n) -> bytes:
        """The first n bytes of the memory fd refers to, not yet mapped."""
        if self.dev is None:
            b = os.pread(fd, n, 0)
            if len(b) < n:
                raise ValueError(f"gpushm: read {len(b)} of the {n} bytes of a bundle header")
            return b
        dev = _cuda.device(self.home)
        ptr = dev.import_map(fd, info.alloc_size, True)
        try:
            buf = ctypes.create_string_buffer(n)
            _cuda.copy(ctypes.addressof(buf), None, ptr, dev, n)
            return buf.raw
        finally:
            dev.unmap(ptr, info.alloc_size)

    def _map(self, fd, info):
        """Maps fd at this mapping's addresses, in place of what it maps."""
        held = self._held
        if not held.released:
            self._give_back()
        if self.dev is None:
            try:
                mmap(fd, info.alloc_size, not self.readonly, at=self.ptr)
            except OSError:
                # A failed MAP_FIXED may have unmapped the range: take it
                # back, so that nothing else is mapped there.
                keep_range(self.ptr, held.reserved)
                raise
        else:
            self.dev.map_at(fd, self.ptr, info.alloc_size, self.readonly, self.access)

    def stale(self) -> bool:
        """Whether the name names another segment than this one now."""
        client = self.client
        now, ident = client._epoch.value, self.info.id
        if now == self.epoch:
            return False
        try:
            got = client.stat(self.info.name)
        except FileNotFoundError:
            return True
        if got.id == ident == self.info.id:
            # Something else moved the epoch: remember it, so that the
            # next poll costs a load again.
            self.epoch = now
        return got.id != ident

    def _usable(self):
        if self._held.released:
            raise ValueError(f"gpushm: segment {self.info.name!r} is released (reacquire() or refresh() maps it again)")

    @property
    def device(self):
        """The GPU ordinal, or None for host memory."""
        return None if self.dev is None else self.dev.ordinal

    def check(self, off: int, n: int):
        if off < 0 or n < 0 or off + n > self.size:
            raise ValueError(f"gpushm: {n} bytes at offset {off} are outside the segment's {self.size} bytes")

    def read(self, off: int, n: int) -> bytes:
        self._usable()
        self.check(off, n)
        if self.dev is None:
            return ctypes.string_at(self.ptr + off, n)
        buf = ctypes.create_string_buffer(n)
        _cuda.copy(ctypes.addressof(buf), None, self.ptr + off, self.dev, n)
        return buf.raw

    def write(self, data, off: int) -> int:
        if self.readonly:
            raise PermissionError(f"gpushm: segment {self.info.name!r} is mapped read-only")
        self._usable()
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
        self._usable()
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


def _home(info) -> int:
    """This process's ordinal of a cuda segment's GPU (the daemon names it
    by UUID)."""
    return _cuda.ordinal_of(info.uuid) if info.uuid else info.device


def _describe(lay) -> str:
    return str(lay) if isinstance(lay, Exception) else f"{lay.dtype.name}{list(lay.shape)} at byte {lay.offset}" + (
        f" strides {list(lay.strides)}" if lay.strides is not None else "")
