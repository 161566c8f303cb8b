#!/usr/bin/env python3
"""Where one channel message's time goes in Python, on both ends: the
budget behind bench_channel.py's messages per second.

    PYTHONPATH=python python3 python/bench/profile_channel.py --bin .gpu/gpushm
    PYTHONPATH=python python3 python/bench/profile_channel.py --smoke   # CI: host backend, numpy

It starts a daemon of its own (cuda backend with a GPU, else host), a
producer (this process) and a consumer (a spawned process), 4 KiB
float32 messages in 4 slots, each end with torch (numpy on the host
backend), and runs back to back as bench_channel.py does: the producer
fills each message with a kernel (t.fill_(k)), the consumer adds t[0] of
each into an accumulator, checked at the end.

Three passes: (1) the rate with the ends' spin_us=0 (an end sleeps as
soon as it must wait: every hand-off to it is a wake); (2) the same with
spin_us=50, the library's default (both poll 50 us before they sleep); (3)
with spin_us=0 again, every step of
each end timed with perf_counter_ns around the library's own calls (the
wrappers cost about 0.2 us each, counted in the step they wrap). The
table of pass 3 gives each step's mean per message on each end, and what
the pieces cost alone (a primitive timed 20,000 times in a row), and
again while the consumer's process launches kernels back to back (two
processes' contexts on one GPU make each launch and stream operation
dearer: docs/benchmarks.md, "Channels from Python"). Last,
one thread holds both ends and hands each message over at once: each
call's cost with nobody waiting or asleep, the channel's code alone.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))

now = time.perf_counter_ns
SIZE, SLOTS = 4096, 4


class Steps:
    """Accumulated ns by step name."""

    def __init__(self):
        self.ns, self.n = {}, {}

    def wrap(self, obj, attr, name):
        fn = getattr(obj, attr)
        ns, n = self.ns, self.n
        ns.setdefault(name, 0)
        n.setdefault(name, 0)

        def timed(*a, **kw):
            t = now()
            try:
                return fn(*a, **kw)
            finally:
                ns[name] += now() - t
                n[name] += 1

        setattr(obj, attr, timed)

    def add(self, name, dt):
        self.ns[name] = self.ns.get(name, 0) + dt
        self.n[name] = self.n.get(name, 0) + 1


def _instrument(ch, steps, role):
    from gpushm import _channel

    if role == "tx":
        steps.wrap(ch, "_wait_slot", "wait for a free slot (shared words, futex)")
    else:
        steps.wrap(ch, "_wait_message", "wait for the message (shared words, futex)")
    if ch._dev is not None:
        steps.wrap(ch, "_stream", "the framework's current stream")
        steps.wrap(ch, "_wait_value", "cuStreamWaitValue64 (ctypes)")
        steps.wrap(ch, "_write_value", "cuStreamWriteValue64 (ctypes)")
        if hasattr(ch, "_batch"):
            steps.wrap(ch, "_batch", "cuStreamBatchMemOp (ctypes)")
    steps.wrap(_channel, "_futex_wake", "futex wake (ctypes syscall)")


def _fw(gpu):
    if gpu:
        import torch

        torch.zeros(1, device="cuda")
        return torch, "torch"
    import numpy

    return numpy, "numpy"


def consumer(sock, gpu, conn):
    import gpushm

    mod, framework = _fw(gpu)
    c = gpushm.connect(sock)
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd is None:
            break
        if cmd[0] == "busy":
            # Kernels back to back on this process's GPU context, as a
            # consumer's would be, while the producer times its calls.
            x = mod.zeros(1024, **({"device": "cuda"} if gpu else {}))
            conn.send("busy")
            end = now() + int(cmd[1] * 1e9)
            while now() < end:
                for _ in range(100):
                    x += 1
            if gpu:
                mod.cuda.synchronize()
            conn.send("idle")
            continue
        name, count, spin, profile = cmd
        rx = c.channel(name, framework=framework, spin_us=spin)
        steps = Steps()
        if profile:
            _instrument(rx, steps, "rx")
        acc = mod.zeros((), dtype=mod.float64, **({"device": "cuda"} if gpu else {}))
        conn.send("open")
        start = None
        for k in range(count):
            t = now()
            msg = rx.recv()
            t1 = now()
            if start is None:
                start = t1
            x = msg.tensor
            v = x[0]
            t2 = now()
            acc += v
            t3 = now()
            msg.done()
            t4 = now()
            if profile:
                steps.add("recv() in all", t1 - t)
                steps.add("t[0] (a view)", t2 - t1)
                steps.add("acc += t[0] (a kernel)", t3 - t2)
                steps.add("done() in all", t4 - t3)
        if gpu:
            mod.cuda.synchronize()
        end = now()
        rx.close()
        conn.send({"start": start, "end": end, "ok": float(acc) == count * (count - 1) / 2,
                   "steps": {k: [steps.ns[k], steps.n[k]] for k in steps.ns}})
    c.close()


def primitives(ch, mod, gpu, n=20000):
    """What the pieces of a hand-off cost alone, ns each."""
    from gpushm import _channel

    out = {}

    def timeit(name, fn):
        fn()
        t = now()
        for _ in range(n):
            fn()
        out[name] = (now() - t) / n

    w = ch._head
    timeit("a shared word's .value (ctypes)", lambda: w.value)
    timeit("futex wake, nobody waiting (ctypes syscall)", lambda: _channel._futex_wake(ch._rx_ev_addr))
    if gpu:
        s = ch._stream()
        timeit("the current stream (torch._C)", ch._stream)
        a = ch._ctl_dev + _channel._OFF_FILLED
        timeit("cuStreamWriteValue64 (ctypes)", lambda: ch._write_value(s, a, 0))
        timeit("cuStreamWaitValue64 (ctypes), already true", lambda: ch._wait_value(s, a, 0))
        ops, spare = getattr(ch, "_ops", None), ch._ctl_dev + 2048  # words of the block that no one reads
        for m in (1, 4) if ops is not None else ():
            for i in range(m):
                ops[6 * i], ops[6 * i + 1], ops[6 * i + 2] = _channel._OP_WRITE, spare + 8 * i, 0
            timeit(f"cuStreamBatchMemOp, {m} cuStreamWriteValue64 (ctypes)", lambda: ch._batch(s, m))
        t = mod.zeros(SIZE // 4, device="cuda")
        timeit("t.fill_(k) (a torch kernel launch)", lambda: t.fill_(1.0))
        timeit("t[0] (a view)", lambda: t[0])

        def fill_write():
            t.fill_(1.0)
            ch._write_value(s, a, 0)

        timeit("t.fill_(k), then cuStreamWriteValue64 (a producer's two calls)", fill_write)
        mod.cuda.synchronize()
    else:
        t = mod.zeros(SIZE // 4, dtype=mod.float32)
        timeit("t.fill(k)", lambda: t.fill(1.0))
    return out


def handoffs(tx, rx, n):
    """ns per call of each end, one thread holding both (tx and rx) and
    handing each message over at once, n times after a round to warm up."""
    ns = {}
    for _ in range(2):
        ns = {"send()": 0, "done() (producer)": 0, "recv()": 0, "done() (consumer)": 0}
        for _ in range(n):
            t0 = now()
            m = tx.send()
            t1 = now()
            m.done()
            t2 = now()
            r = rx.recv()
            t3 = now()
            r.done()
            t4 = now()
            ns["send()"] += t1 - t0
            ns["done() (producer)"] += t2 - t1
            ns["recv()"] += t3 - t2
            ns["done() (consumer)"] += t4 - t3
    return {k: v / n for k, v in ns.items()}


def alone(sock, framework, gpu, n):
    """The channel's own code per message, with nobody waiting or asleep:
    one thread holds both ends (two clients) and hands each message over
    at once, n times; ns per call of each end."""
    import gpushm

    kw = {"device": 0} if gpu else {}
    c1, c2 = gpushm.connect(sock), gpushm.connect(sock)
    out = {}
    try:
        tx = c1.channel("profile-alone", shape=(SIZE // 4,), dtype="float32", slots=SLOTS, framework=framework, **kw)
        rx = c2.channel("profile-alone", framework=framework)
        out = handoffs(tx, rx, n)
        tx.close()
        rx.close()
        c1.unlink("profile-alone")
    finally:
        c1.close()
        c2.close()
    return out


def run(a):
    import gpushm
    from gpushm import testing

    gpu = a.backend == "cuda"
    mod, framework = _fw(gpu)
    d = testing.Daemon(a.backend, binary=a.bin, new_session=True)
    results = {}
    try:
        c = gpushm.connect(d.socket)
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        p = ctx.Process(target=consumer, args=(d.socket, gpu, child))
        p.start()
        assert parent.recv() == "ready"
        for label, spin, profile in (("spin_us=0", 0, False), ("spin_us=50", 50, False), ("timed steps", 0, True)):
            name = f"profile-{label.replace(' ', '-').replace('=', '')}"
            kw = {"device": 0} if gpu else {}
            tx = c.channel(name, shape=(SIZE // 4,), dtype="float32", slots=SLOTS, framework=framework,
                           spin_us=spin, **kw)
            steps = Steps()
            if profile:
                _instrument(tx, steps, "tx")
            parent.send((name, a.count, spin, profile))
            assert parent.recv() == "open"
            t0 = now()
            for k in range(a.count):
                t = now()
                msg = tx.send()
                t1 = now()
                if gpu:
                    msg.tensor.fill_(float(k))
                else:
                    msg.tensor.fill(k)
                t2 = now()
                msg.done()
                t3 = now()
                if profile:
                    steps.add("send() in all", t1 - t)
                    steps.add("t.fill_(k) (a kernel)" if gpu else "t.fill(k)", t2 - t1)
                    steps.add("done() in all", t3 - t2)
            t_end = now()
            got = parent.recv()
            rate = (a.count - 1) / max((got["end"] - got["start"]) / 1e9, 1e-9)
            results[label] = {"msgs_per_s": rate, "ok": got["ok"], "producer_per_msg_us": (t_end - t0) / a.count / 1e3,
                              "tx": {k: [steps.ns[k], steps.n[k]] for k in steps.ns}, "rx": got["steps"]}
            if profile:
                results["primitives"] = primitives(tx, mod, gpu)
                # The same while the consumer's process launches kernels
                # of its own: two processes' contexts share the GPU.
                parent.send(("busy", a.busy))
                assert parent.recv() == "busy"
                results["primitives beside"] = primitives(tx, mod, gpu, n=a.busy_n)
                assert parent.recv() == "idle"
            tx.close()
            c.unlink(name)
        results["alone"] = alone(d.socket, framework, gpu, a.count)
        parent.send(None)
        p.join(60)
    finally:
        d.stop()
    return results


def report(res, a):
    ok = all(r["ok"] for k, r in res.items() if k not in ("primitives", "primitives beside", "alone"))
    print(f"channel messages from Python, {SIZE // 1024} KiB, {SLOTS} slots, {a.count} back to back; backend {a.backend}")
    print("\n| pass | messages/s | producer's loop per message |\n| --- | ---: | ---: |")
    for k in ("spin_us=0", "spin_us=50", "timed steps"):
        r = res[k]
        print(f"| {k} | {r['msgs_per_s']:,.0f} | {r['producer_per_msg_us']:.1f} us |")
    prof = res["timed steps"]
    for end, title in (("tx", "producer"), ("rx", "consumer")):
        print(f"\n{title}, per message (mean over {a.count}):\n\n| step | us |\n| --- | ---: |")
        for k, (ns, n) in prof[end].items():
            print(f"| {k} | {ns / max(n, 1) / 1e3:.2f} ({n / a.count:.2f} per message) |")
    print("\nthe pieces alone, and while the consumer's process launches kernels back to back:\n\n"
          "| piece | alone, us | beside, us |\n| --- | ---: | ---: |")
    for k, v in res["primitives"].items():
        print(f"| {k} | {v / 1e3:.2f} | {res['primitives beside'].get(k, 0) / 1e3:.2f} |")
    print(f"\none thread holding both ends, each message handed over at once (nobody waits):\n\n"
          f"| call | us |\n| --- | ---: |")
    for k, v in res["alone"].items():
        print(f"| {k} | {v / 1e3:.2f} |")
    print(("PASS" if ok else "FAIL") + " every accumulator held the sum of what was sent")
    return 0 if ok else 1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default=os.environ.get("GPUSHM_BIN") or ".gpu/gpushm")
    p.add_argument("--count", type=int, help="messages back to back per pass (default 20000; smoke 200)")
    p.add_argument("--slots", type=int, default=SLOTS, help="slots of the channel (default 4, as bench_channel.py)")  # noqa
    p.add_argument("--smoke", action="store_true", help="host backend, numpy, 200 messages unless --count says")
    p.add_argument("--busy", type=float,
                   help="seconds the consumer's process launches kernels while the pieces are timed beside it "
                        "(default 3; smoke 0.3)")
    p.add_argument("--out", default=os.environ.get("OUT"))
    a = p.parse_args(argv)
    globals()["SLOTS"] = a.slots
    a.backend = "host"
    if a.count is None:
        a.count = 200 if a.smoke else 20000
    # Each piece beside the consumer's kernels: fewer times, so that every
    # one is timed within --busy seconds.
    a.busy_n = 200 if a.smoke else 2000
    if a.busy is None:
        a.busy = 0.3 if a.smoke else 3.0
    if not a.smoke:
        try:
            import torch

            a.backend = "cuda" if torch.cuda.is_available() else "host"
        except ImportError:
            pass
    res = run(a)
    rc = report(res, a)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "profile_channel.json"), "w") as f:
            json.dump(res, f, indent=2)
    return rc


if __name__ == "__main__":
    sys.exit(main())
