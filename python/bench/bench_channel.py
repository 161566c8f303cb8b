"""A stream of tensors to another process: a gpushm channel against a
torch.multiprocessing queue of CUDA tensors, in the same run.

For each message size (default 4 KiB, 1 MiB, 64 MiB; float32 tensors) it
measures both ways of handing tensors over, from this process (the
producer) to a consumer process:

hand-off latency, one message at a time
    t0  the producer's clock just before the hand-over: for gpushm the last
        statement inside `with tx.send() as t:`, after the kernel that fills
        the slot (t.fill_(k)) was queued; for torch.mp just before
        q.put(x), x = torch.full(..., k) having been queued.
    t1  the consumer's clock once the tensor is usable: `with rx.recv() as
        t:` has returned (its stream now waits, on the GPU, for the
        producer's fill, so work queued next reads message k); for torch.mp
        q.get() has returned (torch made the consumer's stream wait for the
        producer's event).
    hand-off = t1 - t0. Both clocks are time.perf_counter_ns(), i.e.
    CLOCK_MONOTONIC, one clock for every process of the machine.
    first read = t2 - t0, t2 once t[0].item() returned k: the data reached
    the consumer's CPU through the GPU's ordering (a copy and a stream
    synchronize on the consumer's side; the value is checked).
    The producer sends message k+1 only after the consumer has finished
    message k and a pause (--gap-us, default 1000) has passed, so that the
    consumer is asleep (futex, or the queue's pipe) when the message comes,
    as a pipeline stage idle between inputs. Warm-up messages are dropped.

messages per second, back to back
    The producer sends --count messages as fast as it can (fill kernel,
    hand-over); the consumer adds t[0] of each into an accumulator (one
    kernel on its stream) and releases it. Timed in the consumer from the
    first message received to the last one done, after a final synchronize
    of its GPU work; the accumulator is checked against sum(range(count)).
    torch.mp's queue holds at most --slots tensors, as the channel does.

The GPU run needs torch, a GPU, and the gpushm binary; it starts a daemon
on the cuda backend of its own:

    PYTHONPATH=python python3 python/bench/bench_channel.py --bin .gpu/gpushm

--smoke runs the same steps without torch or a GPU: numpy arrays on a
host-backend daemon, and a multiprocessing queue of numpy arrays as the
peer; 4 KiB, a handful of messages. Its figures mean nothing: it exists so
that a change that breaks this benchmark fails ./scripts/test.

Flags: --bin (default $GPUSHM_BIN, else .gpu/gpushm), --sizes, --latency N
(messages one at a time per size, default 300), --count N (back to back per
size, default 20000 at 4 KiB, 5000 at 1 MiB, 1000 at 64 MiB, a quarter of
that for torch.mp), --slots (4), --gap-us (1000), --warmup (20).

Prints tables and PASS/FAIL lines for the targets (p50 hand-off at least 5x
lower than torch.mp at every size; reported: over 50,000 messages/s at 4
KiB, which 'gpushm bench channel' judges on Go ends, and the moonshot,
p50 under 20 us); exits 1 when a message was wrong
or a target missed (not in --smoke). With $OUT set, also writes
$OUT/bench_channel.json.
"""

import argparse
import datetime
import json
import multiprocessing
import os
import re
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

now = time.perf_counter_ns


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


# ---- what a tensor is: torch on a GPU, or numpy on host memory ----------------

class Torch:
    mode, backend, framework, peer = "gpu", "cuda", "torch", "torch.mp"

    def __init__(self):
        import torch

        self.torch = torch

    def start(self):
        self.torch.zeros(1, device="cuda")  # CUDA up before any timing

    def fill(self, t, k):
        t.fill_(k)

    def full(self, n, k):
        return self.torch.full((n,), float(k), device="cuda")

    def zero(self):
        return self.torch.zeros((), dtype=self.torch.float64, device="cuda")

    def sync(self):
        self.torch.cuda.synchronize()

    def mp(self):
        import torch.multiprocessing as mp

        return mp.get_context("spawn")  # never fork a CUDA process

    def device(self):
        return self.torch.cuda.get_device_name(0)


class Host:
    mode, backend, framework, peer = "smoke", "host", "numpy", "mp numpy"

    def __init__(self):
        import numpy

        self.np = numpy

    def start(self):
        pass

    def fill(self, t, k):
        t.fill(k)

    def full(self, n, k):
        return self.np.full(n, k, dtype=self.np.float32)

    def zero(self):
        return self.np.zeros((), dtype=self.np.float64)

    def sync(self):
        pass

    def mp(self):
        return multiprocessing.get_context("spawn")

    def device(self):
        return "host memory (smoke run: figures mean nothing)"


FRAMEWORKS = {"gpu": Torch, "smoke": Host}


# ---- consumers (spawned processes) ----------------------------------------------

