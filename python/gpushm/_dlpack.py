"""DLPack in pure Python: capsules made and taken apart with ctypes.

Producing: each export allocates a DLManagedTensor (or the versioned struct)
as a ctypes object and parks it, with a reference to the memory's owner, in
_live under the struct's address. The consumer calls our deleter when it is
done, which drops the entry and so the owner; a capsule nobody consumed
drops it from its destructor instead. The mapping therefore lives exactly as
long as the last tensor made from it.

Consuming (share, put_tensors): Borrowed asks an object for a legacy capsule,
marks it used, reads the DLTensor, and calls the producer's deleter when the
copy is done; borrow() takes a numpy array that cannot export by its array
interface instead, and copy_in() copies either into a mapping.
"""

from __future__ import annotations

import ctypes
import struct
from ctypes import CFUNCTYPE, c_char_p, c_int, c_int32, c_int64, c_uint8, c_uint16, c_uint32, c_uint64, c_void_p

from . import _cuda
from ._tensors import _DTYPES, dtype_from_dlpack

kDLCPU, kDLCUDA, kDLCUDAHost = 1, 2, 3
FLAG_READ_ONLY, FLAG_IS_COPIED = 1 << 0, 1 << 1


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", c_void_p), ("device", DLDevice), ("ndim", c_int32), ("dtype", DLDataType),
                ("shape", c_void_p), ("strides", c_void_p), ("byte_offset", c_uint64)]


_DELETER = CFUNCTYPE(None, c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", _DELETER)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", c_uint32), ("minor", c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", c_void_p), ("deleter", _DELETER),
                ("flags", c_uint64), ("dl_tensor", DLTensor)]


# The layouts of dlpack.h on LP64; a mismatch would hand consumers garbage.
assert ctypes.sizeof(DLTensor) == 48 and ctypes.sizeof(DLManagedTensor) == 64
assert ctypes.sizeof(DLManagedTensorVersioned) == 80 and DLManagedTensorVersioned.dl_tensor.offset == 32

# Capsule names must outlive every capsule: module constants, kept below.
_NAME, _USED = b"dltensor", b"used_dltensor"
_VNAME, _VUSED = b"dltensor_versioned", b"used_dltensor_versioned"

_api = ctypes.pythonapi
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [c_void_p, c_char_p, c_void_p]
# The destructor gets the dying capsule as a raw pointer: wrapping it in a
# py_object would take a reference to an object being deallocated.
_is_valid = ctypes.PYFUNCTYPE(c_int, c_void_p, c_char_p)(("PyCapsule_IsValid", _api))
_get_raw = ctypes.PYFUNCTYPE(c_void_p, c_void_p, c_char_p)(("PyCapsule_GetPointer", _api))
_api.PyCapsule_GetPointer.restype = c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, c_char_p]
_api.PyCapsule_SetName.restype = c_int
_api.PyCapsule_SetName.argtypes = [ctypes.py_object, c_char_p]
_api.PyCapsule_IsValid.restype = c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.py_object, c_char_p]

# address of an exported struct -> (struct, owner)
_live: dict[int, tuple] = {}


@_DELETER
def _deleter(addr):
    try:
        _live.pop(addr, None)
    except Exception:  # interpreter shutdown: nothing left to free
        pass


@CFUNCTYPE(None, c_void_p)
def _capsule_destructor(cap):
    # Consumers rename a capsule they took; one still carrying our name was
    # never consumed, so its tensor is ours to free.
    try:
        for name in (_NAME, _VNAME):
            if _is_valid(cap, name):
                _live.pop(_get_raw(cap, name), None)
    except Exception:
        pass


# Tensors may be freed by a framework after this module's globals are gone
# (interpreter shutdown); the C thunks they call must never be freed.
_api.Py_IncRef.argtypes = [ctypes.py_object]
for _f in (_deleter, _capsule_destructor):
    _api.Py_IncRef(_f)
_DESTRUCTOR_ADDR = ctypes.cast(_capsule_destructor, c_void_p).value


_DELETER_ADDR = ctypes.cast(_deleter, c_void_p).value
# The structs as dlpack.h lays them out on LP64 (checked above): DLTensor is
# data, device type and id, ndim, dtype code, bits and lanes, shape,
# strides, byte_offset.
_TENSOR = "QiiiBBHQQQ"
_LEGACY = struct.Struct("<" + _TENSOR + "QQ")       # + manager_ctx, deleter
_VERSIONED = struct.Struct("<IIQQQ" + _TENSOR)      # version, manager_ctx, deleter, flags +
assert _LEGACY.size == ctypes.sizeof(DLManagedTensor) and _VERSIONED.size == ctypes.sizeof(DLManagedTensorVersioned)


