"""Channels through restarts of the daemon (scripts/gpu-channel runs it on
a GPU machine; with --backend host it runs anywhere, with numpy):

    python3 python/tests/gpu/gpu_channel_restart.py --bin .gpu/gpushm [--backend cuda] [--out DIR]

Two checks, each with a daemon of its own (a supervisor and its serving
process, as users run it):

channels: five channels of different sizes (A: 4 slots of 4 MiB, B: 2 of
64 MiB, C: 4 of 4 MiB, D: 3 of 4,000,004 bytes, E: 8 of 1 KiB), each left
holding slots-1 messages with both ends closed, through a kill -9 of the
serving process, an upgrade (SIGHUP to the supervisor) and another kill:
each is listed as before with its own layout, no orphan, and gives back
its own messages, then EOF. Message k of channel c holds c << 24 | k in
every int32 element. Then a producer process and a consumer process
stream on all five at once through 3 kills and 2 upgrades: after each,
every stream goes on, each end has reconnected (after a kill), and each
role is still held by its process (the other end's process asking for it
is told EBUSY, naming the holder).

stream: one channel of 4 slots of 4 MiB float32; a producer that queues
slow GPU work before each fill (torch.cuda._sleep, then t.fill_(k)) and a
consumer that compares every element with its message's number on its own
stream, through 10 kills of the serving process and 3 upgrades; the
producer's close() then ends the stream with EOF, and every message came
once, in order, intact.

Both daemons must stop (SIGTERM) with exit status 0 and no error in their
logs but the deaths the check caused. Prints PASS/FAIL lines; exits 1 if a
check failed.
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))

CHANNELS = [("A", 4, 4 << 20), ("B", 2, 64 << 20), ("C", 4, 4 << 20), ("D", 3, 4_000_004), ("E", 8, 1 << 10)]
STREAM = [("stream", 4, 4 << 20)]


def value(k, seq, kind):
    """What every element of message seq of the k-th channel holds."""
    return float(seq) if kind == "float32" else (k << 24) | seq


# ---- the ends (processes of their own) -------------------------------------

class Framework:
    """torch on a GPU, numpy on host memory."""

    def __init__(self, backend, device):
        self.gpu = backend == "cuda"
        if self.gpu:
            import torch

            self.torch = torch
            self.dev = torch.device("cuda", device)
            torch.cuda.set_device(self.dev)
        self.device = device

    def thread_stream(self):
        """A stream of this thread's own (None on host memory)."""
        if not self.gpu:
            return None
        self.torch.cuda.set_device(self.dev)
        return self.torch.cuda.Stream(self.dev)

    def fill(self, t, v, slow_cycles):
        if self.gpu:
            if slow_cycles:
                self.torch.cuda._sleep(slow_cycles)
            t.fill_(v)
        else:
            t.fill(v)

    def counter(self):
        return self.torch.zeros((), dtype=self.torch.int64, device=self.dev) if self.gpu else [0]

    def count_wrong(self, acc, t, v):
        """Adds the elements of t that are not v to acc, on the stream
        (no synchronization)."""
        if self.gpu:
            acc += (t != v).sum()
        else:
            acc[0] += int((t != v).sum())

    def value_of(self, acc):
        if self.gpu:
            self.torch.cuda.synchronize(self.dev)
            return int(acc.item())
        return acc[0]


def parse_chans(s):
    out = []
    for f in s.split(","):
        name, slots, nbytes = f.split(":")
        out.append((name, int(slots), int(nbytes)))
    return out


