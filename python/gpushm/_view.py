"""Typed views of mapped segments, and how frameworks take them: DLPack,
__cuda_array_interface__ (v3), numpy's __array_interface__ and the buffer
protocol. None of them copies."""

from __future__ import annotations

import ctypes

from . import _cuda, _dlpack
from ._tensors import Layout, dtype_of


class View:
    """A tensor inside a mapped segment: dtype, shape, strides and offset.

    Hand it to any framework: ``torch.from_dlpack(v)``,
    ``cupy.from_dlpack(v)``, ``jax.dlpack.from_dlpack(v)``,
    ``numpy.from_dlpack(v)`` or ``numpy.asarray(v)`` (host memory). What they
    return shares the segment's memory and keeps it mapped."""

    __slots__ = ("_m", "_layout")

    def __init__(self, mapping, layout: Layout):
        if not layout.fits(mapping.size):
            raise ValueError(f"gpushm: {layout} reaches outside the segment's {mapping.size} bytes")
        self._m, self._layout = mapping, layout

    def _mapping(self):
        return self._m

    # ---- description ----------------------------------------------------

    @property
    def dtype(self) -> str:
        return self._layout.dtype.name

    @property
    def shape(self) -> tuple:
        return self._layout.shape

    @property
    def strides(self):
        """Strides in elements, or None when C-contiguous."""
        return self._layout.strides

    @property
    def offset(self) -> int:
        """Byte offset of the first element from the segment's start."""
        return self._layout.offset

    @property
    def nbytes(self) -> int:
        return self._layout.nbytes

    @property
    def device(self):
        """The GPU ordinal, or None for host memory."""
        return self._mapping().device

    @property
    def readonly(self) -> bool:
        return self._mapping().readonly

    @property
    def ptr(self) -> int:
        """Address of the first element in this process (a device pointer on
        a GPU)."""
        return self._mapping().ptr + self._layout.offset

    def __repr__(self):
        where = "host" if self._m.dev is None else f"cuda:{self._m.dev.ordinal}"
        return f"<gpushm.View {self.dtype}{list(self.shape)} on {where} of {self._m.info.name!r}>"

    # ---- DLPack ---------------------------------------------------------

    def __dlpack_device__(self):
        m = self._mapping()
        return (_dlpack.kDLCPU, 0) if m.dev is None else (_dlpack.kDLCUDA, m.dev.ordinal)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule over this view.

        stream is accepted and needs no action: gpushm queues no work on the
        memory (its own copies have finished when they return), so there is
        nothing for the consumer's stream to wait for; ordering against
        writers in other processes is the application's. A capsule is
        versioned (DLPack 1.0, with the read-only flag) when max_version asks
        for it, legacy otherwise. copy=True or a dl_device other than the
        segment's gives a private copy; copy=False then raises BufferError."""
        m, lay = self._mapping(), self._layout
        if m.released:
            raise BufferError(f"gpushm: segment {m.info.name!r} is released (reacquire() or refresh() maps it again)")
        versioned = max_version is not None and tuple(max_version)[0] >= 1
        here = self.__dlpack_device__()
        target = here if dl_device is None else (int(dl_device[0]), int(dl_device[1]))
        if target != here or copy:
            if copy is False:
                raise BufferError(f"gpushm: {self!r} lives on device {here}; exporting it to {target} needs a copy, and copy=False forbids one")
            return self._export_copy(m, lay, target, versioned)
        shape, strides = lay.dlpack_arrays()
        return _dlpack.export(m, m.ptr + lay.offset, here, lay.dtype, shape, strides,
                              len(lay.shape), versioned, readonly=m.readonly)

    def _export_copy(self, m, lay, target, versioned):
        n = lay.hi - lay.lo
        src = m.ptr + lay.offset + lay.lo
        if target[0] in (_dlpack.kDLCPU, _dlpack.kDLCUDAHost) and target[1] == 0:
            owner = ctypes.create_string_buffer(max(n, 1))
            dst, dev = ctypes.addressof(owner), None
        elif target[0] == _dlpack.kDLCUDA:
            dev = _cuda.device(target[1])
            owner = _DeviceBuffer(dev, n)
            dst = owner.ptr
        else:
            raise BufferError(f"gpushm: cannot export to DLPack device {target}: only CPU and CUDA memory")
        _cuda.copy(dst, dev, src, m.dev, n)
        shape, strides = lay.dlpack_arrays()
        return _dlpack.export(owner, dst - lay.lo, (target[0], target[1]), lay.dtype, shape, strides,
                              len(lay.shape), versioned, copied=True)

    # ---- array interfaces -----------------------------------------------

    def _interface(self, on_gpu: bool) -> dict:
        m, lay = self._mapping(), self._layout
        if (m.dev is not None) != on_gpu:
            raise AttributeError("__cuda_array_interface__" if on_gpu else "__array_interface__")
        m._usable()
        if lay.dtype.typestr is None:
            raise TypeError(f"gpushm: {lay.dtype.name} has no array-interface type string; take the view with DLPack, e.g. torch.from_dlpack(v)")
        size = lay.dtype.itemsize
        d = {"shape": lay.shape, "typestr": lay.dtype.typestr, "data": (m.ptr + lay.offset, m.readonly),
             "strides": None if lay.strides is None else tuple(s * size for s in lay.strides), "version": 3}
        if on_gpu:
            d["stream"] = None  # nothing queued on the memory; see __dlpack__
        return d

    @property
    def __cuda_array_interface__(self):
        return self._interface(True)

    @property
    def __array_interface__(self):
        return self._interface(False)

    def numpy(self):
        """A numpy array sharing a host segment's memory."""
        import numpy

        m = self._mapping()
        if m.dev is not None:
            raise TypeError(f"gpushm: {self!r} is GPU memory; use torch.from_dlpack(v) or cupy.from_dlpack(v), or tobytes() to copy it out")
        # The array's base is a plain View, which holds the mapping whatever
        # happens to the Segment this was called on.
        return numpy.asarray(View(m, self._layout))

    def memoryview(self) -> memoryview:
        """The bytes this view spans, as a memoryview of host memory."""
        lay = self._layout
        return self._mapping().memoryview(lay.offset + lay.lo, lay.hi - lay.lo)

    def tobytes(self) -> bytes:
        """A copy of the view's elements in C order (host or GPU)."""
        lay = self._layout
        if not lay.contiguous:
            raise ValueError(f"gpushm: {self!r} is not C-contiguous; copy it with a framework instead")
        return self._mapping().read(lay.offset, lay.nbytes)


class _DeviceBuffer:
    """GPU memory for a DLPack copy, freed when the consumer is done."""

    __slots__ = ("ptr", "__weakref__")

    def __init__(self, dev, n):
        import weakref

        self.ptr = dev.alloc(n)
        weakref.finalize(self, dev.free, self.ptr).atexit = False


def view_of(mapping, dtype=None, shape=None, offset=0, strides=None) -> View:
    """A View of raw segment memory: dtype defaults to uint8 and shape to as
    many elements as fit after offset."""
    dt = dtype_of(dtype or "uint8")
    if shape is None:
        shape = ((mapping.size - offset) // dt.itemsize,)
    return View(mapping, Layout(dt, shape, strides, offset))
