"""Channel correctness on a GPU machine (scripts/gpu-channel runs it): a
producer process writes every message with a kernel and hands it over
without ever synchronizing; a consumer process checks every element with a
kernel on its own stream. Nothing but the channel's stream waits orders the
two, so a hand-off that let the consumer read before the producer's writes
landed, or let the producer overwrite a slot still being read, shows up as
mismatches.

    python3 python/tests/gpu_channel.py run --socket S --size 1MiB --count 100000
    python3 python/tests/gpu_channel.py run --socket S --size 1MiB --count 20000 --consumer-device 1

Message k of n int32 elements holds pattern(k)[i] = 7 * i + c(k) (int32
arithmetic, wrapping), c(k) = (k * 1000003) % 2**31: every message differs
from the one before it in the same slot. The producer queues, on its current
stream, torch.add(base, c(k), out=t); every 16th message it first makes its
stream spin (torch.cuda._sleep) so that the CPU hands messages over well
before the GPU has written them. The consumer queues, on its current
stream, mismatches += (t != base + c(k)).sum(), on a GPU counter read once at
the end, and every 16th message a spin before the read, so that slots come
back late and the producer's stream must wait for them. The consumer also
checks each message's number (recv's seq) against its own count, and that
the stream ends (EOFError) right after the last message sent.

A control run (--control) does the same with the consumer's stream waits
switched off, for a few thousand messages: there the checker should see
mismatches, which shows it can. It is reported, not judged: whether a race
shows depends on the GPU's scheduling.

Prints one JSON line (run) with both ends' reports; `run` exits 1 if a
check failed.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))


def c_of(k):
    return (k * 1000003) % (1 << 31)


def count_synchronizations(torch):
    """Counts, from now on, every way this process could wait on the CPU
    for the GPU: torch's synchronize calls and the driver calls gpushm
    makes."""
    from gpushm import _cuda

    n = [0]

    def counting(f):
        def counted(*args, **kw):
            n[0] += 1
            return f(*args, **kw)
        return counted

    torch.cuda.synchronize = counting(torch.cuda.synchronize)
    for cls in (torch.cuda.Stream, torch.cuda.Event):
        cls.synchronize = counting(cls.synchronize)
    cu = _cuda.driver()
    for call in ("cuCtxSynchronize", "cuStreamSynchronize"):
        setattr(cu, call, counting(getattr(cu, call)))
    return n


def producer(a):
    import torch

    import gpushm

    dev = torch.device("cuda", a.device)
    torch.cuda.set_device(dev)
    n = a.nbytes // 4
    base = torch.arange(n, dtype=torch.int32, device=dev) * 7
    c = gpushm.connect(a.socket)
    tx = c.channel(a.name, shape=(n,), dtype="int32", slots=a.slots, device=a.device)
    syncs = count_synchronizations(torch)
    print("open", flush=True)
    deadline = time.monotonic() + a.seconds
    sent, t0 = 0, None
    for k in range(a.count):
        with tx.send() as t:
            if t0 is None:
                t0 = time.monotonic()
            if k % 16 == 0:
                torch.cuda._sleep(a.spin_cycles)
            torch.add(base, c_of(k), out=t)
        sent = k + 1
        if time.monotonic() > deadline:
            break
    t1 = time.monotonic()
    synchronized = syncs[0]
    tx.close()  # waits (on the CPU, polling the block) for the last message's writes
    c.close()
    print(json.dumps({"sent": sent, "seconds": t1 - (t0 or t1), "synchronizations": synchronized}), flush=True)


def consumer(a):
    import torch

    import gpushm

    dev = torch.device("cuda", a.consumer_device)
    torch.cuda.set_device(dev)
    n = a.nbytes // 4
    base = torch.arange(n, dtype=torch.int32, device=dev) * 7
    mismatches = torch.zeros((), dtype=torch.int64, device=dev)
    c = gpushm.connect(a.socket)
    devices = [a.consumer_device] if a.consumer_device != a.device else None
    rx = c.channel(a.name, devices=devices)
    if a.control:
        rx._wait_value = lambda *args: None  # no stream waits: reads race the producer's writes
    assert rx.device == a.consumer_device, (rx.device, a.consumer_device)
    print("open", flush=True)
    got, bad_seq, t0, end = 0, [], None, "eof"
    while True:
        try:
            m = rx.recv(timeout=120)
        except EOFError:
            break
        except Exception as e:
            end = f"{type(e).__name__}: {e}"
            break
        if t0 is None:
            t0 = time.monotonic()
        if m.seq != got and len(bad_seq) < 10:
            bad_seq.append((got, m.seq))
        with m as t:
            assert t.device == dev and t.dtype == torch.int32 and t.shape == (n,)
            if got % 16 == 8:
                torch.cuda._sleep(a.spin_cycles)
            mismatches += (t != torch.add(base, c_of(m.seq))).sum()
        got += 1
    t1 = time.monotonic()
    torch.cuda.synchronize(dev)  # once, at the end: the count is on the GPU
    rx.close()
    c.close()
    print(json.dumps({"received": got, "mismatches": int(mismatches.item()), "bad_seq": bad_seq, "end": end,
                      "seconds": t1 - (t0 or t1)}), flush=True)


def run(a):
    """Starts both ends as processes, and judges."""
    common = ["--socket", a.socket, "--name", a.name, "--size", str(a.nbytes), "--count", str(a.count),
              "--slots", str(a.slots), "--device", str(a.device), "--consumer-device", str(a.consumer_device),
              "--seconds", str(a.seconds), "--spin-cycles", str(a.spin_cycles)] + (["--control"] if a.control else [])
    me = os.path.abspath(__file__)

    def start(role):
        return subprocess.Popen([sys.executable, "-u", me, role, *common], stdout=subprocess.PIPE, text=True)

    prod = start("producer")
    try:
        if prod.stdout.readline().strip() != "open":
            raise SystemExit("gpu_channel: the producer did not start (its error is above)")
        cons = start("consumer")
        try:
            if cons.stdout.readline().strip() != "open":
                raise SystemExit("gpu_channel: the consumer did not start (its error is above)")
            p_out = json.loads(prod.stdout.readline() or "{}")
            c_out = json.loads(cons.stdout.readline() or "{}")
            rc_p, rc_c = prod.wait(120), cons.wait(120)
        finally:
            if cons.poll() is None:
                cons.kill()
    finally:
        if prod.poll() is None:
            prod.kill()
    try:
        import gpushm

        with gpushm.connect(a.socket) as c:
            c.unlink(a.name)
    except OSError:
        pass
    r = {"size": a.nbytes, "count": a.count, "device": a.device, "consumer_device": a.consumer_device,
         "control": a.control, "producer": p_out, "consumer": c_out, "exit": [rc_p, rc_c]}
    sent, got = p_out.get("sent", -1), c_out.get("received", -2)
    r["ok"] = (rc_p == 0 and rc_c == 0 and sent == got and c_out.get("end") == "eof" and not c_out.get("bad_seq")
               and p_out.get("synchronizations") == 0 and (a.control or c_out.get("mismatches") == 0))
    r["complete"] = sent == a.count
    print(json.dumps(r), flush=True)
    if not r["ok"] and not a.control:
        sys.exit(1)


def size(s):
    m = re.fullmatch(r"(\d+)\s*([KMG]iB)?", s.strip(), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"size {s!r}: want bytes, or KiB/MiB/GiB")
    n = int(m.group(1)) * {"": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}[(m.group(2) or "").upper()]
    if n <= 0 or n % 4:
        raise argparse.ArgumentTypeError(f"size {s!r}: want a positive multiple of 4 bytes")
    return n


def main(argv):
    p = argparse.ArgumentParser(prog="gpu_channel.py", description=__doc__.split("\n\n")[0])
    p.add_argument("role", choices=["run", "producer", "consumer"])
    p.add_argument("--socket", default=os.environ.get("GPUSHM_SOCKET"), required="GPUSHM_SOCKET" not in os.environ)
    p.add_argument("--name", default=f"gpu-channel-{os.getpid()}")
    p.add_argument("--size", dest="nbytes", type=size, default=1 << 20)
    p.add_argument("--count", type=int, default=100000)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--device", type=int, default=0, help="the producer's GPU, where the channel lives")
    p.add_argument("--consumer-device", type=int, default=0)
    p.add_argument("--seconds", type=float, default=150, help="the producer stops sending after this long")
    p.add_argument("--spin-cycles", type=int, default=200000, help="GPU cycles of each torch.cuda._sleep")
    p.add_argument("--control", action="store_true", help="the consumer's stream waits switched off")
    a = p.parse_args(argv)
    {"run": run, "producer": producer, "consumer": consumer}[a.role](a)


if __name__ == "__main__":
    main(sys.argv[1:])
