"""The few CUDA driver calls gpushm needs, through ctypes on libcuda.so.1.

Declarations follow cuda.h of CUDA 13.0 (the same for 12.x in everything
used here), as internal/cuda/driver.h does. The driver is loaded on first
use, so importing gpushm never needs a GPU.

Every call runs with the device's primary context pushed and popped again:
the primary context is the one torch, CuPy and JAX use, and popping leaves
the caller's current device exactly as it was.
"""

from __future__ import annotations

import ctypes
import threading
from ctypes import POINTER, c_char_p, c_int, c_size_t, c_uint, c_uint64, c_void_p

CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 0x1
CU_MEM_LOCATION_TYPE_DEVICE = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READ = 0x1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 0x3
# Pinned for every context, with an address on the GPUs.
CU_MEMHOSTREGISTER_PORTABLE = 0x1
CU_MEMHOSTREGISTER_DEVICEMAP = 0x2
# A stream handle that names the legacy default stream (what 0 means to the
# runtime, which torch and CuPy hand out for their default streams).
CU_STREAM_LEGACY = 0x1


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", c_int)]


# A wrong layout would make cuMemSetAccess read garbage.
assert ctypes.sizeof(CUmemAccessDesc) == 12 and CUmemAccessDesc.flags.offset == 8

_SIGNATURES = {
    "cuInit": (c_uint,),
    "cuGetErrorName": (c_int, POINTER(c_char_p)),
    "cuDeviceGet": (POINTER(c_int), c_int),
    "cuDeviceGetCount": (POINTER(c_int),),
    "cuDevicePrimaryCtxRetain": (POINTER(c_void_p), c_int),
    "cuCtxPushCurrent_v2": (c_void_p,),
    "cuCtxPopCurrent_v2": (POINTER(c_void_p),),
    "cuCtxSynchronize": (),
    "cuStreamSynchronize": (c_void_p,),
    "cuMemGetInfo_v2": (POINTER(c_size_t), POINTER(c_size_t)),
    "cuMemImportFromShareableHandle": (POINTER(c_uint64), c_void_p, c_int),
    "cuMemAddressReserve": (POINTER(c_uint64), c_size_t, c_size_t, c_uint64, ctypes.c_ulonglong),
    "cuMemAddressFree": (c_uint64, c_size_t),
    "cuMemMap": (c_uint64, c_size_t, c_size_t, c_uint64, ctypes.c_ulonglong),
    "cuMemUnmap": (c_uint64, c_size_t),
    "cuMemSetAccess": (c_uint64, c_size_t, POINTER(CUmemAccessDesc), c_size_t),
    "cuMemRelease": (c_uint64,),
    "cuMemAlloc_v2": (POINTER(c_uint64), c_size_t),
    "cuMemFree_v2": (c_uint64,),
    "cuMemcpyHtoD_v2": (c_uint64, c_void_p, c_size_t),
    "cuMemcpyDtoH_v2": (c_void_p, c_uint64, c_size_t),
    "cuMemcpy": (c_uint64, c_uint64, c_size_t),
}

# Channels' calls (docs/protocol.md, "Channels"), looked up when a channel
# first needs them, by their newest name first: a driver without them can
# still map segments.
_CHANNEL_SIGNATURES = {
    "cuMemHostRegister": (("cuMemHostRegister_v2", "cuMemHostRegister"), (c_void_p, c_size_t, c_uint)),
    "cuMemHostUnregister": (("cuMemHostUnregister",), (c_void_p,)),
    "cuMemHostGetDevicePointer": (("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer"),
                                  (POINTER(c_uint64), c_void_p, c_uint)),
    # flags 0: a write preceded by a system-wide fence; a wait for >= (GEQ).
    "cuStreamWriteValue64": (("cuStreamWriteValue64_v2", "cuStreamWriteValue64"), (c_void_p, c_uint64, c_uint64, c_uint)),
    "cuStreamWaitValue64": (("cuStreamWaitValue64_v2", "cuStreamWaitValue64"), (c_void_p, c_uint64, c_uint64, c_uint)),
}
# Several of those in one call, where the driver has it (CUDA 11.7 on): a
# channel end queues a group of them with one driver call (stream_ops).
_BATCH_SIGNATURE = (("cuStreamBatchMemOp_v2", "cuStreamBatchMemOp"), (c_void_p, c_uint, c_void_p, c_uint))
# CUstreamBatchMemOpParams: a union of 48 bytes, six u64 words; an
# operation's type is in the first (a u32, then padding), its address in the
# second, its 64-bit value in the third, its flags in the fourth (a u32;
# 0: a write after a fence, a wait for >= (GEQ)), the fifth is the driver's.
CU_STREAM_MEM_OP_WAIT_VALUE_64 = 4
CU_STREAM_MEM_OP_WRITE_VALUE_64 = 5
MEM_OP_WORDS = 6
# The most operations one batch may hold (the driver takes fewer than 256).
MAX_MEM_OPS = 128


