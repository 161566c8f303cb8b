"""Segments outlive the daemon: SIGKILL its serving process again and again,
and upgrade it, while a worker computes on the segments; measure the time
from SIGKILL to serving again, and check that nothing was lost, duplicated
or leaked.

It starts a daemon of its own (the supervisor and its serving process) on a
socket in a temporary directory, loads a segment of random bytes with
'gpushm put' and a safetensors bundle, and starts a worker process that maps
both and computes on them in a loop (torch on a GPU, numpy on host memory)
without ever talking to the daemon again. First, SUPERVISOR_KILLS times:
SIGKILL the supervisor, time until the serving process has started a new
one that holds everything (the serving process must be the same, the
worker undisturbed), and check every byte. Then, KILLS times: SIGKILL the
serving process, time until a new one answers, check every byte of both
segments ('gpushm get', sha256), that the worker kept computing, and (cuda)
that the GPU memory in use is what it was before. Then an upgrade (SIGHUP:
the binary on disk takes over), the same checks, and at the end 'gpushm rm'
and a clean stop, after which GPU memory in use is back where it started.

    python3 python/bench/bench_survive.py                 # cuda, 1 GiB, 20 kills
    python3 python/bench/bench_survive.py --smoke         # host memory, 1 MiB, 3 kills

Options: --bin (default $GPUSHM_BIN or .gpu/gpushm), --backend, --size,
--bundle-mb, --kills, --supervisor-kills, --grace. Prints a table and PASS/FAIL lines; exits 1
if any check failed. With $OUT set, also writes $OUT/survive.json.
"""

import argparse
import datetime
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, ".."))

import gpushm  # noqa: E402
from gpushm import testing  # noqa: E402

failures = []


def verdict(ok, what):
    print(f"{'PASS' if ok else 'FAIL'}  {what}", flush=True)
    if not ok:
        failures.append(what)


def gpu_used():
    """MiB in use on each GPU, from nvidia-smi."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return [int(x) for x in out.split()]


def write_random(path, size):
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 64 << 20)
            f.write(os.urandom(n))
            left -= n


def write_safetensors(path, mb):
    """A safetensors file of float32 tensors, written by hand (no torch
    needed), about mb MiB."""
    tensors, off, n = {}, 0, max(1, mb)
    sizes = [(f"layer{i}.weight", (256, 1024)) for i in range(n)]
    for name, shape in sizes:
        nbytes = shape[0] * shape[1] * 4
        tensors[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    header = json.dumps(tensors, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        left = off
        while left:
            k = min(left, 16 << 20)
            f.write(os.urandom(k))
            left -= k


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(16 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sha256_segment(gbin, sock, name):
    p = subprocess.run([gbin, "--socket", sock, "get", name, "-"], capture_output=True, check=False)
    if p.returncode != 0:
        return f"error: {p.stderr.decode().strip()}"
    return hashlib.sha256(p.stdout).hexdigest()


WORKER = r"""
import sys, time, gpushm
backend = sys.argv[1]
c = gpushm.connect()
if backend == "cuda":
    import torch
    big = torch.from_dlpack(c.open("big", readonly=True))
    model = {k: torch.from_dlpack(v) for k, v in c.tensors("model", readonly=True).items()}
    def step():
        # Integer sums: random bytes read as floats hold NaNs.
        s = big[::4096].to(torch.int64).sum() + sum(t.view(torch.int32).to(torch.int64).sum() for t in model.values())
        return int(s)
else:
    import numpy as np
    big = np.asarray(c.open("big", readonly=True).memoryview())
    model = {k: np.asarray(v) for k, v in c.tensors("model", readonly=True).items()}
    def step():
        return int(big[::4096].astype(np.int64).sum() + sum(int(t.view(np.int32).astype(np.int64).sum()) for t in model.values()))
first = step()
print("ready", repr(first), flush=True)
n = 0
while True:
    got = step()
    n += 1
    if got != first:
        print("mismatch", n, repr(got), flush=True)
        sys.exit(1)
    if n % 10 == 0:
        print("progress", n, flush=True)
