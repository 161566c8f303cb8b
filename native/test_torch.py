#!/usr/bin/env python3
"""PyTorch tests of libgpushm_alloc.so, on a GPU machine after `make -C native`.

    python3 native/test_torch.py [path/to/libgpushm_alloc.so]

1. Pluggable allocator: a torch.cuda.MemPool over
   CUDAPluggableAllocator(lib, "gpushm_malloc", "gpushm_free") holds a
   Linear(4096, 4096)'s parameters and a small tensor at an offset inside its
   allocation. gpushm_export hands each one's memory, found by data_ptr, to a
   second Python process (started with exec, the descriptors passed with
   pass_fds), which maps it with libcuda through ctypes and compares a
   checksum of the bytes, copied to the host there, with one computed on the
   GPU here.
2. LD_PRELOAD: Python processes started with LD_PRELOAD=libgpushm_alloc.so
   allocate a tensor and report whether its memory came from gpushm
   (gpushm_alloc_stats through ctypes.CDLL, which returns the preloaded
   library), export it to a process that checks it, and time torch.empty of
   64 MiB with an empty cache: without GPUSHM_PRELOAD (nothing may change),
   with GPUSHM_PRELOAD=1, and with it under expandable segments and the
   cudaMallocAsync backend (which allocate without cudaMalloc).

Prints what it finds, and exits 1 if a check failed.
"""

import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from ctypes import POINTER, byref, c_char_p, c_int, c_size_t, c_uint, c_uint64, c_void_p

HERE = os.path.dirname(os.path.abspath(__file__))
failures = 0


def check(ok, msg):
    global failures
    if not ok:
        failures += 1
        print(f"FAIL: {msg}", flush=True)
    return ok


# ---- libgpushm_alloc.so ----


def open_gpushm(path):
    lib = ctypes.CDLL(path)
    lib.gpushm_export.argtypes = [c_uint64, POINTER(c_int), POINTER(c_uint64), POINTER(c_uint64), POINTER(c_int)]
    lib.gpushm_export.restype = c_int
    lib.gpushm_alloc_stats.argtypes = [POINTER(c_uint64), POINTER(c_uint64)]
    lib.gpushm_alloc_stats.restype = c_int
    lib.gpushm_last_error.argtypes = []
    lib.gpushm_last_error.restype = c_char_p
    return lib


def stats(lib):
    n, b = c_uint64(), c_uint64()
    lib.gpushm_alloc_stats(byref(n), byref(b))
    return n.value, b.value


def export(lib, ptr):
    """Returns (fd, base, alloc_size, device) of the allocation holding ptr."""
    fd, base, size, dev = c_int(-1), c_uint64(), c_uint64(), c_int(-1)
    rc = lib.gpushm_export(ptr, byref(fd), byref(base), byref(size), byref(dev))
    if rc != 0:
        raise RuntimeError(f"gpushm_export({ptr:#x}) = {rc}: {lib.gpushm_last_error().decode()}")
    return fd.value, base.value, size.value, dev.value


# ---- libcuda, for the process that maps (layouts as in gpushm_alloc.c) ----


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [("type", c_int), ("requestedHandleTypes", c_int), ("loc_type", c_int), ("loc_id", c_int),
                ("win32HandleMetaData", c_void_p), ("allocFlags", ctypes.c_ubyte * 8)]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("loc_type", c_int), ("loc_id", c_int), ("flags", c_int)]


assert ctypes.sizeof(CUmemAllocationProp) == 32 and ctypes.sizeof(CUmemAccessDesc) == 12

SIGNATURES = {
    "cuInit": (c_uint,),
    "cuGetErrorName": (c_int, POINTER(c_char_p)),
    "cuDeviceGet": (POINTER(c_int), c_int),
    "cuDevicePrimaryCtxRetain": (POINTER(c_void_p), c_int),
    "cuCtxSetCurrent": (c_void_p,),
    "cuMemGetAllocationGranularity": (POINTER(c_size_t), POINTER(CUmemAllocationProp), c_int),
    "cuMemImportFromShareableHandle": (POINTER(c_uint64), c_void_p, c_int),
    "cuMemAddressReserve": (POINTER(c_uint64), c_size_t, c_size_t, c_uint64, ctypes.c_ulonglong),
    "cuMemMap": (c_uint64, c_size_t, c_size_t, c_uint64, ctypes.c_ulonglong),
    "cuMemSetAccess": (c_uint64, c_size_t, POINTER(CUmemAccessDesc), c_size_t),
    "cuMemRelease": (c_uint64,),
    "cuMemcpyDtoH_v2": (c_void_p, c_uint64, c_size_t),
    "cuMemUnmap": (c_uint64, c_size_t),
    "cuMemAddressFree": (c_uint64, c_size_t),
}