def open_end(gpushm, fw, a, role, name, slots, nbytes):
    c = gpushm.connect(a.socket)
    if role == "tx":
        ch = c.channel(name, shape=(nbytes // 4,), dtype=a.kind, slots=slots, device=fw.device if fw.gpu else None)
    else:
        ch = c.channel(name)
    return c, ch


class EndState:
    def __init__(self, name):
        self.name = name
        self.lock = threading.Lock()
        self.first = None
        self.next = 0
        self.reconnects = 0
        self.error = None
        self.end = None  # "eof" or "closed" once the stream ended here
        self.wrong = 0


def run_end(gpushm, fw, a, k, name, slots, nbytes, st, opened, stop):
    """One end of one channel, on a thread of its own with a connection and
    a stream of its own."""
    try:
        s = fw.thread_stream()
        c, ch = open_end(gpushm, fw, a, a.role, name, slots, nbytes)
        opened.put(None)
    except Exception as e:  # reported by the ready line
        opened.put(f"{name}: {type(e).__name__}: {e}")
        return
    ctx = fw.torch.cuda.stream(s) if fw.gpu else None
    try:
        if ctx:
            ctx.__enter__()
        acc = fw.counter()  # made on the stream that adds to it
        n = 0
        while True:
            n += 1
            if n % 10 == 0:
                c.stat(name)  # a daemon call: reconnects after a restart, reclaiming the role
                with st.lock:
                    st.reconnects = c.reconnects
            if a.role == "tx":
                if stop.is_set():
                    ch.close()
                    st.end = "closed"
                    break
                m = ch.send(timeout=120)
                with m as t:
                    fw.fill(t, value(k, m.seq, a.kind), a.slow_cycles)
                seq = m.seq
                with st.lock:
                    if st.first is None:
                        st.first = seq
                    st.next = seq + 1
                time.sleep(0.001)
                continue
            try:
                m = ch.recv(timeout=120)
            except EOFError:
                st.end = "eof"
                ch.close()
                break
            with st.lock:
                want = st.next
                if st.first is not None and m.seq != want:
                    raise AssertionError(f"message {m.seq} came after {want - 1}")
            with m as t:
                fw.count_wrong(acc, t, value(k, m.seq, a.kind))
            with st.lock:
                if st.first is None:
                    st.first = m.seq
                st.next = m.seq + 1
        st.wrong = fw.value_of(acc)
    except Exception as e:
        with st.lock:
            st.error = f"{type(e).__name__}: {e}"
    finally:
        if ctx:
            ctx.__exit__(None, None, None)
        c.close()


def end_main(a):
    """tx or rx of every channel in --chans; commands on stdin, one JSON
    line each: count, steal (ask for the other end's role of each
    channel, from a connection of this process: it must be refused),
    stop (tx: close every end), wait (rx: wait for every end of stream)."""
    import queue

    import gpushm

    fw = Framework(a.backend, a.device)
    chans = parse_chans(a.chans)
    opened, stop = queue.Queue(), threading.Event()
    states, threads = [], []
    for k, (name, slots, nbytes) in enumerate(chans):
        st = EndState(name)
        states.append(st)
        th = threading.Thread(target=run_end, args=(gpushm, fw, a, k, name, slots, nbytes, st, opened, stop),
                              daemon=True)
        th.start()
        threads.append(th)
    errors = [e for e in (opened.get() for _ in chans) if e]
    print(json.dumps({"ready": not errors, "error": "; ".join(errors) or None}), flush=True)
    if errors:
        return 1

    def report():
        out = {}
        for st in states:
            with st.lock:
                out[st.name] = {"first": st.first, "next": st.next, "reconnects": st.reconnects, "error": st.error,
                                "end": st.end, "wrong": st.wrong}
        return out

    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "count":
            print(json.dumps(report()), flush=True)
        elif cmd == "steal":
            other = "rx" if a.role == "tx" else "tx"
            out = {}
            c = gpushm.connect(a.socket)
            for name, _, _ in chans:
                try:
                    c.channel(name, role=other).close()
                    out[name] = "granted"
                except gpushm.Error as e:
                    out[name] = f"{e.code} {e}"
            c.close()
            print(json.dumps(out), flush=True)
        elif cmd in ("stop", "wait"):
            if cmd == "stop":
                stop.set()
            for th in threads:
                th.join()
            print(json.dumps(report()), flush=True)
            return 0
    return 0


def leave_main(a):
    """Makes each channel, sends it slots messages, receives one: slots-1
    are left in it; closes both ends."""
    import gpushm

    fw = Framework(a.backend, a.device)
    c, c2 = gpushm.connect(a.socket), gpushm.connect(a.socket)  # a client holds one end of a channel
    for k, (name, slots, nbytes) in enumerate(parse_chans(a.chans)):
        tx = c.channel(name, shape=(nbytes // 4,), dtype=a.kind, slots=slots, device=fw.device if fw.gpu else None)
        rx = c2.channel(name, role="rx")
        for seq in range(slots):
            with tx.send(timeout=60) as t:
                fw.fill(t, value(k, seq, a.kind), 0)
        with rx.recv(timeout=60):
            pass
        rx.close()
        tx.close()
    c.close()
    c2.close()
    print(json.dumps({"ok": True}), flush=True)
    return 0


def take_main(a):
    """Receives what leave_main left in each channel and checks it, then
    the end of the stream."""
    import gpushm

    fw = Framework(a.backend, a.device)
    c = gpushm.connect(a.socket)
    out = {}
    for k, (name, slots, _) in enumerate(parse_chans(a.chans)):
        rx = c.channel(name)
        acc, seqs = fw.counter(), []
        for _ in range(1, slots):
            m = rx.recv(timeout=60)
            seqs.append(m.seq)
            with m as t:
                fw.count_wrong(acc, t, value(k, m.seq, a.kind))
        try:
            rx.recv(timeout=60)
            end = "a message after the last one"
        except EOFError:
            end = "eof"
        rx.close()
        out[name] = {"seqs": seqs, "wrong": fw.value_of(acc), "end": end, "ok": seqs == list(range(1, slots))
                     and end == "eof"}
        out[name]["ok"] = out[name]["ok"] and out[name]["wrong"] == 0
    c.close()
    print(json.dumps(out), flush=True)
    return 0


# ---- the driver -------------------------------------------------------------

class Check:
    def __init__(self, label):
        self.label, self.failed = label, False

    def ok(self, cond, what):
        print(f"{'PASS' if cond else 'FAIL'}  {self.label}: {what}", flush=True)
        if not cond:
            self.failed = True
        return cond

    def info(self, what):
        print(f"INFO  {self.label}: {what}", flush=True)


class Daemon:
    """A supervised daemon on a socket of its own."""

    def __init__(self, a, label):
        self.a = a
        self.dir = tempfile.mkdtemp(prefix="gpushm-restart-")
        self.sock = os.path.join(self.dir, "g.sock")
        self.log_path = os.path.join(a.out, f"channel-restart-{label}-daemon.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([a.bin, "daemon", "--socket", self.sock, "--backend", a.backend,
                                      "--grace", "60s"], stdout=self.log, stderr=self.log)
        self.wait_serving(None)

    def info(self):
        import gpushm

        c = gpushm.connect(self.sock, timeout=5)
        try:
            return c.info()
        finally:
            c.close()

    def wait_serving(self, not_pid, limit=120):
        deadline = time.monotonic() + limit
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"the daemon exited ({self.proc.returncode}); see {self.log_path}")
            try:
                pid = self.info()["pid"]
                if pid != not_pid:
                    return pid
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"no serving process other than {not_pid} within {limit}s; see {self.log_path}")
            time.sleep(0.02)

    def restart(self, upgrade):
        pid = self.info()["pid"]
        if upgrade:
            self.proc.send_signal(signal.SIGHUP)
        else:
            os.kill(pid, signal.SIGKILL)
        self.wait_serving(pid)

    def segments(self):
        out = subprocess.run([self.a.bin, "--socket", self.sock, "ls", "--json"], capture_output=True, text=True,
                             timeout=60)
        return json.loads(out.stdout or "[]")

    def stop(self, check):
        self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = "killed after 60s"
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        errors = [ln.strip() for ln in open(self.log_path) if "level=ERROR" in ln
                  and 'msg="serving process died; restarting it"' not in ln]
        check.ok(rc == 0 and not errors, f"the daemon stops cleanly (exit {rc}; errors logged: {errors[:3] or 'none'})")


class End:
    """An end_main process."""

    def __init__(self, a, sock, role, chans, kind, slow_cycles=0):
        self.role = role
        args = [sys.executable, "-u", os.path.abspath(__file__), role, "--socket", sock, "--backend", a.backend,
                "--device", str(a.device), "--chans", ",".join(f"{n}:{s}:{b}" for n, s, b in chans), "--kind", kind,
                "--slow-cycles", str(slow_cycles)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.pid = self.proc.pid

    def read(self):
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.role}: exited ({self.proc.wait()}) without an answer; its error is above")
        return json.loads(line)

    def ask(self, cmd):
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.read()

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()


def one_shot(a, sock, role, chans, kind):
    args = [sys.executable, "-u", os.path.abspath(__file__), role, "--socket", sock, "--backend", a.backend,
            "--device", str(a.device), "--chans", ",".join(f"{n}:{s}:{b}" for n, s, b in chans), "--kind", kind]
    out = subprocess.run(args, stdout=subprocess.PIPE, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"{role}: exit {out.returncode}; its error is above")
    return json.loads(out.stdout.strip().splitlines()[-1])


def listed_as(check, d, chans, when):
    segs = {s["name"]: s for s in d.segments()}
    want = {name: (slots, nbytes) for name, slots, nbytes in chans}
    got = {n: ((s.get("channel") or {}).get("slots"), (s.get("channel") or {}).get("slot_bytes"))
           for n, s in segs.items()}
    orphans = [n for n, s in segs.items() if s.get("orphan")]
    return check.ok(got == want and not orphans, f"{when}: listed {got}, orphans {orphans}")


def progress(check, ends, chans, before, reconnected, limit=120):
    """Waits until every channel's ends went past where they were, and
    (after a kill) made their connections again."""
    deadline = time.monotonic() + limit
    while True:
        now = [e.ask("count") for e in ends]
        errors = {f"{e.role} {n}": c["error"] for e, r in zip(ends, now) for n, c in r.items() if c["error"]}
        if errors:
            check.ok(False, f"an end failed: {errors}")
            return None
        moved = all(r[n]["next"] > b[n]["next"] and (not reconnected or r[n]["reconnects"] > b[n]["reconnects"])
                    for r, b in zip(now, before) for n, _, _ in chans)
        if moved:
            return now
        if time.monotonic() > deadline:
            check.ok(False, f"not every stream went on within {limit}s: {now}")
            return None
        time.sleep(0.05)


def roles_held(check, tx, rx, chans, when):
    ok = True
    for e, other in ((tx, rx), (rx, tx)):
        got = e.ask("steal")
        for name, _, _ in chans:
            r = got.get(name, "")
            ok = ok and r.startswith("EBUSY") and f"(pid {other.pid})" in r
    return check.ok(ok, f"{when}: each role held by its process (the other end's process is refused it)")


def stream(check, d, chans, kind, restarts, slow_cycles):
    """A producer and a consumer process on every channel of chans through
    restarts (True: an upgrade); then the producer closes."""
    zero = {n: {"next": 0, "reconnects": 0} for n, _, _ in chans}
    tx = End(d.a, d.sock, "tx", chans, kind, slow_cycles)
    try:
        if not tx.read()["ready"]:
            return check.ok(False, "the producer did not start")
        rx = End(d.a, d.sock, "rx", chans, kind)
        try:
            if not rx.read()["ready"]:
                return check.ok(False, "the consumer did not start")
            at = progress(check, [tx, rx], chans, [zero, zero], False)
            if at is None:
                return False
            firsts = {n: at[1][n]["first"] for n, _, _ in chans}
            kills = upgrades = 0
            for i, upgrade in enumerate(restarts):
                d.restart(upgrade)
                kills, upgrades = kills + (not upgrade), upgrades + upgrade
                at = progress(check, [tx, rx], chans, at, not upgrade)
                if at is None:
                    return False
                if i % 3 == 2 and not roles_held(check, tx, rx, chans, f"after restart {i + 1}"):
                    return False
            check.ok(True, f"every stream went on through {kills} kills of the serving process and {upgrades} upgrades,"
                           " each end reconnecting after each kill")
            roles_held(check, tx, rx, chans, "at the end")
            sent, got = tx.ask("stop"), rx.ask("wait")
            rc = (tx.proc.wait(60), rx.proc.wait(60))
        finally:
            rx.kill()
    finally:
        tx.kill()
    for name, _, _ in chans:
        s, g = sent[name], got[name]
        check.ok(s["error"] is None and g["error"] is None and s["first"] == g["first"] == firsts[name]
                 and s["next"] == g["next"] and g["end"] == "eof" and g["wrong"] == 0,
                 f"{name}: sent {s['first']}..{s['next'] - 1}, received {g['first']}..{g['next'] - 1}, "
                 f"{g['wrong']} wrong elements, end {g['end']!r} (errors: {s['error']}, {g['error']})")
    return check.ok(rc == (0, 0), f"both ends exited 0 ({rc})")


def check_channels(a):
    check = Check("several channels")
    d = Daemon(a, "channels")
    try:
        one_shot(a, d.sock, "leave", CHANNELS, "int32")
        listed_as(check, d, CHANNELS, "made, messages left in each")
        for when, upgrade in (("after kill -9", False), ("after an upgrade", True), ("after another kill -9", False)):
            d.restart(upgrade)
            listed_as(check, d, CHANNELS, when)
        took = one_shot(a, d.sock, "take", CHANNELS, "int32")
        for name, _, _ in CHANNELS:
            r = took[name]
            check.ok(r["ok"], f"{name}: the messages left before the restarts: seqs {r['seqs']}, "
                              f"{r['wrong']} wrong elements, then {r['end']}")
        stream(check, d, CHANNELS, "int32", [False, True, False, False, True], 0)
        listed_as(check, d, CHANNELS, "after the streams ended")
    finally:
        d.stop(check)
    return not check.failed


def check_stream(a):
    check = Check("one stream, 10 kills, 3 upgrades")
    d = Daemon(a, "stream")
    try:
        restarts = [i % 4 == 3 for i in range(13)]  # 3 upgrades among 10 kills
        stream(check, d, STREAM, "float32", restarts, a.slow_cycles)
    finally:
        d.stop(check)
    return not check.failed


def main(argv):
    p = argparse.ArgumentParser(prog="gpu_channel_restart.py", description=__doc__.split("\n\n")[0])
    p.add_argument("role", nargs="?", default="run", choices=["run", "tx", "rx", "leave", "take"])
    p.add_argument("--bin", default=os.environ.get("GPUSHM_BIN"))
    p.add_argument("--backend", default="cuda", choices=["cuda", "host"])
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    p.add_argument("--only", choices=["channels", "stream"], help="run one of the two checks")
    p.add_argument("--slow-cycles", type=int, default=20_000_000,
                   help="GPU cycles of torch.cuda._sleep before each fill of the stream (about 10 ms on an H200)")
    # The ends'.
    p.add_argument("--socket")
    p.add_argument("--chans")
    p.add_argument("--kind", default="int32")
    a = p.parse_args(argv)
    if a.role != "run":
        return {"tx": end_main, "rx": end_main, "leave": leave_main, "take": take_main}[a.role](a)
    if not a.bin:
        raise SystemExit("gpu_channel_restart.py: --bin (or GPUSHM_BIN) names the gpushm binary")
    os.makedirs(a.out, exist_ok=True)
    ok = True
    for name, fn in (("channels", check_channels), ("stream", check_stream)):
        if a.only in (None, name):
            try:
                ok = fn(a) and ok
            except SystemExit as e:  # a step that could not go on; the rest of this check is skipped
                print(f"FAIL  {name}: {e}", flush=True)
                ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
