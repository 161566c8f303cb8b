#!/usr/bin/env python3
"""Memory that an RDMA engine can register, on a cuda daemon.

    GPUSHM_BIN=.gpu/gpushm PYTHONPATH=python python3 python/tests/gpu_rdma.py

On a device that reports CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED,
a segment's memory is made gpuDirectRDMACapable: `stat` says rdma, and the
driver says so of the mapped pointer in a client
(cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE));
evicted to host memory it is not, restored it is again. A daemon with
--rdma off makes memory without the flag. Then the cost: creates of 2 MiB
and of 1 GiB, timed from a client, with the flag and without, in the same
run. Prints PASS/FAIL lines and a table; exits 1 if any failed.
"""

import ctypes
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))

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


def main():
    allows = device_allows()
    print(f"INFO device 0 allows GPUDirect RDMA with VMM allocations: {allows}")
    rows = {}
    for mode in ("auto", "off"):
        d = Daemon("cuda", "--rdma", mode)
        try:
            c = gpushm.connect(d.socket)
            want = allows and mode == "auto"
            with c.create("r", 64 << 20) as seg:
                check(_raw_rdma(c, "r") == want, f"--rdma {mode}: stat", f"rdma {_raw_rdma(c, 'r')} (want {want})")
                check(pointer_rdma(seg) == int(want), f"--rdma {mode}: the mapped pointer",
                      f"IS_GPU_DIRECT_RDMA_CAPABLE {pointer_rdma(seg)} (want {int(want)})")
            c.evict("r")
            check(not _raw_rdma(c, "r"), f"--rdma {mode}: evicted", f"rdma {_raw_rdma(c, 'r')} (host memory: want False)")
            with c.open("r") as seg:
                check(_raw_rdma(c, "r") == want and pointer_rdma(seg) == int(want), f"--rdma {mode}: restored",
                      f"stat rdma {_raw_rdma(c, 'r')}, pointer {pointer_rdma(seg)} (want {want})")
            c.unlink("r")
            creates(c, 2 << 20, 5)  # warm
            rows[mode] = (creates(c, 2 << 20, 200), creates(c, 1 << 30, 10))
            c.close()
        finally:
            d.stop()
    print("\n| create | with the flag (--rdma auto) | without (--rdma off) | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for i, label in enumerate(("2 MiB, median of 200", "1 GiB, median of 10")):
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