def libcuda():
    cu = ctypes.CDLL("libcuda.so.1")
    for name, args in SIGNATURES.items():
        fn = getattr(cu, name)
        fn.argtypes, fn.restype = args, c_int

    def call(name, *args):
        r = getattr(cu, name)(*args)
        if r != 0:
            s = c_char_p()
            cu.cuGetErrorName(r, byref(s))
            raise RuntimeError(f"{name}: {s.value.decode() if s.value else '?'} ({r})")

    return call


def host_checksum(buf):
    """The sum of the bytes and their sum weighted by (index % 251 + 1)."""
    try:
        import numpy as np
        a = np.frombuffer(buf, dtype=np.uint8).astype(np.int64)
        w = np.arange(a.size, dtype=np.int64) % 251 + 1
        return [int(a.sum()), int((a * w).sum())]
    except ImportError:
        import torch  # on the CPU only
        a = torch.frombuffer(buf, dtype=torch.uint8).to(torch.int64)
        w = torch.arange(a.numel(), dtype=torch.int64) % 251 + 1
        return [int(a.sum()), int((a * w).sum())]


def gpu_checksum(t):
    """host_checksum of t's bytes, computed on its GPU."""
    import torch
    b = t.detach().contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
    w = torch.arange(b.numel(), device=b.device, dtype=torch.int64) % 251 + 1
    return [int(b.sum()), int((b * w).sum())]


def child_main(spec):
    """Maps each exported allocation, as another process would, and compares checksums."""
    call = libcuda()
    call("cuInit", 0)
    ok = True
    for it in spec["items"]:
        dev, ctx, gran = c_int(), c_void_p(), c_size_t()
        call("cuDeviceGet", byref(dev), it["device"])
        call("cuDevicePrimaryCtxRetain", byref(ctx), dev)
        call("cuCtxSetCurrent", ctx)
        prop = CUmemAllocationProp(type=1, requestedHandleTypes=1, loc_type=1, loc_id=it["device"])
        call("cuMemGetAllocationGranularity", byref(gran), byref(prop), 0)
        h, p, size = c_uint64(), c_uint64(), it["alloc_size"]
        call("cuMemImportFromShareableHandle", byref(h), c_void_p(it["fd"]), 1)
        call("cuMemAddressReserve", byref(p), size, gran.value, 0, 0)
        call("cuMemMap", p, size, 0, h, 0)
        desc = CUmemAccessDesc(1, it["device"], 3)
        call("cuMemSetAccess", p, size, byref(desc), 1)
        call("cuMemRelease", h)  # the mapping keeps the memory
        os.close(it["fd"])
        buf = (ctypes.c_char * it["nbytes"])()
        call("cuMemcpyDtoH_v2", ctypes.addressof(buf), p.value + it["offset"], it["nbytes"])
        got = host_checksum(buf)
        same = got == it["sum"]
        ok &= same
        print(f"  child pid {os.getpid()}: {it['name']}: {it['nbytes']} bytes at offset {it['offset']} of a "
              f"{size}-byte allocation on device {it['device']}: checksum {got} {'==' if same else '!='} {it['sum']}",
              flush=True)
        call("cuMemUnmap", p, size)
        call("cuMemAddressFree", p, size)
    return 0 if ok else 1


def verify_in_child(items, env=None):
    """Runs child_main in a new interpreter with the items' descriptors; returns its exit status."""
    fds = [it["fd"] for it in items]
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps({"items": items})],
                       pass_fds=fds, env=env, timeout=180)
    for fd in fds:
        os.close(fd)
    return r.returncode


# ---- 1. the pluggable allocator ----