def _latency_loop(get, conn, count):
    """Takes count messages one at a time; get() gives a context manager
    whose value is the tensor."""
    t1s, t2s, bad = [], [], []
    for k in range(count):
        with get() as t:
            t1 = now()
            v = t[0].item()
            t2 = now()
        if v != k:
            bad.append((k, v))
        t1s.append(t1)
        t2s.append(t2)
        conn.send(k)  # done: the producer may go on
    return {"t1": t1s, "t2": t2s, "bad": bad[:10]}


def _spin():
    """The ends' spin_us (--spin-us), passed to the spawned consumer through
    the environment; {} for the library's default."""
    v = os.environ.get("BENCH_CHANNEL_SPIN_US")
    return {} if v is None else {"spin_us": int(v)}


def _throughput_loop(fw, get, count):
    acc = fw.zero()
    start = None
    for k in range(count):
        with get() as t:
            if start is None:
                start = now()
            acc += t[0]
    fw.sync()
    end = now()
    want = count * (count - 1) / 2
    return {"start": start, "end": end, "acc": float(acc), "want": want}


class _Got:
    """A context manager over a tensor taken from a queue."""

    def __init__(self, t):
        self.t = t

    def __enter__(self):
        return self.t

    def __exit__(self, *exc):
        self.t = None


def consume_channel(mode, sock, conn):
    import gpushm

    fw = FRAMEWORKS[mode]()
    fw.start()
    c = gpushm.connect(sock)
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        kind, name, count = cmd
        rx = c.channel(name, framework=fw.framework, **_spin())
        conn.send("open")
        if kind == "latency":
            out = _latency_loop(rx.recv, conn, count)
        else:
            out = _throughput_loop(fw, rx.recv, count)
        rx.close()
        conn.send(out)
    c.close()


def consume_queue(mode, q, conn):
    fw = FRAMEWORKS[mode]()
    fw.start()
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        kind, _, count = cmd
        conn.send("open")
        get = lambda: _Got(q.get())  # noqa: E731
        if kind == "latency":
            out = _latency_loop(get, conn, count)
        else:
            out = _throughput_loop(fw, get, count)
        conn.send(out)


# ---- the producer ---------------------------------------------------------------

def run_peer(fw, ctx, target, args_, sizes, a, send_one, send_many, setup=None, teardown=None):
    """Drives one consumer process through every size; send_one(state, k,
    n) hands one message over and returns t0; send_many(state, count, n)
    hands count over back to back, in the loop a program would write (no
    clock read, no call a message beyond the library's)."""
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(*args_, child))
    p.start()
    results = {}
    try:
        if parent.recv() != "ready":
            raise SystemExit("bench_channel: a consumer failed to start")
        for label, nbytes, count in sizes:
            n = nbytes // 4
            r = results[label] = {}
            for kind, msgs in (("latency", a.warmup + a.latency), ("throughput", count)):
                state = setup(label, nbytes) if setup else None
                parent.send((kind, f"bench-ch-{nbytes}", msgs))
                if parent.recv() != "open":
                    raise SystemExit("bench_channel: the consumer did not open")
                if kind == "latency":
                    t0s = []
                    for k in range(msgs):
                        t0s.append(send_one(state, k, n))
                        if parent.recv() != k:
                            raise SystemExit("bench_channel: the consumer lost step")
                        time.sleep(a.gap_us / 1e6)
                    out = parent.recv()
                    w = a.warmup
                    r["handoff"] = [(t1 - t0) / 1e3 for t0, t1 in zip(t0s[w:], out["t1"][w:])]
                    r["first_read"] = [(t2 - t0) / 1e3 for t0, t2 in zip(t0s[w:], out["t2"][w:])]
                    r["bad"] = out["bad"]
                else:
                    send_many(state, msgs, n)
                    out = parent.recv()
                    r["count"] = msgs
                    r["msgs_per_s"] = (msgs - 1) / max((out["end"] - out["start"]) / 1e9, 1e-9)
                    r["sum_ok"] = out["acc"] == out["want"]
                if teardown:
                    teardown(state)
        parent.send(None)
        p.join(60)
        if p.exitcode != 0:
            raise SystemExit(f"bench_channel: a consumer exited with status {p.exitcode}")
    finally:
        if p.is_alive():
            p.kill()
            p.join()
    return results


