"""Name -> CUDA tensor in a second process: gpushm against torch.multiprocessing.

A producer makes fresh tensors; a consumer process gets each and reads its
first element, timing just that:
  gpushm    torch.from_dlpack(client.open(name)) + t[0].item(), the segment
            created and filled by the producer beforehand
  torch.mp  queue.get() + t[0].item(), the producer having put a fresh CUDA
            tensor on a torch.multiprocessing queue beforehand
Neither timing includes the producer's work.

Two ways of handing off:
  one at a time  the consumer sleeps until told that one tensor is ready
                 (so its CPU and the daemon's are idle when timing starts)
  back to back   BATCH tensors are ready; the consumer takes them in a row
gpushm one at a time runs twice: sleeping for each reply, and with the
client's spin_us=200 (polls for the daemon's reply before sleeping).

Then, in the consumer: reopen of a segment it already has mapped (served
from the client's cache, validated by the epoch page), and a plain daemon
round trip (stat).

Needs a daemon: GPUSHM_SOCKET=/tmp/g.sock python3 python/bench/bench_torch.py
Prints tables; with $OUT set, also writes $OUT/bench.json.
"""

import datetime
import json
import os
import subprocess
import sys
import time

SIZES = [("2 MiB", 2 << 20, 200), ("64 MiB", 64 << 20, 200), ("1 GiB", 1 << 30, 100)]
BATCH = 50
SPIN_US = 200
WARMUP = 5
REOPENS = 2000


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


GPUSHM_CONSUMER = r"""
import ctypes, json, sys, time, torch, gpushm
from gpushm import _client, _cuda
c = gpushm.connect()
torch.zeros(1, device="cuda")                     # CUDA up before any timing
marks = {}

# Timestamps inside the open path, to tell where the time goes; each costs
# well under a microsecond.
_round_trip = _client.Client._round_trip
def round_trip(self, op, fields):
    r = _round_trip(self, op, fields)
    if op == "open":
        marks["reply"] = time.perf_counter()
    return r
_client.Client._round_trip = round_trip

def import_map(self, fd, size, readonly):
    h, ptr = ctypes.c_uint64(), ctypes.c_uint64()
    with self as cu:
        cu.check("import", cu.cuMemImportFromShareableHandle(ctypes.byref(h), ctypes.c_void_p(fd), 1))
        marks["import"] = time.perf_counter()
        cu.check("reserve", cu.cuMemAddressReserve(ctypes.byref(ptr), size, 0, 0, 0))
        marks["reserve"] = time.perf_counter()
        cu.check("map", cu.cuMemMap(ptr, size, 0, h, 0))
        marks["map"] = time.perf_counter()
        desc = _cuda.CUmemAccessDesc(_cuda.CUmemLocation(1, self.ordinal), 3)
        cu.check("access", cu.cuMemSetAccess(ptr, size, ctypes.byref(desc), 1))
        marks["access"] = time.perf_counter()
        cu.cuMemRelease(h)
    marks["release"] = time.perf_counter()
    return ptr.value
_cuda.Device.import_map = import_map

import os, types
from gpushm import _mapping
def close(fd):
    os.close(fd)
    if "release" in marks and "close" not in marks:
        marks["close"] = time.perf_counter()
_mapping.os = types.SimpleNamespace(close=close, strerror=os.strerror)

def take(name, want):
    t0 = time.perf_counter()
    s = c.open(name)
    marks["segment"] = time.perf_counter()
    t = torch.from_dlpack(s)
    marks["from_dlpack"] = time.perf_counter()
    del s
    v = t[0].item()                               # first read
    t1 = marks["item"] = time.perf_counter()
    assert v == float(want), (v, want)
    del t                                         # unmapped here, untimed
    return t0, t1

print("ready", flush=True)
for line in sys.stdin:
    cmd, name, arg, spin = line.split()
    c._spin_ns = int(spin) * 1000
    if cmd == "open":
        marks.clear()
        t0, t1 = take(name, arg)
        prev, phases = t0, {}
        for k, m in sorted(marks.items(), key=lambda kv: kv[1]):
            phases[k], prev = m - prev, m
        print(json.dumps({"total": t1 - t0, "phases": phases}), flush=True)
    elif cmd == "batch":
        times = []
        for i in range(int(arg)):
            t0, t1 = take(f"{name}-{i}", i)
            times.append(t1 - t0)
        print(json.dumps(times), flush=True)
    elif cmd == "reopen":
        keep = torch.from_dlpack(c.open(name))    # mapped from here on
        opens, tensors, stats = [], [], []
        for _ in range(int(arg)):
            t0 = time.perf_counter()
            s = c.open(name)
            opens.append(time.perf_counter() - t0)
            del s
        for _ in range(int(arg)):
            t0 = time.perf_counter()
            x = torch.from_dlpack(c.open(name))
            tensors.append(time.perf_counter() - t0)
            del x
        for _ in range(int(arg)):
            t0 = time.perf_counter()
            c.stat(name)
            stats.append(time.perf_counter() - t0)
        print(json.dumps({"open": opens, "open_from_dlpack": tensors, "stat": stats}), flush=True)
"""


