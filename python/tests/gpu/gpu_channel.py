"""Channel correctness on a GPU machine (scripts/gpu-channel runs it): a
producer process writes every message with a kernel and hands it over
without ever synchronizing; a consumer process checks every element with a
kernel on its own stream. Nothing but the channel's stream waits orders the
two, so a hand-off that let the consumer read before the producer's writes
landed, or let the producer overwrite a slot still being read, shows up as
mismatches.

    python3 python/tests/gpu/gpu_channel.py run --socket S --size 1MiB --count 100000
    python3 python/tests/gpu/gpu_channel.py run --socket S --size 1MiB --count 20000 --consumer-device 1

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

`crash` kills a producer, again and again (docs/protocol.md, "Channels", a
break): a torch producer queues about 10 ms of GPU work before each
message's fill (torch.cuda._sleep, then t.fill_(k)), so that its CPU hands
messages over long before its GPU writes them, and is SIGKILLed at a random
moment; this process is the consumer. Half the runs check each message as
the issue's reproduction did (float(t[0]), then every element, inside the
with block: a CPU synchronization per message); the other half queue the
check on the GPU and synchronize once at the end, so that recv returns,
and messages are released, long before the producer's GPU writes them.
Each run must give: every message accepted holds its own number in every
element (for the second kind: every message before the one reported); the
message reported broken (BrokenMessageError.seq) is the first one whose
writes the GPU did not finish, as the slots' contents show afterwards
(each slot holds its last whole message, or a message half written over
it; the producer first fills every slot with -1); the next recv ends the
stream (EOFError); the consumer's GPU never hangs.

    python3 python/tests/gpu/gpu_channel.py crash --socket S --runs 20 --size 4MiB
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))


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
        rx._cover = lambda *args: None  # no stream waits: reads race the producer's writes
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


def crash_producer(a):
    """Sends until killed: message k is k in every element, written after
    a.spin_cycles of GPU sleep."""
    import torch

    import gpushm

    dev = torch.device("cuda", a.device)
    torch.cuda.set_device(dev)
    c = gpushm.connect(a.socket)
    tx = c.channel(a.name, shape=(a.nbytes // 4,), dtype="float32", slots=a.slots, device=a.device)
    for t in tx._tensors:  # no message yet: the slots are the producer's
        t.fill_(-1.0)
    torch.cuda.synchronize()
    print("open", flush=True)
    k = 0
    while True:
        with tx.send() as t:
            torch.cuda._sleep(a.spin_cycles)
            t.fill_(float(k))
        k += 1


def _first_unwritten(torch, rx, head):
    """The first message whose writes were not done, from the slots'
    contents: a slot holds its last whole message m (next: m + slots), or
    a message half written over one (next: that message), or -1 (next: the
    slot's first message)."""
    first = head
    for i, t in enumerate(rx._tensors):
        vals = torch.unique(t).tolist()
        top = int(max(vals))
        if len(vals) > 1:
            nxt = top
        elif top < 0:
            nxt = i
        else:
            nxt = top + rx.slots
        first = min(first, nxt)
    return first


def crash(a):
    """a.runs producers, each SIGKILLed at a random moment; this process
    consumes and judges. Prints PASS/FAIL/INFO lines; exits 1 on a
    failure."""
    import random
    import signal
    import threading

    import torch

    import gpushm

    dev = torch.device("cuda", a.device)
    torch.cuda.set_device(dev)
    n = a.nbytes // 4
    c = gpushm.connect(a.socket)
    me = os.path.abspath(__file__)
    rnd = random.Random(a.seed if a.seed is not None else os.getpid())
    failures, between, outcomes, report = 0, 0, {"broken": 0, "eof": 0}, []
    for run in range(a.runs):
        kind = "sync" if run % 2 == 0 else "async"
        name = f"{a.name}-{run}"
        rx = c.channel(name, shape=(n,), dtype="float32", slots=a.slots, role="rx", device=a.device)
        prod = subprocess.Popen([sys.executable, "-u", me, "crash-producer", "--socket", a.socket, "--name", name,
                                 "--size", str(a.nbytes), "--slots", str(a.slots), "--device", str(a.device),
                                 "--spin-cycles", str(a.spin_cycles)], stdout=subprocess.PIPE, text=True)
        if prod.stdout.readline().strip() != "open":
            raise SystemExit("gpu_channel: the crash producer did not start (its error is above)")
        first_msg = threading.Event()
        delay = 0.05 + rnd.random() * 1.5

        def killer():
            first_msg.wait(120)
            time.sleep(delay)  # a random moment, not a condition: anything may happen then
            prod.send_signal(signal.SIGKILL)

        kt = threading.Thread(target=killer)
        kt.start()
        accepted, checks, end, seq = [], [], None, None
        t0 = time.monotonic()
        try:
            while True:
                m = rx.recv(timeout=120)
                first_msg.set()
                with m as t:
                    if kind == "sync":
                        v = float(t[0])
                        whole = bool((t == v).all())
                    else:
                        checks.append((m.seq, (t == float(m.seq)).all()))
                if kind == "sync":
                    accepted.append((m.seq, v, whole))
        except gpushm.BrokenMessageError as e:
            end, seq = "broken", e.seq
        except EOFError:
            end = "eof"
        except Exception as e:
            end = f"{type(e).__name__}: {e}"
        first_msg.set()
        kt.join()
        prod.wait()
        torch.cuda.synchronize(dev)  # the consumer's stream waits were all met
        head = rx._head.value
        truth = _first_unwritten(torch, rx, head)
        again = None
        if end == "broken":
            try:
                rx.recv(timeout=30)
                again = "a message"
            except EOFError:
                again = "eof"
            except Exception as e:
                again = f"{type(e).__name__}: {e}"
        rx.close()
        c.unlink(name)

        problems = []
        told = seq if end == "broken" else head
        if end not in ("broken", "eof"):
            problems.append(f"the stream ended with {end}")
        elif end == "broken" and again != "eof":
            problems.append(f"after BrokenMessageError, recv gave {again}, want EOFError")
        if kind == "sync":
            wrong = [(k, v) for k, v, whole in accepted if v != k or not whole]
            if wrong:
                problems.append(f"{len(wrong)} messages accepted with contents not their own, first {wrong[:5]}")
            if [k for k, _, _ in accepted] != list(range(len(accepted))):
                problems.append("messages accepted out of order")
            if end in ("broken", "eof") and len(accepted) != told:
                problems.append(f"{len(accepted)} messages accepted, want the {told} before message {told}")
        else:
            got = {k: bool(ok.item()) for k, ok in checks}
            before = [k for k in range(told) if k not in got]
            wrong = [k for k in range(told) if got.get(k) is False]
            if before:
                problems.append(f"messages before {told} never received: {before[:5]}")
            if wrong:
                problems.append(f"messages before {told} held contents not their own: {wrong[:5]}")
        note = ""
        if told == truth - 1 and truth <= head:
            # The kill fell between the fill and its flag: the message is
            # whole but its flag unwritten, and the flag is part of it.
            between += 1
            note = " (killed between its fill and its flag)"
        elif told != truth:
            problems.append(f"told of message {told}, the first unwritten is {truth} (head {head})" +
                            ("; more was written than the repair saw: did the dead producer's GPU work go on "
                             "after its process was reaped?" if told < truth else ""))
        r = {"run": run, "kind": kind, "delay": round(delay, 3), "end": end, "seq": seq, "head": head,
             "first_unwritten": truth, "accepted": len(accepted) if kind == "sync" else len(checks),
             "seconds": round(time.monotonic() - t0, 2), "problems": problems}
        report.append(r)
        outcomes["broken" if end == "broken" else "eof"] += 1
        what = (f"run {run} ({kind}): head {head}, first unwritten {truth}, "
                f"{'BrokenMessageError at ' + str(seq) if end == 'broken' else end}{note}")
        if problems:
            failures += 1
            print(f"FAIL  {what}: {'; '.join(problems)}", flush=True)
        else:
            print(f"ok    {what}", flush=True)
    c.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    if between > 2:
        failures += 1
        print(f"FAIL  {between} of {a.runs} runs told of a message one before the first unwritten: "
              f"a kill between a fill and its flag is rare; this looks like a repair that cuts too early")
    if outcomes["broken"] == 0:
        failures += 1
        print("FAIL  no run ended with a message unwritten: the runs proved nothing")
    verdict = "PASS" if failures == 0 else "FAIL"
    print(f"{verdict}  producer crashes: {a.runs} SIGKILLs, {outcomes['broken']} ended with BrokenMessageError, "
          f"{outcomes['eof']} with EOF, {failures} failed", flush=True)
    sys.exit(0 if failures == 0 else 1)


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
    p.add_argument("role", choices=["run", "producer", "consumer", "crash", "crash-producer"])
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
    p.add_argument("--runs", type=int, default=20, help="crash: how many producers to kill")
    p.add_argument("--seed", type=int, default=None, help="crash: the random moments' seed")
    p.add_argument("--json", default=None, help="crash: where to write each run's report")
    a = p.parse_args(argv)
    if a.role in ("crash", "crash-producer") and "--spin-cycles" not in argv:
        a.spin_cycles = 20_000_000  # about 10 ms of GPU time per message, as in the reproduction
    {"run": run, "producer": producer, "consumer": consumer, "crash": crash,
     "crash-producer": crash_producer}[a.role](a)


if __name__ == "__main__":
    main(sys.argv[1:])
