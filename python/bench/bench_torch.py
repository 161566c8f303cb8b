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
  back to back   --batch tensors are ready; the consumer takes them in a row
gpushm one at a time runs twice: with a client that sleeps for each reply,
and with one connected with spin_us=200 (polls for the daemon's reply
before sleeping).

Then, in the consumer: reopen of a segment it already has mapped (served
from the client's cache, validated by the epoch page), and a plain daemon
round trip (stat).

The GPU run needs torch, a GPU and a daemon on the cuda backend:

  GPUSHM_SOCKET=/tmp/g.sock python3 python/bench/bench_torch.py

--smoke runs the same steps without torch or a GPU, against a daemon on the
host backend: numpy arrays over host segments stand in for CUDA tensors,
and a multiprocessing queue of numpy arrays for torch.multiprocessing; one
size (2 MiB), a few rounds. Its figures mean nothing: it exists so that a
change to the client that breaks this benchmark fails ./scripts/test, which
runs it (scripts/bench-smoke):

  GPUSHM_SOCKET=/tmp/h.sock python3 python/bench/bench_torch.py --smoke

Flags (defaults for the GPU run; --smoke changes them to 2MiB, 3, 3, 10, 1):
  --sizes 2MiB,64MiB,1GiB  tensor sizes (KiB, MiB, GiB or bytes; multiples of 4)
  --iters N        rounds one at a time per size (default 200, 100 from 1 GiB)
  --batch 50       tensors back to back per size
  --reopens 2000   rounds of the reopen and round-trip measurements
  --warmup 5       untimed rounds before each one-at-a-time measurement

Prints tables; with $OUT set, also writes $OUT/bench.json.
"""

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time

SPIN_US = 200
GPU_DEFAULTS = {"sizes": "2MiB,64MiB,1GiB", "iters": None, "batch": 50, "reopens": 2000, "warmup": 5}
SMOKE_DEFAULTS = {"sizes": "2MiB", "iters": 3, "batch": 3, "reopens": 10, "warmup": 1}


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


# ---- what a tensor is: torch on a GPU, or numpy over host memory -------------

class Torch:
    """CUDA tensors, handed off by torch.multiprocessing: the run that
    measures."""

    mode, backend, peer, from_dlpack = "gpu", "cuda", "torch.mp", "torch.from_dlpack"

    def __init__(self):
        import torch

        self.torch = torch

    def start(self):
        self.torch.zeros(1, device="cuda")  # CUDA up before any timing

    def tensor(self, seg):
        return self.torch.from_dlpack(seg)

    def fill(self, seg, value):
        self.torch.from_dlpack(seg).fill_(value)
        self.torch.cuda.synchronize()

    def full(self, n, value):
        return self.torch.full((n,), value, device="cuda")

    def sync(self):
        self.torch.cuda.synchronize()

    def free_cache(self):
        self.torch.cuda.empty_cache()

    def mp_context(self):
        import torch.multiprocessing as mp

        return mp.get_context("spawn")  # never fork a CUDA process

    def device(self):
        return self.torch.cuda.get_device_name(0)


class Host:
    """numpy arrays over host segments, handed off by a multiprocessing
    queue of numpy arrays: the same steps without torch or a GPU."""

    mode, backend, peer, from_dlpack = "smoke", "host", "mp numpy", "numpy.from_dlpack"

    def __init__(self):
        import numpy

        self.np = numpy

    def start(self):
        pass

    def tensor(self, seg):
        return self.np.from_dlpack(seg)  # the path torch.from_dlpack takes

    def fill(self, seg, value):
        seg.numpy().fill(value)  # numpy's DLPack arrays may be read-only

    def full(self, n, value):
        return self.np.full(n, value, dtype=self.np.float32)

    def sync(self):
        pass

    def free_cache(self):
        pass

    def mp_context(self):
        import multiprocessing

        return multiprocessing.get_context("spawn")

    def device(self):
        return "host memory (smoke run: figures mean nothing)"


FRAMEWORKS = {"gpu": Torch, "smoke": Host}

# The timestamps each first open must leave, in order; a change to the
# client that moves them shows up as a missing phase.
PHASES = {
    "gpu": ["reply", "import", "reserve", "map", "access", "release", "close", "segment", "from_dlpack", "item"],
    "smoke": ["reply", "map", "close", "segment", "from_dlpack", "item"],
}


# ---- the consumer process ---------------------------------------------------

def consumer(fw):
    """Reads commands on stdin, answers each with one JSON line."""
    import gpushm
    from gpushm import _core, _cuda, _mapping

    fw.start()
    clients = {}

    def client(spin):
        if spin not in clients:
            clients[spin] = gpushm.connect(spin_us=spin)
        return clients[spin]

    client(0)
    marks = {}

    # Timestamps inside the open path, to tell where the time goes: each
    # wraps a call and records when it first returns in a take (after a
    # mark named in after, when given). The wrappers pass every argument
    # through, so a changed signature cannot break them; a call that is
    # gone fails here, at once.
    def stamp(obj, attr, key, after=None):
        try:
            f = getattr(obj, attr)
        except AttributeError:
            raise SystemExit(f"bench_torch: {getattr(obj, '__name__', obj)!s} has no {attr} any more; "
                             f"update the timestamps in consumer()") from None

        def timed(*args, **kwargs):
            try:
                return f(*args, **kwargs)
            finally:
                if key not in marks and (after is None or after in marks):
                    marks[key] = time.perf_counter()
        setattr(obj, attr, timed)

    stamp(_core.Core, "_round_trip", "reply")  # the open's round trip comes first
    if fw.backend == "cuda":
        cu = _cuda.driver()
        stamp(cu, "cuMemImportFromShareableHandle", "import")
        stamp(cu, "cuMemAddressReserve", "reserve")
        stamp(cu, "cuMemMap", "map")
        stamp(cu, "cuMemSetAccess", "access")
        stamp(cu, "cuCtxPopCurrent", "release", after="access")  # import_map's context popped
        stamp(os, "close", "close", after="release")  # the descriptor, once mapped
    else:
        stamp(_mapping, "mmap", "map")
        stamp(os, "close", "close", after="map")

    def take(c, name, want):
        t0 = time.perf_counter()
        s = c.open(name)
        marks["segment"] = time.perf_counter()
        t = fw.tensor(s)
        marks["from_dlpack"] = time.perf_counter()
        del s
        v = t[0].item()  # first read
        t1 = marks["item"] = time.perf_counter()
        assert v == float(want), (v, want)
        del t  # unmapped here, untimed
        return t0, t1

    print("ready", flush=True)
    for line in sys.stdin:
        cmd, name, arg, spin = line.split()
        c = client(int(spin))
        if cmd == "open":
            marks.clear()
            t0, t1 = take(c, name, arg)
            prev, phases = t0, {}
            for k, m in sorted(marks.items(), key=lambda kv: kv[1]):
                phases[k], prev = m - prev, m
            print(json.dumps({"total": t1 - t0, "phases": phases}), flush=True)
        elif cmd == "batch":
            times = []
            for i in range(int(arg)):
                t0, t1 = take(c, f"{name}-{i}", i)
                times.append(t1 - t0)
            print(json.dumps(times), flush=True)
        elif cmd == "reopen":
            keep = fw.tensor(c.open(name))  # noqa: F841 (mapped from here on)
            opens, tensors, stats = [], [], []
            for _ in range(int(arg)):
                t0 = time.perf_counter()
                s = c.open(name)
                opens.append(time.perf_counter() - t0)
                del s
            for _ in range(int(arg)):
                t0 = time.perf_counter()
                x = fw.tensor(c.open(name))
                tensors.append(time.perf_counter() - t0)
                del x
            for _ in range(int(arg)):
                t0 = time.perf_counter()
                c.stat(name)
                stats.append(time.perf_counter() - t0)
            print(json.dumps({"open": opens, "open_from_dlpack": tensors, "stat": stats}), flush=True)
        else:
            raise SystemExit(f"bench_torch consumer: unknown command {line!r}")


# ---- the producer -----------------------------------------------------------

def bench_gpushm(fw, args, results):
    import gpushm

    c = gpushm.connect()
    if c.backend != fw.backend:
        hint = "pass --smoke" if c.backend == "host" else "drop --smoke"
        raise SystemExit(f"bench_torch: the daemon at {c.socket} has the {c.backend} backend; "
                         f"this run needs {fw.backend} ({hint})")
    p = subprocess.Popen([sys.executable, "-u", os.path.abspath(__file__), "--consumer", fw.mode],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if p.stdout.readline().strip() != "ready":
            raise SystemExit("bench_torch: the consumer process failed to start (its error is above)")

        def put(name, nbytes, value):
            seg = c.create(name, shape=(nbytes // 4,), dtype="float32", device=0)
            fw.fill(seg, float(value))
            seg.close()

        def ask(line):
            p.stdin.write(line + "\n")
            p.stdin.flush()
            out = p.stdout.readline()
            if not out:
                raise SystemExit(f"bench_torch: the consumer process died on {line!r} (its error is above)")
            return json.loads(out)

        want, checked = PHASES[fw.mode], False
        for label, nbytes, iters in args.sizes:
            r = results.setdefault(label, {})
            for key, spin, rounds in (("gpushm", 0, iters), ("gpushm spin", SPIN_US, max(1, iters // 2))):
                times, phases = [], {}
                for i in range(args.warmup + rounds):
                    name = f"bench-{nbytes}-{i}"
                    put(name, nbytes, i)
                    out = ask(f"open {name} {i} {spin}")
                    c.unlink(name)
                    if not checked:
                        check_phases(fw, want, list(out["phases"]))
                        checked = True
                    if i >= args.warmup:
                        times.append(out["total"])
                        for k, v in out["phases"].items():
                            phases.setdefault(k, []).append(v)
                r[key], r[key + " phases"] = times, phases
            for i in range(args.batch):
                put(f"batch-{nbytes}-{i}", nbytes, i)
            r["gpushm batch"] = ask(f"batch batch-{nbytes} {args.batch} 0")
            for i in range(args.batch):
                c.unlink(f"batch-{nbytes}-{i}")
        seg = c.create("bench-reopen", shape=(1 << 20,), dtype="float32", device=0)
        results["reopen"] = ask(f"reopen bench-reopen {args.reopens} 0")
        p.stdin.close()
        if p.wait() != 0:
            raise SystemExit(f"bench_torch: the consumer process exited with status {p.returncode}")
        seg.close()
        c.unlink("bench-reopen")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        c.close()


def check_phases(fw, want, got):
    """Every timestamp of consumer() should have fired, in order."""
    if got == want:
        return
    msg = f"bench_torch: the open path's timestamps were {got}, want {want}: the client changed; update consumer()"
    if fw.mode == "smoke":
        raise SystemExit(msg)
    print(msg + " (the phase table below is incomplete)", file=sys.stderr)


def mp_consumer(mode, q, conn):
    fw = FRAMEWORKS[mode]()
    fw.start()
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
            v = t[0].item()  # first read
            times.append(time.perf_counter() - t0)
            assert v == float(i if kind == "batch" else n), (v, msg)
            del t
        conn.send(times)


def bench_mp(fw, args, results):
    ctx = fw.mp_context()
    q = ctx.Queue()
    parent, child = ctx.Pipe()
    p = ctx.Process(target=mp_consumer, args=(fw.mode, q, child))
    p.start()
    try:
        if parent.recv() != "ready":
            raise SystemExit("bench_torch: the queue consumer failed to start")
        for label, nbytes, iters in args.sizes:
            times = []
            for i in range(args.warmup + iters):
                x = fw.full(nbytes // 4, float(i))
                fw.sync()
                q.put(x)
                time.sleep(0.01)  # the queue's feeder thread has sent it
                parent.send(("one", i))
                dt = parent.recv()[0]
                del x
                if i >= args.warmup:
                    times.append(dt)
            results[label][fw.peer] = times
            xs = [fw.full(nbytes // 4, float(i)) for i in range(args.batch)]
            fw.sync()
            for x in xs:
                q.put(x)
            time.sleep(0.2)
            parent.send(("batch", args.batch))
            results[label][fw.peer + " batch"] = parent.recv()
            del xs, x
            fw.free_cache()
        parent.send(None)
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"bench_torch: the queue consumer exited with status {p.exitcode}")
    finally:
        if p.is_alive():
            p.kill()
            p.join()


# ---- flags and tables ---------------------------------------------------------

_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def parse_sizes(s, iters):
    """[(label, bytes, rounds)] from "2MiB,64MiB,1GiB"."""
    out = []
    for part in s.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*([KMG]iB|B)?\s*", part, re.IGNORECASE)
        n = int(m.group(1)) * _UNITS[(m.group(2) or "").upper()] if m else 0
        if n <= 0 or n % 4:
            raise argparse.ArgumentTypeError(
                f"size {part!r}: want a positive number of bytes, a multiple of 4 (float32 elements), such as 4KiB or 2MiB")
        label = next(f"{n // u} {name}" for name, u in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))
                     if n % u == 0)
        out.append((label, n, iters or (200 if n < 1 << 30 else 100)))
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="bench_torch.py", description=__doc__.split("\n\n")[0],
        epilog="The GPU run needs torch, a GPU and a daemon on the cuda backend at $GPUSHM_SOCKET; "
               "--smoke needs only numpy and a daemon on the host backend. See the module docstring.")
    p.add_argument("--smoke", action="store_true",
                   help="numpy over host segments and a multiprocessing queue instead of torch and CUDA, "
                        "against a host-backend daemon, at 2MiB with a few rounds: checks that the benchmark "
                        "still runs; its figures mean nothing")
    p.add_argument("--sizes", help=f"comma-separated tensor sizes (default {GPU_DEFAULTS['sizes']}; smoke {SMOKE_DEFAULTS['sizes']})")
    p.add_argument("--iters", type=int, help="rounds one at a time per size (default 200, 100 from 1 GiB; smoke 3)")
    p.add_argument("--batch", type=int, help="tensors back to back per size (default 50; smoke 3)")
    p.add_argument("--reopens", type=int, help="rounds of reopen and of stat (default 2000; smoke 10)")
    p.add_argument("--warmup", type=int, help="untimed rounds before each one-at-a-time measurement (default 5; smoke 1)")
    p.add_argument("--consumer", choices=sorted(FRAMEWORKS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.consumer:
        return args
    for k, v in (SMOKE_DEFAULTS if args.smoke else GPU_DEFAULTS).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for k, least in (("iters", 1), ("batch", 1), ("reopens", 1), ("warmup", 0)):
        v = getattr(args, k)
        if v is not None and v < least:
            p.error(f"--{k} {v}: want at least {least}")
    try:
        args.sizes = parse_sizes(args.sizes, args.iters)
    except argparse.ArgumentTypeError as e:
        p.error(f"--sizes: {e}")
    return args


def report(fw, args, results, argv):
    us = 1e6
    dev = fw.device()
    peer = fw.peer

    def cell(xs):
        return f"{pct(xs, 50) * us:>9.0f}us {pct(xs, 99) * us:>7.0f}us"

    print(f"name -> {'CUDA tensor' if fw.mode == 'gpu' else 'numpy array'} in a second process, first element read "
          f"(p50, p99); {dev}; {datetime.date.today()}; python3 python/bench/bench_torch.py {' '.join(argv)}".rstrip())
    print("\none at a time (the consumer sleeps until one tensor is ready):")
    print(f"{'size':>8} {'rounds':>6} {'gpushm':>20} {'gpushm spin_us=200':>20} {peer:>20}  ratio p50 ({peer}/gpushm, /spin)")
    for label, _, iters in args.sizes:
        r = results[label]
        g, gs, t = r["gpushm"], r["gpushm spin"], r[peer]
        print(f"{label:>8} {iters:>6} {cell(g)} {cell(gs)} {cell(t)}  "
              f"{pct(t, 50) / pct(g, 50):>5.1f}x {pct(t, 50) / pct(gs, 50):>5.1f}x")
    print(f"\nback to back ({args.batch} ready, the consumer takes them in a row):")
    print(f"{'size':>8} {'rounds':>6} {'gpushm':>20} {peer:>20}  ratio p50")
    for label, _, _ in args.sizes:
        r = results[label]
        g, t = r["gpushm batch"], r[peer + " batch"]
        print(f"{label:>8} {args.batch:>6} {cell(g)} {cell(t)}  {pct(t, 50) / pct(g, 50):>5.1f}x")
    print("\nwhere gpushm's time goes one at a time, p50 of each phase in order (us):")
    for label, _, _ in args.sizes:
        for key in ("gpushm", "gpushm spin"):
            ph = results[label][key + " phases"]
            print(f"{label:>8} {key:<12}" + "  ".join(f"{k} {pct(v, 50) * us:.0f}" for k, v in ph.items()))
    r = results["reopen"]
    print(f"\nreopen of a segment already mapped in the consumer ({args.reopens} rounds): "
          f"open p50 {pct(r['open'], 50) * us:.1f}us p99 {pct(r['open'], 99) * us:.1f}us; "
          f"open + {fw.from_dlpack} p50 {pct(r['open_from_dlpack'], 50) * us:.1f}us "
          f"p99 {pct(r['open_from_dlpack'], 99) * us:.1f}us")
    print(f"a daemon round trip (stat) from Python, back to back: p50 {pct(r['stat'], 50) * us:.1f}us "
          f"p99 {pct(r['stat'], 99) * us:.1f}us")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench.json"), "w") as f:
            json.dump({"device": dev, "mode": fw.mode, "results": results}, f)


def main(argv):
    args = parse_args(argv)
    if args.consumer:
        consumer(FRAMEWORKS[args.consumer]())
        return
    try:
        fw = FRAMEWORKS["smoke" if args.smoke else "gpu"]()
    except ImportError as e:
        need = "--smoke needs numpy" if args.smoke else "the GPU run needs torch (--smoke needs only numpy)"
        raise SystemExit(f"bench_torch: {e}: {need}") from None
    results = {}
    bench_gpushm(fw, args, results)
    bench_mp(fw, args, results)
    report(fw, args, results, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