def test_pluggable(lib_path):
    import torch
    print(f"torch {torch.__version__}, built for CUDA {torch.version.cuda}, "
          f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}", flush=True)
    print("== 1. CUDAPluggableAllocator + MemPool: Linear(4096, 4096) parameters exported to another process")
    alloc = torch.cuda.memory.CUDAPluggableAllocator(lib_path, "gpushm_malloc", "gpushm_free")
    lib = open_gpushm(lib_path)  # the same handle torch's ctypes.CDLL got, so the same table
    n0 = stats(lib)
    if not check(hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool"),
                 f"torch {torch.__version__} has no torch.cuda.MemPool / use_mem_pool"):
        return
    pool = torch.cuda.MemPool(alloc.allocator())
    with torch.cuda.use_mem_pool(pool):
        model = torch.nn.Linear(4096, 4096).cuda()
        pad = torch.empty(1000, device="cuda")
        small = torch.randn(3000, device="cuda")
    torch.cuda.synchronize()
    n1 = stats(lib)
    print(f"  gpushm allocations: {n0} -> {n1} (count, bytes)")
    check(n1[0] > n0[0], "the pool did not allocate through gpushm_malloc")

    items = []
    for name, t in (("weight", model.weight), ("bias", model.bias), ("small", small)):
        try:
            fd, base, size, dev = export(lib, t.data_ptr())
        except RuntimeError as e:
            check(False, f"{name}: {e}")
            continue
        items.append({"name": name, "fd": fd, "alloc_size": size, "offset": t.data_ptr() - base,
                      "nbytes": t.numel() * t.element_size(), "device": dev, "sum": gpu_checksum(t)})
        print(f"  {name}: data_ptr {t.data_ptr():#x} = base {base:#x} + {t.data_ptr() - base}, allocation "
              f"{size} bytes on device {dev}")
    check(any(it["offset"] > 0 for it in items), "no tensor started inside its allocation: interior export not shown")
    rc = verify_in_child(items)
    check(rc == 0, f"the child that mapped the parameters exited {rc}")
    if torch.cuda.device_count() >= 2:
        result = cross_device_copies(model.weight.detach())
        print(f"  the weight copied to cuda:1 and back, contiguous and transposed: {result}")
        check(result == "ok", f"cross-device copies of gpushm memory: {result}")

    # Memory torch allocated without the pool is not gpushm's.
    other = torch.empty(1 << 20, device="cuda")
    try:
        fd, *_ = export(lib, other.data_ptr())
        os.close(fd)
        check(False, "a tensor allocated outside the pool was exportable")
    except RuntimeError as e:
        print(f"  outside the pool: {e}")
    del other

    del model, pad, small, t
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    n2 = stats(lib)
    del pool
    gc.collect()
    torch.cuda.empty_cache()
    n3 = stats(lib)
    print(f"  gpushm allocations after freeing the tensors and empty_cache(): {n2}; after deleting the pool "
          f"and empty_cache(): {n3}")
    check(n3 == n0, f"deleting the pool and emptying the cache left {n3[0] - n0[0]} gpushm allocations")


def cross_device_copies(a):
    """Copies a (on cuda:0) to cuda:1 and back, as a memcpy and, transposed, as a kernel; 'ok' or what went wrong."""
    import torch
    try:
        b = a.to("cuda:1")
        c = b.to("cuda:0")
        t = a.t().to("cuda:1")
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        same = torch.equal(a, c) and torch.equal(t.cpu(), a.t().cpu())
        return "ok" if same else "data differ"
    except Exception as e:  # report whatever torch raises
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"


# ---- 2. LD_PRELOAD ----


