#!/usr/bin/env python3
"""Memory that an RDMA engine can register, on a cuda daemon.

    GPUSHM_BIN=.gpu/gpushm PYTHONPATH=python python3 python/tests/gpu/gpu_rdma.py

On a device that reports CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
a segment's memory is made gpuDirectRDMACapable: `stat` says rdma (read
from the allocation's properties in the daemon); evicted to host memory it
is not, restored it is again. What the driver says of the pointer
(cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE)) is
printed for a client's mapping, and probed in one process: made with the
flag, and imported again from its POSIX descriptor, as clients do. A daemon with
--rdma off makes memory without the flag. Then the cost: creates of 2 MiB
and of 1 GiB, timed from a client, with the flag and without, in the same
run. Prints PASS/FAIL lines and a table; exits 1 if any failed.
"""

import ctypes
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "python"))

import gpushm  # noqa: E402
from gpushm import _cuda  # noqa: E402
from gpushm.testing import Daemon  # noqa: E402

CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE = 15
CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 110
failed = []


def check(ok, name, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        failed.append(name)


def pointer_rdma(seg):
    """What the driver says of the segment's mapped pointer in this process."""
    lib = ctypes.CDLL("libcuda.so.1")
    v = ctypes.c_int(-1)
    with _cuda.device(seg.device or 0):
        r = lib.cuPointerGetAttribute(ctypes.byref(v), CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE,
                                      ctypes.c_uint64(seg.ptr))
    return v.value if r == 0 else f"error {r}"


def device_allows():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuInit(0)
    dev, v = ctypes.c_int(), ctypes.c_int()
    lib.cuDeviceGet(ctypes.byref(dev), 0)
    lib.cuDeviceGetAttribute(ctypes.byref(v), CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED, dev)
    return bool(v.value)


def creates(c, nbytes, n):
    out = []
    for i in range(n):
        t = time.perf_counter()
        c.create(f"c-{nbytes}-{i}", nbytes).close()
        out.append(time.perf_counter() - t)
        c.unlink(f"c-{nbytes}-{i}")
    return statistics.median(out)


def probe():
    """In this process: an allocation made with and without the flag, its
    pointer's attribute, and the same after an export and import of its
    POSIX descriptor (what every gpushm client does)."""
    lib = ctypes.CDLL("libcuda.so.1")

    class Loc(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    class Flags(ctypes.Structure):
        _fields_ = [("compression", ctypes.c_ubyte), ("rdma", ctypes.c_ubyte), ("usage", ctypes.c_ushort),
                    ("reserved", ctypes.c_ubyte * 4)]

    class Prop(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("handles", ctypes.c_int), ("location", Loc), ("win32", ctypes.c_void_p),
                    ("flags", Flags)]

    class Access(ctypes.Structure):
        _fields_ = [("location", Loc), ("flags", ctypes.c_int)]

    size = ctypes.c_size_t(2 << 20)

    def mapped(h):
        ptr = ctypes.c_uint64()
        lib.cuMemAddressReserve(ctypes.byref(ptr), size, ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_ulonglong(0))
        lib.cuMemMap(ptr, size, ctypes.c_size_t(0), h, ctypes.c_ulonglong(0))
        a = Access(Loc(1, 0), 3)
        lib.cuMemSetAccess(ptr, size, ctypes.byref(a), ctypes.c_size_t(1))
        v = ctypes.c_int(-1)
        lib.cuPointerGetAttribute(ctypes.byref(v), CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE, ptr)
        lib.cuMemUnmap(ptr, size)
        lib.cuMemAddressFree(ptr, size)
        return v.value

    out = {}
    with _cuda.device(0):
        for rdma in (0, 1):
            p = Prop(1, 1, Loc(1, 0), None, Flags(0, rdma, 0))
            h, h2, fd = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_int(-1)
            lib.cuMemCreate(ctypes.byref(h), size, ctypes.byref(p), ctypes.c_ulonglong(0))
            lib.cuMemExportToShareableHandle(ctypes.byref(fd), h, 1, ctypes.c_ulonglong(0))
            lib.cuMemImportFromShareableHandle(ctypes.byref(h2), ctypes.c_void_p(fd.value), 1)
            got = Prop()
            lib.cuMemGetAllocationPropertiesFromHandle(ctypes.byref(got), h2)
            out[rdma] = (mapped(h), got.flags.rdma, mapped(h2))
            lib.cuMemRelease(h2)
            lib.cuMemRelease(h)
            import os

            os.close(fd.value)
    return out


def main():
    allows = device_allows()
    print(f"INFO device 0 allows GPUDirect RDMA with VMM allocations: {allows}")
    p = probe()
    check(p[1][0] == 1 and p[0][0] == 0, "an allocation made with the flag: its maker's pointer is RDMA capable",
          f"with the flag {p[1][0]}, without {p[0][0]}")
    print(f"INFO after an export and import of its descriptor: the imported handle's flag {p[1][1]}, "
          f"its pointer {p[1][2]} (made without the flag: {p[0][1]}, {p[0][2]})")
    rows = {}
    for mode in ("auto", "off"):
        d = Daemon("cuda", "--rdma", mode)
        try:
            c = gpushm.connect(d.socket)
            want = allows and mode == "auto"
            with c.create("r", 64 << 20) as seg:
                check(_raw_rdma(c, "r") == want, f"--rdma {mode}: stat", f"rdma {_raw_rdma(c, 'r')} (want {want})")
                # What the driver says of the import in this process: the
                # flag does not travel with a POSIX descriptor on the
                # drivers measured so far (probe() shows it in one process).
                print(f"INFO --rdma {mode}: the client's mapped pointer: IS_GPU_DIRECT_RDMA_CAPABLE {pointer_rdma(seg)}")
            c.evict("r")
            check(not _raw_rdma(c, "r"), f"--rdma {mode}: evicted", f"rdma {_raw_rdma(c, 'r')} (host memory: want False)")
            with c.open("r"):
                check(_raw_rdma(c, "r") == want, f"--rdma {mode}: restored", f"stat rdma {_raw_rdma(c, 'r')} (want {want})")
            c.unlink("r")
            creates(c, 2 << 20, 5)  # warm
            rows[mode] = (creates(c, 2 << 20, 500), creates(c, 1 << 30, 50))
            c.close()
        finally:
            d.stop()
    print("\n| create | with the flag (--rdma auto) | without (--rdma off) | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for i, label in enumerate(("2 MiB, median of 500", "1 GiB, median of 50")):
        a, b = rows["auto"][i], rows["off"][i]
        print(f"| {label} | {a * 1e6:.1f} us | {b * 1e6:.1f} us | {a / b:.2f} |")
    print()
    print("FAILED: " + ", ".join(failed) if failed else "all passed")
    return 1 if failed else 0


def _raw_rdma(c, name):
    """stat's rdma field as the daemon sends it."""
    rep, _ = c._call("stat", name=name)
    return bool(rep["segment"].get("rdma", False))


if __name__ == "__main__":
    sys.exit(main())