def bench_gpushm(fw, a, sock, sizes):
    import gpushm

    c = gpushm.connect(sock)
    if c.backend != fw.backend:
        raise SystemExit(f"bench_channel: the daemon has the {c.backend} backend; this run needs {fw.backend}")

    def setup(label, nbytes):
        kw = {"device": 0} if fw.backend == "cuda" else {}
        return c.channel(f"bench-ch-{nbytes}", shape=(nbytes // 4,), dtype="float32", slots=a.slots,
                         framework=fw.framework, **kw, **_spin())

    def send_one(tx, k, n):
        with tx.send() as t:
            fw.fill(t, k)
            t0 = now()
        return t0

    def send_many(tx, count, n):
        if fw.mode == "gpu":
            for k in range(count):
                with tx.send() as t:
                    t.fill_(k)
        else:
            for k in range(count):
                with tx.send() as t:
                    t.fill(k)

    def teardown(tx):
        tx.close()
        c.unlink(tx.name)

    try:
        return run_peer(fw, fw.mp(), consume_channel, (fw.mode, sock), sizes, a, send_one, send_many, setup,
                        teardown)
    finally:
        c.close()


def bench_queue(fw, a, sizes):
    ctx = fw.mp()
    q = ctx.Queue(maxsize=a.slots)

    def send_one(_, k, n):
        x = fw.full(n, k)
        t0 = now()
        q.put(x)
        return t0

    def send_many(_, count, n):
        full, put = fw.full, q.put
        for k in range(count):
            put(full(n, k))

    # torch.mp is slower: a quarter of the messages back to back.
    sizes = [(label, nbytes, max(2, count // 4)) for label, nbytes, count in sizes]
    return run_peer(fw, ctx, consume_queue, (fw.mode, q), sizes, a, send_one, send_many)


# ---- flags, the daemon, tables -----------------------------------------------------

_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}
_COUNTS = {4 << 10: 20000, 1 << 20: 5000, 64 << 20: 1000}


def parse_sizes(s, count):
    out = []
    for part in s.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*([KMG]iB|B)?\s*", part, re.IGNORECASE)
        n = int(m.group(1)) * _UNITS[(m.group(2) or "").upper()] if m else 0
        if n <= 0 or n % 4:
            raise argparse.ArgumentTypeError(f"size {part!r}: want a positive multiple of 4 bytes, such as 4KiB or 1MiB")
        label = next(f"{n // u} {name}" for name, u in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("B", 1))
                     if n % u == 0)
        out.append((label, n, count or _COUNTS.get(n, max(100, (20000 * 4096) // n))))
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(prog="bench_channel.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true",
                   help="numpy on a host-backend daemon and a multiprocessing queue of numpy arrays, 4 KiB, "
                        "a handful of messages: checks that the benchmark runs; its figures mean nothing")
    p.add_argument("--bin", default=os.environ.get("GPUSHM_BIN") or ".gpu/gpushm", help="the gpushm binary")
    p.add_argument("--sizes", help="comma-separated message sizes (default 4KiB,1MiB,64MiB; smoke 4KiB)")
    p.add_argument("--latency", type=int, help="messages one at a time per size (default 300; smoke 5)")
    p.add_argument("--count", type=int, help="messages back to back per size (default by size; smoke 20)")
    p.add_argument("--slots", type=int, default=4, help="slots of the channel, and room in the queue (default 4)")
    p.add_argument("--gap-us", type=float, help="pause between messages one at a time (default 1000; smoke 100)")
    p.add_argument("--warmup", type=int, help="messages one at a time dropped first (default 20; smoke 1)")
    p.add_argument("--spin-us", type=int, help="how long both ends poll before sleeping on the futex "
                                               "(default: the library's, 50 us): CPU for latency")
    a = p.parse_args(argv)
    if a.spin_us is not None:
        if a.spin_us < 0:
            p.error(f"--spin-us {a.spin_us}: want 0 or more")
        os.environ["BENCH_CHANNEL_SPIN_US"] = str(a.spin_us)
    smoke = a.smoke
    for k, gpu, sm in (("sizes", "4KiB,1MiB,64MiB", "4KiB"), ("latency", 300, 5), ("count", None, 20),
                       ("gap_us", 1000.0, 100.0), ("warmup", 20, 1)):
        if getattr(a, k) is None:
            setattr(a, k, sm if smoke else gpu)
    for k, least in (("latency", 1), ("count", 2), ("slots", 1), ("warmup", 0)):
        v = getattr(a, k)
        if v is not None and v < least:
            p.error(f"--{k.replace('_', '-')} {v}: want at least {least}")
    try:
        a.sizes = parse_sizes(a.sizes, a.count)
    except argparse.ArgumentTypeError as e:
        p.error(f"--sizes: {e}")
    return a


def start_daemon(gbin, backend):
    """The daemon of gpushm.testing, which the tests use too."""
    if not (os.path.isfile(gbin) and os.access(gbin, os.X_OK)):
        raise SystemExit(f"bench_channel: no gpushm binary at {gbin} (build one: go build -o .gpu/gpushm ./cmd/gpushm; pass --bin)")
    from gpushm import testing

    try:
        return testing.Daemon(backend, "--log-level", "warn", binary=gbin)
    except RuntimeError as e:
        raise SystemExit(f"bench_channel: {e}") from None


def report(fw, a, g, q, argv):
    failures = []

    def verdict(ok, what, judged=True):
        """A target (judged unless --smoke) or a check of contents (always)."""
        tag = ("PASS" if ok else "FAIL") if judged else "INFO"
        print(f"{tag}  {what}")
        if judged and not ok:
            failures.append(what)

    peer = fw.peer
    print(f"a stream of float32 tensors to another process: gpushm channel ({a.slots} slots) against {peer}; "
          f"{fw.device()}; {datetime.date.today()}; python3 python/bench/bench_channel.py {' '.join(argv)}".rstrip())
    print(f"\nhand-off latency, one at a time ({a.latency} messages, {a.gap_us:g} us apart), "
          f"producer's hand-over to the consumer holding the tensor (us):")
    print(f"{'size':>8}  {'gpushm p50':>10} {'p99':>8} {'first read':>10}   {peer + ' p50':>13} {'p99':>8} "
          f"{'first read':>10}   {'ratio p50':>9}")
    for label, _, _ in a.sizes:
        x, y = g[label], q[label]
        print(f"{label:>8}  {pct(x['handoff'], 50):>10.1f} {pct(x['handoff'], 99):>8.1f} {pct(x['first_read'], 50):>10.1f}   "
              f"{pct(y['handoff'], 50):>13.1f} {pct(y['handoff'], 99):>8.1f} {pct(y['first_read'], 50):>10.1f}   "
              f"{pct(y['handoff'], 50) / pct(x['handoff'], 50):>8.1f}x")
    print("\nmessages per second, back to back (each filled by a kernel, read by one):")
    print(f"{'size':>8}  {'gpushm':>10} {'msgs':>7} {'GB/s':>7}   {peer:>10} {'msgs':>7} {'GB/s':>7}   {'ratio':>7}")
    for label, nbytes, _ in a.sizes:
        x, y = g[label], q[label]
        print(f"{label:>8}  {x['msgs_per_s']:>10.0f} {x['count']:>7} {x['msgs_per_s'] * nbytes / 1e9:>7.2f}   "
              f"{y['msgs_per_s']:>10.0f} {y['count']:>7} {y['msgs_per_s'] * nbytes / 1e9:>7.2f}   "
              f"{x['msgs_per_s'] / y['msgs_per_s']:>6.1f}x")
    print()
    for label, _, _ in a.sizes:
        for who, r in (("gpushm", g[label]), (peer, q[label])):
            ok = not r["bad"] and r["sum_ok"]
            verdict(ok, f"{label} {who}: every message held what was sent" +
                    ("" if ok else f" (wrong: {r['bad']}, sum ok: {r['sum_ok']})"))
    worst = min(pct(q[label]["handoff"], 50) / pct(g[label]["handoff"], 50) for label, _, _ in a.sizes)
    target = fw.mode != "smoke"
    verdict(worst >= 5, f"p50 hand-off latency at least 5x lower than {peer} at every size (worst {worst:.1f}x)", target)
    small = [(label, g[label]) for label, n, _ in a.sizes if n == 4 << 10]
    if small:
        # The 50,000 a second is the channel's target; Python with torch on
        # both ends is bound by its own per-message work (docs/benchmarks.md,
        # issue 29 part 2), so the target is judged on two compiled ends
        # ('gpushm bench channel', scripts/gpu-channel) and reported here.
        rate = small[0][1]["msgs_per_s"]
        verdict(rate > 50000, f"over 50,000 messages/s at 4 KiB from Python with torch on both ends ({rate:.0f}; "
                              f"judged on Go ends: gpushm bench channel)", judged=False)
    best = max(pct(g[label]["handoff"], 50) for label, _, _ in a.sizes)
    verdict(best < 20, f"moonshot: p50 hand-off under 20 us at every size (largest {best:.1f} us)", judged=False)
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)  # a fresh machine's $OUT may not exist yet
        with open(os.path.join(os.environ["OUT"], "bench_channel.json"), "w") as f:
            json.dump({"device": fw.device(), "mode": fw.mode, "gpushm": g, "peer": q}, f)
    return failures


def main(argv):
    a = parse_args(argv)
    try:
        fw = FRAMEWORKS["smoke" if a.smoke else "gpu"]()
    except ImportError as e:
        need = "--smoke needs numpy" if a.smoke else "the GPU run needs torch (--smoke needs only numpy)"
        raise SystemExit(f"bench_channel: {e}: {need}") from None
    fw.start()
    daemon = start_daemon(a.bin, fw.backend)
    try:
        g = bench_gpushm(fw, a, daemon.socket, a.sizes)
    finally:
        daemon.stop(20)
    q = bench_queue(fw, a, a.sizes)
    failures = report(fw, a, g, q, argv)
    if failures:
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