"""


class Worker:
    def __init__(self, sock, backend):
        env = dict(os.environ, GPUSHM_SOCKET=sock, PYTHONPATH=os.path.join(HERE, ".."))
        self.p = subprocess.Popen([sys.executable, "-u", "-c", WORKER, backend], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.p.stdout.readline().split()
        if not line or line[0] != "ready":
            raise RuntimeError(f"worker did not start: {line} {self.p.stderr.read()}")
        self.progress, self.bad = 0, None
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self):
        for line in self.p.stdout:
            f = line.split()
            if f and f[0] == "progress":
                self.progress = int(f[1])
            elif f and f[0] == "mismatch":
                self.bad = line.strip()

    def stop(self):
        self.p.kill()
        self.p.wait()
        return self.bad


def info(sock):
    with gpushm.connect(sock, reconnect=0) as c:
        return c.info()


def wait_serving(sock, not_pid, limit=60.0):
    deadline = time.monotonic() + limit
    while True:
        try:
            inf = info(sock)
            if inf["pid"] != not_pid:
                return inf
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"no serving process other than {not_pid} within {limit}s")
        time.sleep(0.001)


def wait_supervisor(sock, not_pid, limit=60.0):
    """The daemon's info once a supervisor other than not_pid holds it."""
    deadline = time.monotonic() + limit
    while True:
        try:
            inf = info(sock)
            if inf["supervisor_pid"] != not_pid:
                return inf
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"no supervisor other than {not_pid} within {limit}s")
        time.sleep(0.001)


def alive(pid):
    """Whether pid runs (a zombie does not: its parent may be gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def zombie_status(pid):
    """The wait status of an exited process nobody reaped yet, else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[49]) if fields[0] == "Z" else None
    except (OSError, IndexError, ValueError):
        return None