# A GPU's UUID, looked up when a cuda segment is first mapped.
_UUID_SIGNATURE = (("cuDeviceGetUuid_v2", "cuDeviceGetUuid"), (POINTER(ctypes.c_char * 16), c_int))


class CUDAError(RuntimeError):
    """A CUDA driver call failed; .result is the CUresult."""

    def __init__(self, msg, result=None):
        super().__init__(msg)
        self.result = result


class _Driver:
    def __init__(self):
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise CUDAError(f"gpushm: cannot load libcuda.so.1 ({e}): cuda segments need the NVIDIA driver on this machine") from None
        for name, args in _SIGNATURES.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise CUDAError(f"gpushm: libcuda.so.1 lacks {name}: the NVIDIA driver is too old for CUDA VMM (need 11.x or later)") from None
            fn.argtypes, fn.restype = args, c_int
            setattr(self, name.removesuffix("_v2"), fn)
        self.check("cuInit", self.cuInit(0))
        self._lib, self._channel_calls, self._batch = lib, False, None

    def channel_calls(self):
        """Loads the calls channels need, once; raises CUDAError naming the
        one the driver lacks."""
        if self._channel_calls:
            return
        for attr, (names, args) in _CHANNEL_SIGNATURES.items():
            self._optional(attr, names, args, "channels need stream memory operations (a driver for CUDA 12 or later)")
        try:
            self._batch = self._optional("cuStreamBatchMemOp", *_BATCH_SIGNATURE, "")
        except CUDAError:
            self._batch = None  # one call per operation
        self._channel_calls = True

    def _optional(self, attr, names, args, why):
        """Looks up a call by its newest name first."""
        for name in names:
            fn = getattr(self._lib, name, None)
            if fn is not None:
                break
        else:
            raise CUDAError(f"gpushm: libcuda.so.1 lacks {names[0]}: {why}")
        fn.argtypes, fn.restype = args, c_int
        setattr(self, attr, fn)
        return fn

    def check(self, call, r):
        if r:
            s = c_char_p()
            name = s.value.decode() if self.cuGetErrorName(r, ctypes.byref(s)) == 0 and s.value else f"CUresult {r}"
            raise CUDAError(f"gpushm: {call}: {name}", r)


_lock = threading.Lock()
_driver: _Driver | None = None
_devices: dict[int, Device] = {}


def driver() -> _Driver:
    global _driver
    if _driver is None:
        with _lock:
            if _driver is None:
                _driver = _Driver()
    return _driver


def device(ordinal: int) -> Device:
    d = _devices.get(ordinal)
    if d is None:
        driver()  # outside the lock, which driver() takes too
        with _lock:
            d = _devices.get(ordinal) or Device(ordinal)
            _devices[ordinal] = d
    return d


_ordinals: dict[str, int] | None = None


def _visible() -> dict[str, int]:
    """UUID (lower case) to ordinal of every GPU this process can see."""
    global _ordinals
    if _ordinals is None:
        cu = driver()
        get_uuid = getattr(cu, "cuDeviceGetUuid", None) or cu._optional(
            "cuDeviceGetUuid", *_UUID_SIGNATURE, "a GPU's UUID needs CUDA 11 or later")
        n = c_int()
        cu.check("cuDeviceGetCount", cu.cuDeviceGetCount(ctypes.byref(n)))
        found = {}
        for i in range(n.value):
            dev, raw = c_int(), (ctypes.c_char * 16)()
            cu.check("cuDeviceGet", cu.cuDeviceGet(ctypes.byref(dev), i))
            cu.check("cuDeviceGetUuid", get_uuid(ctypes.byref(raw), dev))
            found[format_uuid(bytes(raw))] = i
        _ordinals = found
    return _ordinals