def bench_gpushm(results):
    import torch
    import gpushm

    c = gpushm.connect()
    p = subprocess.Popen([sys.executable, "-u", "-c", GPUSHM_CONSUMER], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"

    def put(name, nbytes, value):
        seg = c.create(name, shape=(nbytes // 4,), dtype="float32", device=0)
        torch.from_dlpack(seg).fill_(float(value))
        torch.cuda.synchronize()
        seg.close()

    def ask(line):
        p.stdin.write(line + "\n")
        p.stdin.flush()
        return json.loads(p.stdout.readline())

    for label, nbytes, iters in SIZES:
        r = results.setdefault(label, {})
        for key, spin, rounds in (("gpushm", 0, iters), ("gpushm spin", SPIN_US, iters // 2)):
            times, phases = [], {}
            for i in range(WARMUP + rounds):
                name = f"bench-{nbytes}-{i}"
                put(name, nbytes, i)
                out = ask(f"open {name} {i} {spin}")
                c.unlink(name)
                if i >= WARMUP:
                    times.append(out["total"])
                    for k, v in out["phases"].items():
                        phases.setdefault(k, []).append(v)
            r[key], r[key + " phases"] = times, phases
        for i in range(BATCH):
            put(f"batch-{nbytes}-{i}", nbytes, i)
        r["gpushm batch"] = ask(f"batch batch-{nbytes} {BATCH} 0")
        for i in range(BATCH):
            c.unlink(f"batch-{nbytes}-{i}")
    seg = c.create("bench-reopen", shape=(1 << 20,), dtype="float32", device=0)
    results["reopen"] = ask(f"reopen bench-reopen {REOPENS} 0")
    p.stdin.close()
    p.wait()
    seg.close()
    c.unlink("bench-reopen")


def mp_consumer(q, conn):
    import torch

    torch.zeros(1, device="cuda")
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        kind, n = msg
        times = []
        for i in range(n if kind == "batch" else 1):
            t0 = time.perf_counter()
            t = q.get()
            v = t[0].item()                      # first read
            times.append(time.perf_counter() - t0)
            assert v == float(i if kind == "batch" else n), (v, msg)
            del t
        conn.send(times)


def bench_torch_mp(results):
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")                # never fork a CUDA process
    q = ctx.Queue()
    parent, child = ctx.Pipe()
    p = ctx.Process(target=mp_consumer, args=(q, child))
    p.start()
    assert parent.recv() == "ready"
    for label, nbytes, iters in SIZES:
        times = []
        for i in range(WARMUP + iters):
            x = torch.full((nbytes // 4,), float(i), device="cuda")
            torch.cuda.synchronize()
            q.put(x)
            time.sleep(0.01)                     # the queue's feeder thread has sent it
            parent.send(("one", i))
            dt = parent.recv()[0]
            del x
            if i >= WARMUP:
                times.append(dt)
        results[label]["torch.mp"] = times
        xs = [torch.full((nbytes // 4,), float(i), device="cuda") for i in range(BATCH)]
        torch.cuda.synchronize()
        for x in xs:
            q.put(x)
        time.sleep(0.2)
        parent.send(("batch", BATCH))
        results[label]["torch.mp batch"] = parent.recv()
        del xs, x
        torch.cuda.empty_cache()
    parent.send(None)
    p.join()


def main():
    import torch

    results = {}
    bench_gpushm(results)
    bench_torch_mp(results)
    us = 1e6
    dev = torch.cuda.get_device_name(0)

    def cell(xs):
        return f"{pct(xs, 50) * us:>9.0f}us {pct(xs, 99) * us:>7.0f}us"

    print(f"name -> CUDA tensor in a second process, first element read (p50, p99); {dev}; "
          f"{datetime.date.today()}; python3 python/bench/bench_torch.py")
    print("\none at a time (the consumer sleeps until one tensor is ready):")
    print(f"{'size':>8} {'rounds':>6} {'gpushm':>20} {'gpushm spin_us=200':>20} {'torch.mp':>20}  ratio p50 (torch.mp/gpushm, /spin)")
    for label, _, iters in SIZES:
        r = results[label]
        g, gs, t = r["gpushm"], r["gpushm spin"], r["torch.mp"]
        print(f"{label:>8} {iters:>6} {cell(g)} {cell(gs)} {cell(t)}  "
              f"{pct(t, 50) / pct(g, 50):>5.1f}x {pct(t, 50) / pct(gs, 50):>5.1f}x")
    print(f"\nback to back ({BATCH} ready, the consumer takes them in a row):")
    print(f"{'size':>8} {'rounds':>6} {'gpushm':>20} {'torch.mp':>20}  ratio p50")
    for label, _, _ in SIZES:
        r = results[label]
        g, t = r["gpushm batch"], r["torch.mp batch"]
        print(f"{label:>8} {BATCH:>6} {cell(g)} {cell(t)}  {pct(t, 50) / pct(g, 50):>5.1f}x")
    print("\nwhere gpushm's time goes one at a time, p50 of each phase in order (us):")
    for label, _, _ in SIZES:
        for key in ("gpushm", "gpushm spin"):
            ph = results[label][key + " phases"]
            print(f"{label:>8} {key:<12}" + "  ".join(f"{k} {pct(v, 50) * us:.0f}" for k, v in ph.items()))
    r = results["reopen"]
    print(f"\nreopen of a segment already mapped in the consumer ({REOPENS} rounds): "
          f"open p50 {pct(r['open'], 50) * us:.1f}us p99 {pct(r['open'], 99) * us:.1f}us; "
          f"open + torch.from_dlpack p50 {pct(r['open_from_dlpack'], 50) * us:.1f}us "
          f"p99 {pct(r['open_from_dlpack'], 99) * us:.1f}us")
    print(f"a daemon round trip (stat) from Python, back to back: p50 {pct(r['stat'], 50) * us:.1f}us "
          f"p99 {pct(r['stat'], 99) * us:.1f}us")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench.json"), "w") as f:
            json.dump({"device": dev, "results": results}, f)


if __name__ == "__main__":
    main()