def preload_main():
    """Runs under LD_PRELOAD; prints one line 'RESULT {json}'."""
    lib_path = os.environ["GPUSHM_ALLOC_LIB"]
    lib = open_gpushm(lib_path)
    import torch
    res = {"GPUSHM_PRELOAD": os.environ.get("GPUSHM_PRELOAD"), "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    n0 = stats(lib)
    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    n1 = stats(lib)
    res["stats_before"], res["stats_after"] = n0, n1
    res["intercepted"] = n1[0] > n0[0]
    maps = [line.split()[-1] for line in open("/proc/self/maps") if len(line.split()) >= 6]
    res["cudart"] = sorted({m for m in maps if "libcudart" in m})
    res["gpushm_copies"] = sorted({m for m in maps if "libgpushm_alloc" in m})
    try:
        fd, base, size, dev = export(lib, x.data_ptr())
        item = {"name": "preloaded torch.ones", "fd": fd, "alloc_size": size, "offset": x.data_ptr() - base,
                "nbytes": x.numel() * x.element_size(), "device": dev, "sum": gpu_checksum(x)}
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "GPUSHM_PRELOAD")}
        res["verified_in_child"] = verify_in_child([item], env=env) == 0
    except RuntimeError as e:
        res["export_error"] = str(e)
    del x
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    res["stats_after_empty_cache"] = stats(lib)

    # torch.empty of 64 MiB with an empty cache: one cudaMalloc (or whatever the backend does).
    times = []
    for i in range(23):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        y = torch.empty(16 << 20, device="cuda")
        t1 = time.perf_counter()
        del y
        torch.cuda.empty_cache()
        if i >= 3:
            times.append((t1 - t0) * 1e6)
    res["empty_64MiB_p50_us"] = round(statistics.median(times), 1)

    if torch.cuda.device_count() >= 2:
        res["peer_access_0_1"] = torch.cuda.can_device_access_peer(0, 1)
        res["cross_device_copy"] = cross_device_copies(torch.randn(1024, 1024, device="cuda:0"))

    # torch.multiprocessing shares CUDA tensors with cudaIpcGetMemHandle.
    z = torch.ones(1 << 20, device="cuda")
    try:
        z.untyped_storage()._share_cuda_()
        res["cuda_ipc_share"] = "ok"
    except Exception as e:  # report whatever torch raises
        res["cuda_ipc_share"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    print("RESULT " + json.dumps(res), flush=True)
    return 0


def run_preloaded(lib_path, label, gpushm_preload, conf=None):
    env = dict(os.environ, LD_PRELOAD=lib_path, GPUSHM_ALLOC_LIB=lib_path)
    env.pop("GPUSHM_PRELOAD", None)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if gpushm_preload:
        env["GPUSHM_PRELOAD"] = "1"
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    print(f"== 2. LD_PRELOAD, {label}", flush=True)
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--preload"], env=env, capture_output=True,
                       text=True, timeout=240)
    res = None
    for line in r.stdout.splitlines():
        if line.startswith("RESULT "):
            res = json.loads(line[len("RESULT "):])
        else:
            print(line)
    for line in r.stderr.splitlines()[-15:]:
        print(f"  stderr: {line}")
    if not check(r.returncode == 0 and res is not None, f"{label}: the preloaded process exited {r.returncode}"):
        return None
    for k, v in res.items():
        print(f"  {k}: {v}")
    return res


def main():
    lib_path = os.path.abspath(sys.argv[1]) if len(sys.argv) > 1 else os.path.join(HERE, "libgpushm_alloc.so")
    os.environ["GPUSHM_ALLOC_LIB"] = lib_path
    test_pluggable(lib_path)

    off = run_preloaded(lib_path, "GPUSHM_PRELOAD unset (must change nothing)", False)
    if off is not None:
        check(not off["intercepted"], "without GPUSHM_PRELOAD=1 cudaMalloc was intercepted")
        check(off.get("cross_device_copy", "ok") == "ok", f"cross-device copy: {off.get('cross_device_copy')}")
    on = run_preloaded(lib_path, "GPUSHM_PRELOAD=1", True)
    if on is not None:
        if on["cudart"]:
            # A shared libcudart is mapped, so torch's cudaMalloc is a dynamic call we can interpose.
            check(on["intercepted"], f"torch uses {on['cudart']} yet cudaMalloc was not intercepted")
            check(on.get("verified_in_child") is True, "the preloaded tensor's memory did not verify in another process")
            check(on["stats_after_empty_cache"] == on["stats_before"],
                  "empty_cache() did not give the preloaded allocations back through cudaFree")
            check(on.get("cross_device_copy", "ok") == "ok", f"cross-device copy under preload: {on.get('cross_device_copy')}")
        else:
            print("  no shared libcudart is mapped: this torch links the runtime statically, nothing to interpose")
    for label, conf in (("GPUSHM_PRELOAD=1, expandable_segments:True", "expandable_segments:True"),
                        ("GPUSHM_PRELOAD=1, backend:cudaMallocAsync", "backend:cudaMallocAsync")):
        res = run_preloaded(lib_path, label, True, conf)
        if res is not None:
            print(f"  => {'intercepted' if res['intercepted'] else 'not intercepted'} under {conf}")

    print(f"{'FAIL' if failures else 'PASS'}: {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        sys.exit(child_main(json.loads(sys.argv[2])))
    if len(sys.argv) > 1 and sys.argv[1] == "--preload":
        sys.exit(preload_main())
    sys.exit(main())