def ordinal_of(uuid: str) -> int:
    """This process's ordinal of the GPU with that UUID ("GPU-...", as
    nvidia-smi prints it). The daemon names a segment's GPU by UUID because a
    process in a container or under CUDA_VISIBLE_DEVICES numbers the node's
    GPUs its own way. Raises CUDAError when this process cannot see it."""
    vis = _visible()
    i = vis.get(uuid.lower())
    if i is None:
        raise CUDAError(f"gpushm: GPU {uuid} is not among the {len(vis)} this process can see "
                        "(CUDA_VISIBLE_DEVICES, or a container given other GPUs?)")
    return i


def uuid_of(ordinal: int) -> str | None:
    """The UUID (lower case) of this process's GPU ordinal, None if none."""
    for u, i in _visible().items():
        if i == ordinal:
            return u
    return None


def format_uuid(b: bytes) -> str:
    """A CUuuid as nvidia-smi prints it, in lower case."""
    h = b.hex()
    return f"gpu-{h[0:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def available() -> bool:
    try:
        driver()
        return True
    except CUDAError:
        return False


class Device:
    """A GPU and its primary context, retained for the process's life (as the
    CUDA runtime does)."""

    def __init__(self, ordinal: int):
        cu = self.cu = driver()
        dev, ctx = c_int(), c_void_p()
        cu.check("cuDeviceGet", cu.cuDeviceGet(ctypes.byref(dev), ordinal))
        cu.check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
        self.ordinal, self.ctx = ordinal, ctx
        self._access = {}  # (GPUs, readonly) -> CUmemAccessDesc array, built once

    def __enter__(self):
        self.cu.check("cuCtxPushCurrent", self.cu.cuCtxPushCurrent(self.ctx))
        return self.cu

    def __exit__(self, *exc):
        self.cu.cuCtxPopCurrent(ctypes.byref(c_void_p()))

    def import_map(self, fd: int, size: int, readonly: bool, access=None) -> int:
        """Maps a cuda_fd descriptor (not taken over) into this process, with
        access for every GPU in access (default: this one), in one call."""
        access = tuple(access) if access else (self.ordinal,)
        descs = self._descs(access, readonly)
        h, ptr = c_uint64(), c_uint64()
        with self as cu:
            cu.check("cuMemImportFromShareableHandle",
                     cu.cuMemImportFromShareableHandle(ctypes.byref(h), c_void_p(fd), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
            try:
                # Alignment 0 is the allocation granularity, as for PyTorch's
                # expandable segments.
                cu.check("cuMemAddressReserve", cu.cuMemAddressReserve(ctypes.byref(ptr), size, 0, 0, 0))
                try:
                    cu.check("cuMemMap", cu.cuMemMap(ptr, size, 0, h, 0))
                    r = cu.cuMemSetAccess(ptr, size, descs, len(access))
                    if r:
                        cu.cuMemUnmap(ptr, size)
                        cu.check("cuMemSetAccess", r)
                except BaseException:
                    cu.cuMemAddressFree(ptr, size)
                    raise
            finally:
                # The mapping holds the memory now; the handle is not needed.
                cu.cuMemRelease(h)
        return ptr.value

    def _descs(self, access, readonly):
        """The CUmemAccessDesc array that grants access on every GPU in
        access, built once."""
        descs = self._access.get((access, readonly))
        if descs is None:
            prot = CU_MEM_ACCESS_FLAGS_PROT_READ if readonly else CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            descs = self._access[(access, readonly)] = (CUmemAccessDesc * len(access))(
                *[CUmemAccessDesc(CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, d), prot) for d in access])
        return descs

    def map_at(self, fd: int, ptr: int, size: int, readonly: bool, access=None) -> None:
        """Maps a cuda_fd descriptor (not taken over) at ptr, a range this
        process keeps reserved (unmap_keep emptied it), with access as
        import_map gives it."""
        access = tuple(access) if access else (self.ordinal,)
        descs = self._descs(access, readonly)
        h = c_uint64()
        with self as cu:
            cu.check("cuMemImportFromShareableHandle",
                     cu.cuMemImportFromShareableHandle(ctypes.byref(h), c_void_p(fd), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
            try:
                cu.check("cuMemMap", cu.cuMemMap(ptr, size, 0, h, 0))
                r = cu.cuMemSetAccess(ptr, size, descs, len(access))
                if r:
                    cu.cuMemUnmap(ptr, size)
                    cu.check("cuMemSetAccess", r)
            finally:
                cu.cuMemRelease(h)

    def unmap_keep(self, ptr: int, size: int) -> None:
        """Unmaps the memory at ptr and keeps the address range reserved,
        for map_at; free_range gives the range back."""
        with self as cu:
            # As in unmap: cuMemUnmap does not wait for kernels.
            cu.check("cuCtxSynchronize", cu.cuCtxSynchronize())
            cu.check("cuMemUnmap", cu.cuMemUnmap(ptr, size))

    def free_range(self, ptr: int, size: int) -> None:
        """Gives back an address range nothing is mapped in."""
        with self as cu:
            cu.check("cuMemAddressFree", cu.cuMemAddressFree(ptr, size))

    def unmap(self, ptr: int, size: int) -> None:
        with self as cu:
            # cuMemUnmap does not wait for kernels still reading the range
            # (PyTorch waits before its own unmaps for the same reason), and
            # a consumer's deleter may run while its last kernel is queued.
            cu.check("cuCtxSynchronize", cu.cuCtxSynchronize())
            cu.check("cuMemUnmap", cu.cuMemUnmap(ptr, size))
            cu.check("cuMemAddressFree", cu.cuMemAddressFree(ptr, size))

    def alloc(self, size: int) -> int:
        p = c_uint64()
        with self as cu:
            cu.check("cuMemAlloc", cu.cuMemAlloc(ctypes.byref(p), max(size, 1)))
        return p.value

    def free(self, ptr: int) -> None:
        with self as cu:
            cu.check("cuCtxSynchronize", cu.cuCtxSynchronize())
            cu.check("cuMemFree", cu.cuMemFree(ptr))

    # ---- channels: the control block and stream memory operations -------

    def register_host(self, ptr: int, size: int) -> int:
        """Pins host memory (a mapped control block) for every context and
        returns its address on the GPU, for stream memory operations."""
        self.cu.channel_calls()
        dptr = c_uint64()
        with self as cu:
            cu.check("cuMemHostRegister",
                     cu.cuMemHostRegister(ptr, size, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP))
            r = cu.cuMemHostGetDevicePointer(ctypes.byref(dptr), ptr, 0)
            if r:
                cu.cuMemHostUnregister(ptr)
                cu.check("cuMemHostGetDevicePointer", r)
        return dptr.value

    def unregister_host(self, ptr: int) -> None:
        """Undoes register_host, once no stream touches the memory any more."""
        with self as cu:
            cu.check("cuMemHostUnregister", cu.cuMemHostUnregister(ptr))

    def stream_ops(self):
        """(write, wait, batch, ops): functions that queue on a stream of
        this GPU cuStreamWriteValue64 (of (stream, address, value): v, after
        a fence), cuStreamWaitValue64 ((stream, address, value): >= v), and
        batch(stream, n), the first n operations of ops (an array of
        MEM_OP_WORDS u64 words an operation, MAX_MEM_OPS of them, that the
        caller fills: the type at 0, the address at 1, the value at 2; the
        flags, 0, are left as they are) in one driver call. stream is a
        CUstream; 0 is the legacy default stream. They are on every
        hand-off of a channel, so they take plain ints and do nothing they
        need not. Each channel has its own, used under its lock: they keep
        their arguments in ctypes objects of their own."""
        cu = self.cu
        cu.channel_calls()
        push, pop, ctx, popped = cu.cuCtxPushCurrent, cu.cuCtxPopCurrent, self.ctx, ctypes.byref(c_void_p())
        ops = (c_uint64 * (MEM_OP_WORDS * MAX_MEM_OPS))()
        # The calls on every hand-off go through function pointers of their
        # own with no argtypes, given ctypes objects made once whose values
        # are set per call: converting plain ints through argtypes was about
        # half of such a call's cost in Python (docs/benchmarks.md,
        # "Channels from Python", round four).
        lib = cu._lib

        def bare(fn):
            f = lib._FuncPtr((fn.__name__, lib))
            f.restype = c_int
            return f

        # Where the calling thread's context is already ours (a framework
        # made the primary context current), the push and pop are two
        # ctypes calls of the three a hand-off would make: asking is one.
        get_current = getattr(lib, "cuCtxGetCurrent", None)
        if get_current is not None:
            get_current = lib._FuncPtr(("cuCtxGetCurrent", lib))
            get_current.restype = c_int
        current = c_void_p()
        pcurrent, ours = ctypes.byref(current), ctx.value

        def op(fn, call, a_arg, b_arg):
            s_arg = c_void_p()

            def run(stream, a, b):
                s_arg.value = stream or CU_STREAM_LEGACY
                a_arg.value, b_arg.value = a, b
                if get_current is not None and get_current(pcurrent) == 0 and current.value == ours:
                    r = fn(s_arg, a_arg, b_arg, 0)
                else:
                    # The current context decides what the legacy stream
                    # is; pushing our own also makes the call work on a
                    # thread that never touched CUDA.
                    r = push(ctx)
                    if r:
                        cu.check("cuCtxPushCurrent", r)
                    try:
                        r = fn(s_arg, a_arg, b_arg, 0)
                    finally:
                        pop(popped)
                if r:
                    cu.check(call, r)
            return run

        if cu._batch is not None:
            batch_op = op(bare(cu._batch), "cuStreamBatchMemOp", c_uint(), c_void_p())
            pops = ctypes.addressof(ops)

            def batch(stream, n):
                batch_op(stream, n, pops)
        else:
            # A driver without it: the same operations, one call each.
            def batch(stream, n):
                for i in range(0, MEM_OP_WORDS * n, MEM_OP_WORDS):
                    (write_op if ops[i] == CU_STREAM_MEM_OP_WRITE_VALUE_64 else wait_op)(stream, ops[i + 1], ops[i + 2])

        write_op = op(bare(cu.cuStreamWriteValue64), "cuStreamWriteValue64", c_uint64(), c_uint64())
        wait_op = op(bare(cu.cuStreamWaitValue64), "cuStreamWaitValue64", c_uint64(), c_uint64())
        return write_op, wait_op, batch, ops

    def synchronize(self) -> None:
        with self as cu:
            cu.check("cuCtxSynchronize", cu.cuCtxSynchronize())

    def mem_info(self) -> tuple[int, int]:
        free, total = c_size_t(), c_size_t()
        with self as cu:
            cu.check("cuMemGetInfo", cu.cuMemGetInfo(ctypes.byref(free), ctypes.byref(total)))
        return free.value, total.value


def copy(dst: int, dst_dev: Device | None, src: int, src_dev: Device | None, n: int) -> None:
    """Copies n bytes and returns when they have landed. A pointer whose
    device is None is host memory; device pointers may belong to any GPU
    (unified addressing)."""
    if n == 0:
        return
    dev = dst_dev or src_dev
    if dev is None:
        ctypes.memmove(dst, src, n)
        return
    with dev as cu:
        if dst_dev and src_dev:
            cu.check("cuMemcpy", cu.cuMemcpy(dst, src, n))
        elif dst_dev:
            cu.check("cuMemcpyHtoD", cu.cuMemcpyHtoD(dst, src, n))
        else:
            cu.check("cuMemcpyDtoH", cu.cuMemcpyDtoH(dst, src, n))
        # Device-to-device copies, and the DMA behind a copy from pageable
        # memory, may still be running when the call returns; another
        # process reading the segment must never see half of one.
        cu.check("cuStreamSynchronize", cu.cuStreamSynchronize(None))