def kill_daemon(pids):
    """Ends the daemon's processes at once: stopped first, so that neither
    starts the other again, then killed."""
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.environ.get("GPUSHM_BIN", ".gpu/gpushm"))
    ap.add_argument("--backend", default="cuda", choices=["cuda", "host"])
    ap.add_argument("--size", default=1 << 30, type=int, help="bytes of the plain segment (default 1 GiB)")
    ap.add_argument("--bundle-mb", default=256, type=int, help="MiB of the safetensors bundle")
    ap.add_argument("--kills", default=20, type=int)
    ap.add_argument("--supervisor-kills", default=20, type=int)
    ap.add_argument("--grace", default="5s")
    ap.add_argument("--smoke", action="store_true", help="host memory, 1 MiB, a 1 MiB bundle, 3 kills")
    a = ap.parse_args()
    if a.smoke:
        a.backend, a.size, a.bundle_mb, a.kills, a.supervisor_kills = "host", 1 << 20, 1, 3, 3
    gbin = os.path.abspath(a.bin)
    cuda = a.backend == "cuda"
    work = tempfile.mkdtemp(prefix="gpushm-survive-")
    fixture = daemon = sock = log = None
    results = {"date": datetime.date.today().isoformat(), "backend": a.backend, "size": a.size,
               "bundle_mb": a.bundle_mb, "kills": a.kills, "supervisor_kills": a.supervisor_kills}
    try:
        base = gpu_used() if cuda else None
        # The tests' daemon fixture; from here on this program drives its
        # processes itself (kills, an upgrade, the stop).
        fixture = testing.Daemon(a.backend, "--grace", a.grace, binary=gbin, log=os.path.join(work, "daemon.log"),
                                 timeout=60)
        daemon, sock, log = fixture.proc, fixture.socket, fixture.log
        wait_serving(sock, 0)
        big, model = os.path.join(work, "big.bin"), os.path.join(work, "model.safetensors")
        write_random(big, a.size)
        write_safetensors(model, a.bundle_mb)
        want = {"big": sha256_file(big), "model": sha256_file(model)}
        for name, path in (("big", big), ("model", model)):
            subprocess.run([gbin, "--socket", sock, "put", name, path], check=True, stdout=subprocess.DEVNULL)
            os.remove(path)
        worker = Worker(sock, a.backend)
        time.sleep(0.2)
        held = gpu_used() if cuda else None

        def check(label):
            ok = True
            for name, h in want.items():
                got = sha256_segment(gbin, sock, name)
                if got != h:
                    verdict(False, f"{label}: {name} has other bytes ({got[:16]})")
                    ok = False
            inf = info(sock)
            if inf["usage"]["named"] != 2 or inf["usage"]["segments"] != 2:
                verdict(False, f"{label}: usage {inf['usage']}, want 2 segments")
                ok = False
            if cuda:
                now = gpu_used()
                if abs(now[0] - held[0]) > 64:
                    verdict(False, f"{label}: GPU 0 uses {now[0]} MiB, {held[0]} MiB before the kills")
                    ok = False
            return ok

        sup_times, all_ok = [], True
        for i in range(a.supervisor_kills):
            inf = info(sock)
            before = worker.progress
            t0 = time.perf_counter()
            os.kill(inf["supervisor_pid"], signal.SIGKILL)
            now = wait_supervisor(sock, inf["supervisor_pid"])
            sup_times.append(time.perf_counter() - t0)
            if now["pid"] != inf["pid"]:
                verdict(False, f"supervisor kill {i + 1}: the serving process {inf['pid']} was replaced by {now['pid']}")
                all_ok = False
            all_ok &= check(f"supervisor kill {i + 1}")
            if cuda or a.size > (1 << 20):
                all_ok &= worker.progress > before
        if a.supervisor_kills:
            verdict(all_ok, f"{a.supervisor_kills} SIGKILLs of the supervisor: the serving process started a new one each time; every byte, no leak")

        times, all_ok = [], True
        for i in range(a.kills):
            pid = info(sock)["pid"]
            before = worker.progress
            t0 = time.perf_counter()
            os.kill(pid, signal.SIGKILL)
            wait_serving(sock, pid)
            times.append(time.perf_counter() - t0)
            all_ok &= check(f"kill {i + 1}")
            if cuda or a.size > (1 << 20):
                all_ok &= worker.progress > before
        verdict(all_ok, f"{a.kills} SIGKILLs of the serving process: every byte, no duplicate, no leak")
        sup = info(sock)["supervisor_pid"]
        pid = info(sock)["pid"]
        t0 = time.perf_counter()
        os.kill(sup, signal.SIGHUP)
        up = wait_serving(sock, pid)
        t_up = time.perf_counter() - t0
        verdict(up["restarts"] == a.kills and check("upgrade"), "upgrade (SIGHUP): the binary on disk took over, every byte")
        progress = worker.progress
        time.sleep(0.3)
        verdict(worker.progress > progress and worker.bad is None,
                f"the worker computed through it all ({worker.progress} passes, results unchanged)")
        bad = worker.stop()
        verdict(bad is None, f"the worker never saw other values ({bad})")
        for name in want:
            subprocess.run([gbin, "--socket", sock, "rm", name], check=True)
        inf = info(sock)
        if a.supervisor_kills == 0:
            daemon.send_signal(signal.SIGTERM)
            rc = daemon.wait(60)
            daemon = None
            verdict(rc == 0, f"clean stop (exit {rc})")
        else:
            # Not our child any more: SIGTERM, then both processes gone.
            daemon.wait()
            daemon = None
            os.kill(inf["supervisor_pid"], signal.SIGTERM)
            deadline = time.monotonic() + 60
            while (alive(inf["supervisor_pid"]) or alive(inf["pid"])) and time.monotonic() < deadline:
                time.sleep(0.01)
            gone = not alive(inf["supervisor_pid"]) and not alive(inf["pid"])
            if not gone:
                kill_daemon([inf["supervisor_pid"], inf["pid"]])
            # Its exit status can be read while it waits, a zombie, for a
            # parent that is gone (where the init reaps at once, it cannot).
            st = zombie_status(inf["supervisor_pid"])
            verdict(gone and st in (None, 0), f"clean stop of supervisor {inf['supervisor_pid']} (wait status {st}) and serving process {inf['pid']}")
        if cuda:
            end = gpu_used()
            verdict(abs(end[0] - base[0]) <= 16, f"GPU 0 memory back to where it started: {base[0]} -> {held[0]} (segments, worker, daemon) -> {end[0]} MiB")
            results.update(gpu_mib_before=base[0], gpu_mib_held=held[0], gpu_mib_after=end[0])
        ms = [t * 1e3 for t in times]
        sup_ms = [t * 1e3 for t in sup_times]
        results.update(restart_ms=ms, upgrade_ms=t_up * 1e3, supervisor_ms=sup_ms)
        print()
        print(f"{'backend':8} {'segments':>20} {'kills':>6} {'SIGKILL to serving again, ms':>30} {'upgrade, ms':>12}")
        print(f"{'':8} {'':>20} {'':>6} {'p50':>9} {'min':>9} {'max':>10} {'':>12}")
        segs = f"{a.size >> 20} MiB + {a.bundle_mb} MiB"
        print(f"{a.backend:8} {segs:>20} {a.kills:>6} {pct(ms, 50):9.1f} {min(ms):9.1f} {max(ms):10.1f} {t_up * 1e3:12.1f}")
        if sup_ms:
            print(f"\nSIGKILL of the supervisor to a new one holding everything, {len(sup_ms)} kills: "
                  f"p50 {pct(sup_ms, 50):.1f} ms, min {min(sup_ms):.1f}, max {max(sup_ms):.1f}")
        if cuda:
            verdict(pct(ms, 50) < 1000, f"p50 SIGKILL to serving again {pct(ms, 50):.0f} ms (target: under 1 s)")
    finally:
        if daemon is not None:
            try:
                inf = info(sock)
                kill_daemon([daemon.pid, inf["supervisor_pid"], inf["pid"]])
            except OSError:
                daemon.kill()
            daemon.wait()
        if log is not None:
            log.seek(0)
            if failures:
                print("daemon log:\n" + log.read()[-4000:], file=sys.stderr)
            log.close()
        if fixture is not None:
            shutil.rmtree(fixture.dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "survive.json"), "w") as f:
            json.dump(results, f, indent=1)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
