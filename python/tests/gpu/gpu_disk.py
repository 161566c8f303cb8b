#!/usr/bin/env python3
"""The disk tier and durable segments on a cuda daemon (docs/disk.md), with
segments of GPU memory, every byte checked on the GPU:

    GPUSHM_BIN=.gpu/gpushm PYTHONPATH=python python3 python/tests/gpu/gpu_disk.py --dir /var/tmp/gpushm-gpu-disk

1. A durable segment of --size bytes (16 GiB), filled on the GPU with
   int64 words of a seed, synced (timed: GPU -> disk, durable).
2. A reboot as far as memory goes: every process of the daemon SIGKILLed,
   a new daemon on the same directories; the segment is listed with its
   mode, meta and version, and its first open restores it from disk into
   GPU memory (timed), every byte checked.
3. evict --to disk and load (timed both ways), every byte checked.
4. Kills during the write of a next version of --kill-size bytes (4 GiB):
   the serving process, the supervisor, both; after each the name serves
   the version its meta names, every byte checked.
5. GPU memory in use at the end against the start.

PASS/FAIL lines; exit 1 if any failed. The same file is its workers'
program ('worker fill|check NAME SEED').
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[3]
sys.path.insert(0, str(REPO / "python"))

import gpushm  # noqa: E402
from gpushm import testing  # noqa: E402

failed = []
GIB = 1 << 30


def check(ok, name, detail):
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        failed.append(name)
    return ok


def worker(argv):
    """fill or check NAME SEED: int64 words seed*2**40 + index, on the GPU,
    through a read-write (fill) or read-only (check) open; prints seconds."""
    import torch

    what, name, seed = argv[0], argv[1], int(argv[2])
    c = gpushm.connect()
    t0 = time.perf_counter()
    if what == "next":
        seg = c.create(name, int(argv[3]), next_version=True)
        what = "fill"
    else:
        seg = c.open(name, readonly=(what == "check"))
    opened = time.perf_counter() - t0
    with torch.inference_mode(what == "check"):
        t = torch.from_dlpack(seg.view("int64", (seg.size // 8,)).__dlpack__())
    step, base, ok = 1 << 28, seed << 40, True
    for i in range(0, t.numel(), step):
        want = torch.arange(base + i, base + min(i + step, t.numel()), dtype=torch.int64, device=t.device)
        if what == "fill":
            t[i:i + step].copy_(want)
        elif not torch.equal(t[i:i + step], want):
            ok = False
            break
    torch.cuda.synchronize()
    del t
    if argv[0] == "next":
        seg.commit()
    seg.close()
    print(json.dumps({"ok": ok, "open_seconds": opened}), flush=True)


def run_worker(sock, *args):
    env = dict(os.environ, GPUSHM_SOCKET=sock, PYTHONPATH=str(REPO / "python"))
    p = subprocess.run([sys.executable, str(HERE), "worker", *map(str, args)], env=env, capture_output=True,
                       text=True, timeout=1800)
    if p.returncode != 0:
        return {"ok": False, "error": p.stderr[-1000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def start(gbin, dirs, log):
    return testing.Daemon("cuda", "--disk", ",".join(dirs), "--grace", "1s", binary=gbin, log=log,
                          new_session=True, timeout=120)


def used_mib():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True).stdout.split()
        return int(out[0])
    except Exception:
        return None


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        return worker(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpushm", default=os.environ.get("GPUSHM_BIN", str(REPO / ".gpu" / "gpushm")))
    ap.add_argument("--dir", default=None, help="where the disk tier goes (default: a new directory under /var/tmp)")
    ap.add_argument("--size", type=int, default=16 * GIB)
    ap.add_argument("--kill-size", type=int, default=4 * GIB)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    work = Path(a.dir or tempfile.mkdtemp(prefix="gpushm-gpu-disk-", dir="/var/tmp"))
    dirs = [str(work / "tier0"), str(work / "tier1")]
    log = str(Path(a.out) / "gpu-disk-daemon.log")
    used0 = used_mib()
    d = start(a.gpushm, dirs, log)
    try:
        c = gpushm.connect(d.socket, timeout=1800)
        c.create("big", a.size, persist=True, mode=0o640).close()
        r = run_worker(d.socket, "fill", "big", 7)
        check(r["ok"], "fill", f"{a.size} bytes filled on the GPU" + r.get("error", ""))
        t = time.perf_counter()
        inf = c.sync("big")
        w = time.perf_counter() - t
        check(inf.synced > 0, "sync", f"{a.size} bytes GPU -> disk, durable, in {w:.2f} s ({a.size / w / 1e9:.2f} GB/s)")
        c.close()

        d.crash()
        d = start(a.gpushm, dirs, log + ".2")
        c = gpushm.connect(d.socket, timeout=1800)
        st = c.stat("big")
        check(st.tier == "disk" and st.mode == 0o640 and st.persist and st.version == 1, "reboot-listed",
              f"tier {st.tier}, mode {st.mode:o}, persist {st.persist}, version {st.version}")
        r = run_worker(d.socket, "check", "big", 7)
        check(r["ok"], "reboot-restore", f"first open after the reboot (disk -> GPU) {r.get('open_seconds', 0):.2f} s "
              f"({a.size / max(r.get('open_seconds', 1), 1e-9) / 1e9:.2f} GB/s), every byte checked" + r.get("error", ""))

        c.unlink("big")
        c.create("cold", a.size).close()
        run_worker(d.socket, "fill", "cold", 9)
        t = time.perf_counter()
        c.evict("cold", to="disk")
        w = time.perf_counter() - t
        t = time.perf_counter()
        c.load("cold")
        r_s = time.perf_counter() - t
        r = run_worker(d.socket, "check", "cold", 9)
        check(r["ok"], "evict-to-disk", f"evict --to disk {w:.2f} s ({a.size / w / 1e9:.2f} GB/s), load {r_s:.2f} s "
              f"({a.size / r_s / 1e9:.2f} GB/s), every byte checked" + r.get("error", ""))
        c.unlink("cold")

        # Version v of "k" holds seed 100 + v - 1.
        c.create("k", a.kill_size, persist=True).close()
        run_worker(d.socket, "fill", "k", 100)
        c.sync("k")
        c.close()
        for k, how in enumerate(["serving process", "supervisor", "both (a reboot)"], start=1):
            r = run_worker(d.socket, "next", "k", 100 + k, a.kill_size)
            check(r["ok"], f"next-{k}", f"version {k + 1} filled and committed" + r.get("error", ""))
            time.sleep(0.3)  # inside its write to disk: 4 GiB take seconds
            info = gpushm.connect(d.socket).info()
            if how == "serving process":
                os.kill(info["pid"], signal.SIGKILL)
            elif how == "supervisor":
                os.kill(info["supervisor_pid"], signal.SIGKILL)
            else:
                d.crash()
                d = start(a.gpushm, dirs, log + f".{k + 2}")
            deadline = time.monotonic() + 60
            while True:
                try:
                    c = gpushm.connect(d.socket, timeout=1800)
                    st = c.stat("k")
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            ok_version = st.version == k + 1 or (how.startswith("both") and st.version == k)
            r = run_worker(d.socket, "check", "k", 100 + st.version - 1)
            check(ok_version and r["ok"], f"kill-{k}", f"{how} killed during the write of version {k + 1}: "
                  f"k serves version {st.version}, every byte of it checked" + r.get("error", ""))
            for _ in range(1200):
                st = c.stat("k")
                if st.synced and not st.stale:
                    break
                time.sleep(0.1)
            c.close()
        c = gpushm.connect(d.socket)
        c.unlink("k")
        c.close()
    finally:
        d.crash()
        shutil.rmtree(work, ignore_errors=True)
    # A killed process's GPU memory is freed after it is gone from /proc's
    # listing of commands: wait for it.
    used = used_mib()
    for _ in range(150):
        if used is None or used0 is None or used <= used0 + 64:
            break
        time.sleep(0.1)
        used = used_mib()
    if used is not None and used0 is not None:
        check(used <= used0 + 64, "gpu-memory", f"{used} MiB in use at the end, {used0} at the start")
    print("all passed" if not failed else f"FAILED: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
