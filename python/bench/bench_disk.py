#!/usr/bin/env python3
"""The disk tier at the drive's rate (docs/disk.md): in one run, on one
drive, the drive's own O_DIRECT rates, gpushm's write of a segment to disk
and its restore back, with one directory and with several on the same
drive, and the path users have today, safetensors loading the same model
from the same disk with the page cache dropped.

    GPUSHM_BIN=.gpu/gpushm PYTHONPATH=python python3 python/bench/bench_disk.py --dir /var/tmp/gpushm-bench-disk
    python3 python/bench/bench_disk.py --smoke     # CI: host backend, 64 MiB

1. dd: `dd oflag=direct` of --size bytes in blocks of 64 MiB, then `dd
   iflag=direct` of that file: the drive's own rates.
2. A safetensors file of --size bytes (tensors of 1 GiB at most, each of
   a pattern of its own) is written to --dir and put as a bundle.
3. For 1 and for --stripes directories under --dir (the same drive): the
   bundle is evicted to disk (`evict --to disk`, timed: its write) and
   loaded back (`load`, timed: its restore, into GPU memory on cuda), its
   bytes checked against the file; then removed from disk and put again.
4. The page cache dropped (/proc/sys/vm/drop_caches, as root), the file is
   loaded with safetensors.torch.load_file(device="cuda") on cuda, or read
   whole with numpy on the host backend, in a fresh process.

Targets: write and restore at least 0.9x dd's rates; restore never slower
than the cold safetensors load; several directories not slower than one
(by 10%). PASS/FAIL/INFO lines and a markdown table; exit 1 on a failure.
With --smoke the figures mean nothing and only correctness fails a run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(HERE.parent))

import gpushm  # noqa: E402
from gpushm import testing  # noqa: E402

from _report import check, say, table, verdicts  # noqa: E402

GIB, MIB = 1 << 30, 1 << 20


def parse_size(s: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([KMGT]?)(i?B)?", s.strip(), re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {s}")
    return int(m.group(1)) << (10 * " KMGT".index(m.group(2).upper() or " "))


def gbps(n, secs):
    return n / secs / 1e9 if secs > 0 else float("inf")


def drop_caches():
    """Drops the page cache (root only); says whether it did."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def dd_rates(d: Path, size: int):
    """dd's own O_DIRECT write and read of size bytes in d, in seconds."""
    f = d / "dd.bin"
    count = max(1, size // (64 * MIB))
    t = time.perf_counter()
    subprocess.run(["dd", "if=/dev/zero", f"of={f}", "bs=64M", f"count={count}", "oflag=direct", "conv=fsync"],
                   check=True, capture_output=True)
    w = time.perf_counter() - t
    t = time.perf_counter()
    subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=64M", "iflag=direct"], check=True, capture_output=True)
    r = time.perf_counter() - t
    f.unlink()
    return count * 64 * MIB, w, r


def write_model(path: Path, size: int):
    """A safetensors file of size bytes: uint8 tensors of 1 GiB at most,
    tensor k holding (i + 31 k) mod 251 at byte i."""
    import numpy as np

    n = max(1, (size + GIB - 1) // GIB)
    lens = [size // n + (1 if k < size % n else 0) for k in range(n)]
    header, off = {}, 0
    for k, ln in enumerate(lens):
        header[f"t{k}"] = {"dtype": "U8", "shape": [ln], "data_offsets": [off, off + ln]}
        off += ln
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    base = (np.arange(GIB + 251 * 32, dtype=np.uint32) % 251).astype(np.uint8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for k, ln in enumerate(lens):
            s = (31 * k) % 251
            f.write(base[s:s + ln].tobytes())
        f.flush()
        os.fsync(f.fileno())
    return lens


WORKER = r"""
import sys, time, json
path, backend = sys.argv[1], sys.argv[2]
t = time.perf_counter()
if backend == "cuda":
    import torch
    from safetensors.torch import load_file
    ts = load_file(path, device="cuda")
    torch.cuda.synchronize()
    n = sum(v.numel() for v in ts.values())
else:
    import numpy as np
    n = np.fromfile(path, dtype=np.uint8).size
print(json.dumps({"seconds": time.perf_counter() - t, "bytes": int(n)}))
"""

CHECK = r"""
import sys, json
import gpushm
c = gpushm.connect()
b = c.tensors(sys.argv[1], readonly=True)
bad = []
names = sorted(b.keys(), key=lambda s: int(s[1:]))
for k, name in enumerate(names):
    if sys.argv[2] == "cuda":
        import torch
        v = torch.from_dlpack(b[name])
        want = ((torch.arange(v.numel(), device=v.device, dtype=torch.int64) + 31 * k) % 251).to(torch.uint8)
        ok = torch.equal(v, want)
    else:
        import numpy as np
        v = b[name].numpy()
        ok = np.array_equal(v, ((np.arange(v.size, dtype=np.uint64) + 31 * k) % 251).astype(np.uint8))
    if not ok:
        bad.append(name)
print(json.dumps({"bad": bad, "tensors": len(names)}))
"""


def check_bundle(env, name, backend):
    p = subprocess.run([sys.executable, "-c", CHECK, name, backend], env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        return f"exit {p.returncode}: {p.stderr[-800:]}"
    r = json.loads(p.stdout.strip().splitlines()[-1])
    return "" if not r["bad"] and r["tensors"] > 0 else f"tensors that differ: {r['bad']}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpushm", default=os.environ.get("GPUSHM_BIN", str(REPO / ".build" / "gpushm")),
                    help="the gpushm binary (default $GPUSHM_BIN)")
    ap.add_argument("--backend", default=None, help="cuda or host (default: cuda where torch sees a GPU)")
    ap.add_argument("--dir", default=None, help="a directory on the drive to measure (default: a new one under /var/tmp)")
    ap.add_argument("--size", type=parse_size, default=16 * GIB, help="bytes of the model (default 16GiB)")
    ap.add_argument("--stripes", type=int, default=3, help="directories on the same drive for the second round (default 3)")
    ap.add_argument("--smoke", action="store_true", help="host backend, 64 MiB: that it runs, not its figures")
    a = ap.parse_args()
    if a.smoke:
        a.backend, a.size = "host", 64 * MIB
    if a.backend is None:
        try:
            import torch
            a.backend = "cuda" if torch.cuda.is_available() else "host"
        except ImportError:
            a.backend = "host"
    made = a.dir is None
    work = Path(a.dir or tempfile.mkdtemp(prefix="gpushm-bench-disk-", dir="/var/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    daemon = None
    try:
        say("INFO", "machine", f"backend {a.backend}, {a.size} bytes, in {work} "
            f"({subprocess.run(['df', '-T', str(work)], capture_output=True, text=True).stdout.splitlines()[-1]})")
        n, dd_w, dd_r = dd_rates(work, a.size)
        model = work / "model.safetensors"
        write_model(model, a.size)
        rows, rates = [], {}
        for stripes in (1, a.stripes):
            dirs = [str(work / f"tier{stripes}-{k}") for k in range(stripes)]
            daemon = testing.Daemon(a.backend, "--disk", ",".join(dirs), binary=a.gpushm, new_session=True, timeout=120)
            env = dict(os.environ, GPUSHM_SOCKET=daemon.socket, PYTHONPATH=str(REPO / "python"))
            c = gpushm.connect(daemon.socket, timeout=1800)
            p = subprocess.run([a.gpushm, "put", "-q", "m", str(model)], env=env, capture_output=True, text=True)
            if not check(p.returncode == 0, f"put-{stripes}", p.stderr.strip() or "put the model"):
                break
            size = c.stat("m").alloc_size
            t = time.perf_counter()
            c.evict("m", to="disk")
            w = time.perf_counter() - t
            t = time.perf_counter()
            inf = c.load("m")
            r = time.perf_counter() - t
            bad = check_bundle(env, "m", a.backend)
            check(not bad and inf.tier == "gpu", f"bytes-{stripes}", bad or f"every tensor came back from disk ({size} bytes)")
            rates[stripes] = (gbps(size, w), gbps(size, r))
            rows.append([f"gpushm, {stripes} director{'y' if stripes == 1 else 'ies'}", f"{w:.2f} s",
                         f"{gbps(size, w):.2f}", f"{gbps(size, w) / gbps(n, dd_w):.2f}x",
                         f"{r:.2f} s", f"{gbps(size, r):.2f}", f"{gbps(size, r) / gbps(n, dd_r):.2f}x"])
            c.close()
            daemon.stop()
            daemon = None
        dropped = False if a.smoke else drop_caches()
        p = subprocess.run([sys.executable, "-c", WORKER, str(model), a.backend], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=str(REPO / "python")), timeout=1800)
        cold = None
        if p.returncode == 0:
            cold = json.loads(p.stdout.strip().splitlines()[-1])["seconds"]
        else:
            say("INFO", "cold-load", f"not measured: {p.stderr.strip()[-300:]}")
        what = "safetensors load_file to cuda" if a.backend == "cuda" else "numpy.fromfile"
        table(f"The disk tier, {a.size} bytes, backend {a.backend} (ratios to dd's O_DIRECT rate)",
              ["path", "write", "GB/s", "vs dd", "read / restore", "GB/s", "vs dd"],
              [["dd, O_DIRECT, 64 MiB blocks", f"{dd_w:.2f} s", f"{gbps(n, dd_w):.2f}", "1.00x",
                f"{dd_r:.2f} s", f"{gbps(n, dd_r):.2f}", "1.00x"], *rows,
               [f"{what}, page cache {'dropped' if dropped else 'NOT dropped (not root)'}", "", "", "",
                "-" if cold is None else f"{cold:.2f} s", "-" if cold is None else f"{gbps(a.size, cold):.2f}",
                "-" if cold is None else f"{gbps(a.size, cold) / gbps(n, dd_r):.2f}x"]])
        if not a.smoke and 1 in rates:
            w1, r1 = rates[1]
            check(w1 >= 0.9 * gbps(n, dd_w), "write-rate", f"{w1:.2f} GB/s against dd's {gbps(n, dd_w):.2f} (0.9x asked)")
            check(r1 >= 0.9 * gbps(n, dd_r), "restore-rate", f"{r1:.2f} GB/s against dd's {gbps(n, dd_r):.2f} (0.9x asked)")
            if cold is not None:
                check(r1 >= gbps(a.size, cold), "restore-vs-cold-load", f"{r1:.2f} GB/s against {what}'s {gbps(a.size, cold):.2f}")
            if a.stripes in rates and a.stripes != 1:
                ws, rs = rates[a.stripes]
                check(ws >= 0.9 * w1 and rs >= 0.9 * r1, "stripes-on-one-drive",
                      f"{a.stripes} directories: write {ws:.2f}, restore {rs:.2f} GB/s; one: {w1:.2f}, {r1:.2f}")
    finally:
        if daemon is not None:
            daemon.stop()
        if made:
            shutil.rmtree(work, ignore_errors=True)
        else:
            for f in ("model.safetensors", "dd.bin"):
                (work / f).unlink(missing_ok=True)
            for d in work.glob("tier*"):
                shutil.rmtree(d, ignore_errors=True)
    failed = [v for v in verdicts if v.startswith("FAIL")]
    print(f"\nbench_disk: {len(failed)} failed of {len(verdicts)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