def export(owner, ptr: int, device: tuple, dtype, shape_arr, strides_arr, ndim: int,
           versioned: bool, readonly: bool = False, copied: bool = False):
    """A capsule over ptr that keeps owner alive until the consumer is done.
    shape_arr and strides_arr are ctypes int64 arrays that must not change."""
    shape = ctypes.addressof(shape_arr) if ndim else 0
    strides = ctypes.addressof(strides_arr) if ndim else 0
    # Consumers such as torch ignore byte_offset, so the data pointer is the
    # tensor's own first byte, as every framework exports it. The struct is
    # packed in one call: it is on the path of every hand-off.
    if versioned:
        flags = (FLAG_READ_ONLY if readonly else 0) | (FLAG_IS_COPIED if copied else 0)
        mt = DLManagedTensorVersioned.from_buffer_copy(_VERSIONED.pack(
            1, 0, 0, _DELETER_ADDR, flags, ptr, device[0], device[1], ndim, dtype.code, dtype.bits, 1, shape, strides, 0))
    else:
        mt = DLManagedTensor.from_buffer_copy(_LEGACY.pack(
            ptr, device[0], device[1], ndim, dtype.code, dtype.bits, 1, shape, strides, 0, 0, _DELETER_ADDR))
    addr = ctypes.addressof(mt)
    _live[addr] = (mt, owner, shape_arr, strides_arr)
    try:
        return _api.PyCapsule_New(addr, _VNAME if versioned else _NAME, _DESTRUCTOR_ADDR)
    except BaseException:
        _live.pop(addr, None)
        raise


class Borrowed:
    """A tensor of another framework seen through its DLPack capsule. Call
    release() (or use it as a context manager) when done with the memory."""

    def __init__(self, obj):
        dev_type, dev_id = obj.__dlpack_device__()
        # Our copies run on the legacy default stream; stream=1 asks the
        # producer to make its pending work on the tensor visible there first.
        cap = obj.__dlpack__(stream=1) if dev_type == kDLCUDA else obj.__dlpack__()
        if _api.PyCapsule_IsValid(cap, _NAME):
            addr = _api.PyCapsule_GetPointer(cap, _NAME)
            _api.PyCapsule_SetName(cap, _USED)
            mt = DLManagedTensor.from_address(addr)
        elif _api.PyCapsule_IsValid(cap, _VNAME):
            addr = _api.PyCapsule_GetPointer(cap, _VNAME)
            _api.PyCapsule_SetName(cap, _VUSED)
            mt = DLManagedTensorVersioned.from_address(addr)
            if mt.version.major != 1:
                self._mt, self._addr = mt, addr
                self.release()
                raise BufferError(f"gpushm: DLPack major version {mt.version.major} is not supported")
        else:
            raise BufferError(f"gpushm: {type(obj).__name__}.__dlpack__ returned no DLPack capsule")
        self._mt, self._addr, self._cap = mt, addr, cap
        t = mt.dl_tensor
        self.device_type, self.device_id = t.device.device_type, t.device.device_id
        if self.device_type not in (kDLCPU, kDLCUDA, kDLCUDAHost):
            self.release()
            raise BufferError(f"gpushm: DLPack device type {self.device_type} is neither CPU nor CUDA memory")
        self.ptr = (t.data or 0) + t.byte_offset
        try:
            self.dtype = dtype_from_dlpack(t.dtype.code, t.dtype.bits, t.dtype.lanes)
        except TypeError:
            self.release()
            raise
        n = t.ndim
        self.shape = tuple((c_int64 * n).from_address(t.shape)) if n else ()
        self.strides = tuple((c_int64 * n).from_address(t.strides)) if n and t.strides else None

    @property
    def on_gpu(self) -> bool:
        return self.device_type == kDLCUDA

    def release(self):
        mt, self._mt = self._mt, None
        if mt is not None and mt.deleter:
            mt.deleter(self._addr)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def borrow(obj):
    """The memory of another framework's tensor, by DLPack; numpy arrays of
    dtypes that numpy cannot export (bool, before numpy 1.25) by their array
    interface."""
    if hasattr(obj, "__dlpack__"):
        try:
            return Borrowed(obj)
        except BufferError:
            if not hasattr(obj, "__array_interface__"):
                raise
    if hasattr(obj, "__array_interface__"):
        return _HostArray(obj)
    raise TypeError(f"gpushm: {type(obj).__name__} has neither __dlpack__ nor __array_interface__; pass a torch, CuPy, JAX or numpy array")


class _HostArray:
    on_gpu, device_id = False, 0

    def __init__(self, obj):
        ai = obj.__array_interface__
        if ai.get("mask") is not None:
            raise TypeError("gpushm: masked arrays cannot be shared")
        self.obj, self.ptr = obj, ai["data"][0] + ai.get("offset", 0)
        self.dtype = _BY_TYPESTR.get(ai["typestr"].replace("=", "<"))
        if self.dtype is None:
            raise TypeError(f"gpushm: array type {ai['typestr']!r} is not supported")
        self.shape = tuple(ai["shape"])
        st, size = ai.get("strides"), self.dtype.itemsize
        if st is not None and any(s % size for s in st):
            raise ValueError("gpushm: the array's strides are not multiples of its element size")
        self.strides = None if st is None else tuple(s // size for s in st)

    def release(self):
        self.obj = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


_BY_TYPESTR = {d.typestr: d for d in _DTYPES if d.typestr}


def copy_in(m, off, src, src_ptr, n):
    """Copies n bytes of src (borrow's) from src_ptr into mapping m at off."""
    src_dev = _cuda.device(src.device_id) if src.on_gpu else None
    _cuda.copy(m.ptr + off, m.dev, src_ptr, src_dev, n)
