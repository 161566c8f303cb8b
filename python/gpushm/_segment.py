"""Segment: an open segment, a typed View of its mapping plus its name and
state. Client.open and Client.create give them (the client core makes
them); a segment reaches the daemon only through its mapping's lease."""

from __future__ import annotations

import os

from ._bundle import Bundle, bundle_of
from ._info import SegmentInfo
from ._tensors import Layout, layout_from_meta
from ._view import View, view_of


class Segment(View):
    """An open segment: a typed View (from its meta; raw uint8 bytes when it
    has none) plus its name and state. Close it, or use it as a context
    manager; the memory is unmapped once nothing made from it remains."""

    __slots__ = ("_info", "created", "_closed", "_lent", "_bad")

    def __init__(self, mapping, created: bool):
        lay = mapping.cache.get("layout")
        if lay is None:
            # A bad tensor meta must not stop raw access: fall back to bytes
            # and report the problem when the tensor is asked for.
            try:
                lay = layout_from_meta(mapping.info.meta, mapping.size)
            except ValueError as e:
                lay = e
            mapping.cache["layout"] = lay
        self._m, self._layout = mapping, lay if isinstance(lay, Layout) else Layout("uint8", (mapping.size,))
        self._bad = None if isinstance(lay, Layout) else lay
        self._info, self.created, self._closed, self._lent = mapping.info, created, False, False

    def _mapping(self):
        if self._closed:
            raise ValueError(f"gpushm: segment {self.info.name!r} is closed")
        return self._m

    @property
    def info(self) -> SegmentInfo:
        """The segment's state: as the last open, commit, reacquire or
        refresh of its mapping said it."""
        m = self._m
        return self._info if m is None else m.info

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def id(self) -> int:
        return self.info.id

    @property
    def size(self) -> int:
        return self.info.size

    @property
    def meta(self):
        return self.info.meta

    def __repr__(self):
        m = self._m
        state = "closed " if self._closed else "released " if m is not None and m.released else ""
        where = "" if m is None else " on host" if m.dev is None else f" on cuda:{m.dev.ordinal}"
        return f"<gpushm.Segment {state}{self.info.name!r} {self.dtype}{list(self.shape)}{where}>"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def commit(self):
        """Makes a segment created with uncommitted=True openable by its
        name, for everyone its mode allows; opens waiting for it (wait=) get
        it now. A next version (create(next_version=True)) becomes the
        name's current version, in place of the one there. Work queued on
        this GPU by this process (torch kernels and copies included) is
        waited for first. Raises InvalidError if it is committed already,
        NotFoundError or ExistsError if its name was removed (or taken by
        another segment) before the commit."""
        m = self._mapping()
        client = m.lease.client
        if client is None:
            raise ConnectionError(f"gpushm: commit {self.info.name!r}: this client no longer holds it (closed, or the daemon lost it)")
        client._commit(m)

    # ---- release, reacquire and versions ----------------------------------
    # They act on the mapping, which every Segment of this client opened
    # from it shares, with the views and tensors made from them.

    @property
    def version(self) -> int:
        """Which version of its name the segment is: 1 for the first, and
        one more for each next version made current."""
        return max(self.info.version, 1)

    @property
    def released(self) -> bool:
        """Whether the segment's memory is released (release())."""
        m = self._m
        return m is not None and m.released

    def release(self):
        """Gives the segment's memory back and keeps its addresses: the
        lease ends (the daemon counts the segment as not held, so its budget
        may evict it to host memory), the address range stays reserved, and
        nothing else is mapped there. Arrays, tensors and pointers into it
        fault until reacquire() or refresh() maps the memory again at the
        same addresses; read() and write() raise. GPU work queued on the
        range is waited for first. Releasing twice is a no-op."""
        self._mapping().release()

    def reacquire(self):
        """Maps the released segment again at the same addresses, with a
        new lease; the daemon brings it back from host memory first if it
        was evicted. Arrays, tensors, device pointers and CUDA graphs made
        before keep working. When the name names a newer version now, raises
        StaleError (ESTALE) and leaves it released: refresh() maps the new
        one. A segment that is not released is left as it is."""
        self._mapping().remap(False)

    def refresh(self) -> bool:
        """Maps the version the name names now at the segment's addresses,
        in place of the one mapped (or released), and ends the lease on the
        old one, which the daemon frees once its last reader moved on.
        Returns whether the version changed; the same version, mapped, is
        left as it is (without a message while the epoch page has not
        moved), and a released one is reacquired.

        Views made before keep their offsets and shapes, so the new version
        must fit them: its allocation at most the address range (the first
        version's; else an Error with errno EFBIG), its size at least the
        mapped one's, the same tensor if it is one, and the same layout of
        names, dtypes, shapes and offsets if it is a bundle whose tensors()
        were taken (else InvalidError); a refused version leaves the mapping
        as it was. Nothing may use the old version's memory meanwhile:
        refresh waits for this process's GPU work, not for other threads'
        later work or other processes."""
        return self._mapping().remap(True)

    def stale(self) -> bool:
        """Whether the name names another segment now (a newer version, most
        often, or none). Free (one load of the epoch page) while no name
        changed since the segment was opened or refreshed; else a stat."""
        return self._mapping().stale()

    def wait_version(self, timeout: float) -> SegmentInfo:
        """Waits up to timeout seconds (at most 3600) until the name names
        another segment than this one, and returns that one's state: a
        writer made a new version current. Raises WaitTimeoutError when the
        time is up, NotFoundError when the name was removed. refresh() then
        maps the new version. This client sends nothing else while it
        waits."""
        m = self._mapping()
        if not 0 < timeout <= 3600:
            raise ValueError(f"gpushm: wait for a version of {m.info.name!r}: timeout {timeout!r}: want more than 0 and at most 3600 seconds")
        rep, _ = m.client._call("wait_version", name=m.info.name, segment=m.info.id, wait=float(timeout))
        return SegmentInfo.from_wire(rep["segment"])

    def close(self):
        """Lets go of the segment. Tensors, arrays and views made from it
        keep its memory mapped until they go too."""
        self._closed = True
        if not self._lent and self._m is not None:
            self._info, self._m = self._m.info, None

    def tensors(self) -> Bundle:
        """The tensors of a bundle segment as Views by name (Client.tensors
        of the segment in hand): a writer's before its commit, too."""
        return bundle_of(self)

    def view(self, dtype=None, shape=None, offset: int = 0, strides=None) -> View:
        """Another typed view of the same memory."""
        return view_of(self._mapping(), dtype, shape, offset, strides)

    def read(self, n: int | None = None, offset: int = 0) -> bytes:
        """Copies bytes out (device to host on a GPU)."""
        m = self._mapping()
        return m.read(offset, m.size - offset if n is None else n)

    def write(self, data, offset: int = 0) -> int:
        """Copies a bytes-like object in (host to device on a GPU)."""
        return self._mapping().write(data, offset)

    def fill(self, file, offset: int = 0, at: int = 0, n: int | None = None) -> int:
        """Has the daemon copy n bytes of file (a file object or a
        descriptor, open for reading) from offset into the segment at at,
        with its own copy engine: this process maps nothing and needs no
        CUDA context (docs/protocol.md, "fill"). n defaults to the rest of
        the file. The daemon records the file it read (stat's sources),
        which is what lets loaders serve the file from here
        (docs/python.md, "Any loader"). Returns the bytes copied."""
        fd = file if isinstance(file, int) else file.fileno()
        if n is None:
            n = os.fstat(fd).st_size - offset
        m = self._mapping()
        client = m.lease.client
        if client is None:
            raise ConnectionError(f"gpushm: fill {self.info.name!r}: this client no longer holds it (closed, or the daemon lost it)")
        rep, _ = client._call("fill", fd, segment=m.info.id, offset=offset, at=at, size=n)
        return rep.get("bytes", 0)

    def memoryview(self) -> memoryview:
        """All of a host segment's bytes."""
        return self._mapping().memoryview(0, self.info.size)

    def _interface(self, on_gpu):
        if self._bad is not None:
            raise self._bad
        d = super()._interface(on_gpu)
        # The consumer now holds this object as the memory's owner, so close
        # must leave the mapping in place.
        self._lent = True
        return d

    def __dlpack__(self, **kw):
        if self._bad is not None:
            raise self._bad
        return super().__dlpack__(**kw)

