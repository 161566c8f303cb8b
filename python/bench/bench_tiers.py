#!/usr/bin/env python3
"""More models than GPU memory: a GPU budget, segments evicted to host
memory and brought back on open, measured from fresh processes.

    GPUSHM_BIN=.gpu/gpushm PYTHONPATH=python python3 python/bench/bench_tiers.py --out gpu-out
    python3 python/bench/bench_tiers.py --smoke      # CI: host backend, tiny bundles

One daemon with --gpu-budget (24 GiB; the smoke test: two and a half
bundles), and three parts:

1. restore: one segment of --big bytes (16 GiB), filled on the GPU,
   evicted ('evict'), then opened by a fresh process: the time from the
   open call to the mapped pointer, against the item's 0.7 s (moonshot
   0.4 s), and the daemon's own copy times both ways (its log). Each of
   --reps rounds checks the bytes that came back.
2. churn: six checkpoints of --bundle bytes (Llama-3-8B's shapes with
   fewer layers, random bf16 of a seed each, as save_pretrained lays
   them out), each put as a bundle ('gpushm put NAME DIR'): 36 GiB under
   a budget of 24. Four worker processes then open them in random orders
   for --seconds and check every tensor against the files (the sum of its
   16-bit words, computed from the files beforehand; one tensor per open
   compared whole). Printed: nvidia-smi's memory in use over time (never
   above the budget plus the processes' own contexts), every restore's
   time and GB/s (the daemon's log), the opens' times.
3. loaders: in the same run, fresh processes load the first checkpoint
   with safetensors.torch.load_file (every shard, to the GPU) and with
   transformers' AutoModelForCausalLM.from_pretrained (device_map
   "cuda"), its files in the page cache, beside
   gpushm.transformers.from_pretrained of the bundle evicted (the restore
   included) and on the GPU.

At the end it stops its daemon and prints the processes it started that
are still alive (none) and the GPU memory in use against its start.
PASS/FAIL/SKIP/INFO lines; exit 1 if anything failed. Without torch (CI's
Python) the workers check with numpy and part 3 is skipped. The same file
is the workers' program ('worker' subcommand).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
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

import _run  # noqa: E402
from _report import check, say, table  # noqa: E402
from _run import fmt_s, have  # noqa: E402

GIB = 1 << 30
# Llama-3-8B's shapes; layers sets the size (9: 5.9 GiB).
SHAPE_8B = dict(hidden=4096, inter=14336, heads=32, kv_heads=8, vocab=128256, tied=False)
# The smoke test's: 5 MiB a checkpoint, mostly the embeddings.
SHAPE_SMOKE = dict(hidden=256, inter=512, heads=4, kv_heads=2, vocab=4096, tied=False)


class Run(_run.Run):
    def __init__(self, a):
        super().__init__(a, HERE, "tiers")

    def moves(self):
        """The daemon's log of moves: (kind, name, bytes, seconds)."""
        out = []
        for line in self.daemon.logs().splitlines():
            m = re.search(r"msg=(evict|restore) .*name=(\S+) bytes=(\d+) seconds=([\d.e-]+)", line)
            if m:
                out.append((m[1], m[2], int(m[3]), float(m[4])))
        return out


# ---- 1. one big restore --------------------------------------------------------

def part_restore(run, torch_ok):
    a, c = run.a, run.client
    name = "tiers-big"
    r = run.worker("big-fill", "fill", "--name", name, "--bytes", str(a.big), *(["--torch"] if torch_ok else []))
    if not check("error" not in r, "big-fill", r.get("error") or f"{a.big / GIB:.2f} GiB created and filled"):
        return None
    rows = []
    for i in range(a.reps + a.write_reps):
        # The first rounds open read-only: the host copy stays, and the
        # next eviction is a swap. The last ones open read-write: the
        # next eviction copies, into the host memory the restore let go.
        write = i >= a.reps
        if i == 0 and a.after_start is not None:
            # The first eviction at a set time after the daemon started,
            # with whatever the reserve holds by then (issue 40, part 4).
            time.sleep(max(0.0, a.started + a.after_start - time.perf_counter()))
            tiers = c.info()["tiers"]
            print(f"first eviction {time.perf_counter() - a.started:.1f} s after the daemon started; host reserve "
                  f"{tiers.get('reserve_bytes', 0) / GIB:.2f} GiB of {tiers.get('reserve_target_bytes', 0) / GIB:.2f} "
                  f"GiB made", flush=True)
        t = time.perf_counter()
        c.evict(name)
        evict_s = time.perf_counter() - t
        r = run.worker(f"big-open-{i}", "open", "--name", name, *(["--torch"] if torch_ok else []),
                       *(["--write"] if write else []))
        if "error" in r:
            check(False, f"big-open-{i}", r["error"])
            continue
        check(r["ok"], f"big-bytes-{i}", f"the {a.big / GIB:.2f} GiB that came back hold what was written: {r['ok']}")
        rows.append((evict_s, r["open_s"], write))
    moves = [m for m in run.moves() if m[1] == name]
    ev = [m[3] for m in moves if m[0] == "evict"]
    rs = [m[3] for m in moves if m[0] == "restore"]
    c.unlink(name)
    if not rows:
        return None
    opens = [o for _, o, _ in rows]
    med = statistics.median(opens)
    table(f"restore of {a.big / GIB:.2f} GiB: evict, then open from a fresh process ({a.backend}); the evict of "
          f"round 1 makes new host memory, after a read-only open it is a swap, after a read-write open a copy into "
          f"the host memory the restore let go",
          ["round", "open", "evict (request)", "daemon's evict", "GB/s, evict", "open to mapped pointer",
           "daemon's restore copy", "GB/s, open"],
          [[i + 1, "read-write" if w else "read-only", fmt_s(e), fmt_s(ev[i]) if i < len(ev) else "-",
            f"{a.big / ev[i] / 1e9:.1f}" if i < len(ev) else "-", fmt_s(o),
            fmt_s(rs[i]) if i < len(rs) else "-", f"{a.big / o / 1e9:.1f}"] for i, (e, o, w) in enumerate(rows)])
    if not a.smoke:
        check(med <= 0.7, "restore-16GiB", f"open of an evicted {a.big / GIB:.2f} GiB segment to its mapped pointer: "
              f"{fmt_s(med)} median of {len(opens)} ({a.big / med / 1e9:.1f} GB/s; target 0.7 s, 25 GB/s; "
              f"moonshot 0.4 s); the daemon's copy {fmt_s(statistics.median(rs)) if rs else '-'} back, "
              f"{fmt_s(statistics.median(ev)) if ev else '-'} out")
    return med


# ---- 2. six bundles under a budget of four -------------------------------------------

def make_bundles(run):
    from bench_models import shard_files, synthesize

    a = run.a
    shape, layers = (SHAPE_SMOKE, 2) if a.smoke else (SHAPE_8B, a.layers)
    bundles = []
    for i in range(a.bundles):
        d = run.work / f"ckpt-{i}"
        shutil.rmtree(d, ignore_errors=True)
        t = time.perf_counter()
        size = synthesize(d, shape, layers, 5 * 10 ** 9, seed=i + 1)
        made = time.perf_counter() - t
        name = f"tiers-model-{i}"
        rc, out, took = run.gpushm("put", name, str(d))
        if rc != 0:
            raise RuntimeError(f"gpushm put {name} {d}: exit {rc}: {out[-500:]}")
        say("INFO", f"bundle-{i}", f"{size / GIB:.2f} GiB in {len(shard_files(d))} shards, written in {made:.1f} s; "
            f"'gpushm put' {took:.2f} s")
        bundles.append((name, d, size))
    return bundles


def expected_sums(bundles, out):
    """Per bundle, per tensor: the sum of its 16-bit words, from the files."""
    import numpy as np

    from bench_models import shard_files

    sums = {}
    for name, d, _ in bundles:
        s = {}
        for p in shard_files(d):
            raw = np.memmap(p, dtype=np.uint8, mode="r")
            n = int.from_bytes(raw[:8].tobytes(), "little")
            header = json.loads(raw[8:8 + n].tobytes())
            for k, e in header.items():
                if k == "__metadata__":
                    continue
                lo, hi = e["data_offsets"]
                s[k] = [str(p), int(raw[8 + n + lo:8 + n + hi].view(np.int16).sum(dtype=np.int64))]
        sums[name] = s
    path = out / "tiers-sums.json"
    path.write_text(json.dumps(sums))
    return path


class SMI:
    """nvidia-smi's memory in use on GPU 0, sampled every 250 ms, and by
    process every second."""

    def __init__(self, path):
        self.path, self.p = path, None
        if shutil.which("nvidia-smi"):
            self.f = open(path, "w")
            self.p = subprocess.Popen(["nvidia-smi", "-i", "0", "--query-gpu=timestamp,memory.used",
                                       "--format=csv,noheader,nounits", "-lms", "250"], stdout=self.f,
                                      stderr=subprocess.DEVNULL)
            self.fa = open(str(path) + ".apps", "w")
            self.pa = subprocess.Popen(["nvidia-smi", "-i", "0", "--query-compute-apps=pid,used_memory",
                                        "--format=csv,noheader,nounits", "-lms", "1000"], stdout=self.fa,
                                       stderr=subprocess.DEVNULL)

    def apps(self):
        """The most each process was seen to use, MiB by pid."""
        top = {}
        for line in open(str(self.path) + ".apps"):
            parts = [x.strip() for x in line.split(",")]
            if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
                top[int(parts[0])] = max(top.get(int(parts[0]), 0), int(parts[1]))
        return top

    def stop(self):
        if self.p is None:
            return []
        for p in (self.p, self.pa):
            p.terminate()
            p.wait()
        self.fa.close()
        self.f.close()
        out = []
        for line in open(self.path):
            parts = [x.strip() for x in line.split(",")]
            if len(parts) == 2 and parts[1].isdigit():
                out.append(int(parts[1]))
        return out


def part_churn(run, torch_ok, used0):
    a, c = run.a, run.client
    bundles = make_bundles(run)
    sums = expected_sums(bundles, run.out)
    names = [b[0] for b in bundles]
    inf = c.info()
    tiers = {s.name: s.tier for s in c.list() if s.name in names}
    say("INFO", "after-puts", f"tiers {tiers}; {inf['tiers']['evictions']} evictions so far")
    smi = SMI(run.out / "tiers-smi.csv")
    restores_before = len([m for m in run.moves() if m[0] == "restore"])
    t0 = time.monotonic()
    procs = [run.spawn(f"churn-{k}", "churn", "--names", ",".join(names), "--sums", str(sums), "--seconds",
                       str(a.seconds), "--seed", str(k), *(["--torch"] if torch_ok else [])) for k in range(a.workers)]
    reps = [run.collect(p, f"churn-{k}", timeout=a.seconds + 600) for k, p in enumerate(procs)]
    wall = time.monotonic() - t0
    used = smi.stop()
    if used:
        roles = {pid: "daemon" for pid in run.daemon.pids()}
        roles.update({p.pid: f"worker {k}" for k, p in enumerate(procs)})
        say("INFO", "churn-by-process", "the most nvidia-smi saw each process use (MiB): " + ", ".join(
            f"{roles.get(pid, 'pid ' + str(pid))} {mib}" for pid, mib in sorted(smi.apps().items())))
    opens, bad = [], []
    for k, r in enumerate(reps):
        if "error" in r:
            check(False, f"churn-worker-{k}", r["error"])
            continue
        opens.extend(r["opens"])
        bad.extend(r["bad"])
    check(opens and not bad, "churn-tensors", f"{len(opens)} opens by {a.workers} workers in {wall:.0f} s; tensors "
          f"unlike the files: {bad[:5] or 'none'}")
    budget = a.budget_bytes
    peak = c.info()["tiers"]["devices"][0]["peak_bytes"]
    check(peak <= budget, "churn-budget", f"the daemon's peak on the device {peak / GIB:.2f} GiB, budget "
          f"{budget / GIB:.2f} GiB")
    moves = run.moves()
    rs = [m for m in moves if m[0] == "restore"][restores_before:]
    ev = [m for m in moves if m[0] == "evict"]
    if used:
        base = used0[0] if used0 else min(used)
        # Each worker's CUDA context and torch's own memory, and the
        # daemon's context, come on top of the budget.
        allowance = (a.workers + 1) * 1024
        top = max(used)
        check(top - base <= budget / (1 << 20) + allowance, "churn-nvidia-smi",
              f"GPU memory in use at most {top} MiB ({(top - base) / 1024:.2f} GiB above the {base} MiB before the "
              f"daemon started), budget {budget / GIB:.0f} GiB plus {allowance} MiB for {a.workers + 1} processes' "
              f"contexts")
        step = max(1, len(used) // 24)
        table("nvidia-smi: GPU memory in use during the churn (MiB, every 250 ms; min and max of each stretch)",
              ["seconds", "min", "max"],
              [[f"{i * 0.25:.0f}-{(i + step) * 0.25:.0f}", min(used[i:i + step]), max(used[i:i + step])]
               for i in range(0, len(used), step)])
    else:
        say("INFO", "churn-nvidia-smi", "no nvidia-smi here: memory over time not sampled")
    if rs:
        rates = [b / s / 1e9 for _, _, b, s in rs]
        table(f"every restore during the churn (the daemon's copy, {len(rs)} restores)",
              ["#", "bundle", "GiB", "time", "GB/s"],
              [[i + 1, n, f"{b / GIB:.2f}", fmt_s(s), f"{b / s / 1e9:.1f}"] for i, (_, n, b, s) in enumerate(rs)])
        say("INFO", "churn-restores", f"{len(rs)} restores: median {fmt_s(statistics.median(s for *_, s in rs))}, "
            f"{statistics.median(rates):.1f} GB/s (min {min(rates):.1f}, max {max(rates):.1f}); "
            f"{len(ev)} evictions in the whole run, median {fmt_s(statistics.median(s for *_, s in ev)) if ev else '-'}")
    o = sorted(x["open_s"] for x in opens)
    if o:
        cold = sorted(x["open_s"] for x in opens if x["tier"] == "host")
        warm = sorted(x["open_s"] for x in opens if x["tier"] == "gpu")
        table("opens during the churn, from the open call to the tensors (state_dict)",
              ["which", "opens", "p50", "p90", "max"],
              [[w, len(v), fmt_s(v[len(v) // 2]), fmt_s(v[len(v) * 9 // 10]), fmt_s(v[-1])]
               for w, v in (("all", o), ("on host before the open", cold), ("on the GPU before", warm)) if v])
    return bundles


# ---- 3. the same checkpoint, other loaders ----------------------------------------------

def part_loaders(run, bundles):
    name, d, size = bundles[0]
    rows = []
    for how in ("load_file", "from_pretrained", "gpushm-evicted", "gpushm-resident"):
        if how == "gpushm-evicted":
            run.client.evict(name)
        r = run.worker(f"loader-{how}", "load", how, "--name", name, "--dir", str(d))
        if "error" in r:
            check(False, f"loader-{how}", r["error"])
            continue
        rows.append([r["what"], fmt_s(r["load_s"]), f"{size / r['load_s'] / 1e9:.1f}"])
    table(f"loading the same {size / GIB:.2f} GiB checkpoint in a fresh process (after imports and the CUDA context; "
          f"files in the page cache)", ["how", "time", "GB/s"], rows)


# ---- workers ---------------------------------------------------------------------------------

def worker(argv):
    ap = argparse.ArgumentParser(prog="bench_tiers.py worker")
    ap.add_argument("what", choices=["fill", "open", "churn", "load"])
    ap.add_argument("how", nargs="?")
    ap.add_argument("--name")
    ap.add_argument("--names")
    ap.add_argument("--dir")
    ap.add_argument("--bytes", type=int)
    ap.add_argument("--sums")
    ap.add_argument("--seconds", type=float)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch", action="store_true")
    ap.add_argument("--write", action="store_true")
    a = ap.parse_args(argv)
    rep = {"fill": w_fill, "open": w_open, "churn": w_churn, "load": w_load}[a.what](a)
    print(json.dumps(rep), flush=True)


def _pattern_check(a, seg, fill):
    """Fills (or checks) the segment with int64 words equal to their index."""
    if a.torch:
        import torch

        with torch.inference_mode(not fill):
            t = torch.from_dlpack(seg.view("int64", (seg.size // 8,)).__dlpack__())
        # In pieces: torch 2.11's arange into more than 2**32 elements
        # leaves those past it zero, and a whole second copy would not fit
        # beside a segment as large as the GPU.
        step = 1 << 28
        if fill:
            for i in range(0, t.numel(), step):
                torch.arange(i, min(i + step, t.numel()), dtype=torch.int64, device=t.device, out=t[i:i + step])
            torch.cuda.synchronize()
            return True
        return all(torch.equal(t[i:i + step], torch.arange(i, min(i + step, t.numel()), dtype=torch.int64,
                                                           device=t.device)) for i in range(0, t.numel(), step))
    import numpy as np

    v = np.frombuffer(seg.memoryview(), dtype=np.int64)
    if fill:
        v[:] = np.arange(v.size, dtype=np.int64)
        return True
    return bool(np.array_equal(v, np.arange(v.size, dtype=np.int64)))


def w_fill(a):
    c = gpushm.connect()
    seg = c.create(a.name, a.bytes)
    _pattern_check(a, seg, True)
    seg.close()
    return {"ok": True}


def w_open(a):
    if a.torch:
        import torch

        torch.zeros(1, device="cuda")
    c = gpushm.connect()
    t = time.perf_counter()
    seg = c.open(a.name, readonly=not a.write)
    ptr = seg.ptr
    open_s = time.perf_counter() - t
    ok = _pattern_check(a, seg, False)
    if a.write:
        # A write (of what is there): the host copy is stale from now on.
        seg.write(seg.read(8), 0)
    seg.close()
    return {"open_s": open_s, "ptr": ptr, "ok": ok}


def _sum16(torch, t):
    """The sum of t's 16-bit words, in pieces of 16M words: a sum to int64
    casts its input first, and a whole embedding cast would be 4 GiB of
    this worker's own GPU memory."""
    w = t.reshape(-1).view(torch.int16)
    step = 16 << 20
    return torch.stack([w[i:i + step].sum(dtype=torch.int64) for i in range(0, w.numel(), step)]).sum()


def w_churn(a):
    sums = json.loads(Path(a.sums).read_text())
    names = a.names.split(",")
    rng = random.Random(a.seed)
    c = gpushm.connect()
    if a.torch:
        import torch
        from safetensors import safe_open

        import gpushm.torch as gt
        torch.zeros(1, device="cuda")
    else:
        import numpy as np
    opens, bad = [], []
    deadline = time.monotonic() + a.seconds
    while time.monotonic() < deadline:
        name = rng.choice(names)
        tier = c.stat(name).tier
        t = time.perf_counter()
        if a.torch:
            sd = gt.state_dict(name, client=c)
            open_s = time.perf_counter() - t
            keys = list(sd)
            got = torch.stack([_sum16(torch, sd[k]) for k in keys]).tolist()
            k = rng.choice(keys)
            path = sums[name][k][0]
            # Compared on the CPU: a copy on the GPU would stay in torch's
            # cache, and count as this worker's memory.
            with safe_open(path, "pt", device="cpu") as f:
                whole = torch.equal(f.get_tensor(k), sd[k].cpu())
            del sd
            torch.cuda.empty_cache()
        else:
            b = c.tensors(name, readonly=True)
            open_s = time.perf_counter() - t
            keys = list(b)
            got = [int(np.frombuffer(b[k].memoryview(), dtype=np.int16).sum(dtype=np.int64)) for k in keys]
            k = rng.choice(keys)
            path = sums[name][k][0]
            raw = Path(path).read_bytes()
            n = int.from_bytes(raw[:8], "little")
            lo, hi = json.loads(raw[8:8 + n])[k]["data_offsets"]
            whole = b[k].memoryview().tobytes() == raw[8 + n + lo:8 + n + hi]
            del b
        want = [sums[name][k][1] for k in keys]
        if got != want or set(keys) != set(sums[name]) or not whole:
            bad.append(f"{name}: {sum(g != w for g, w in zip(got, want))} tensors' sums differ, whole {k}: {whole}")
        opens.append({"name": name, "tier": tier, "open_s": open_s})
    return {"opens": opens, "bad": bad}


def w_load(a):
    import torch
    import transformers
    import transformers.models.llama.modeling_llama  # noqa: F401

    import gpushm.transformers

    from bench_models import shard_files
    for cls in ("AutoConfig", "AutoModelForCausalLM", "GenerationConfig"):
        getattr(transformers, cls)
    from safetensors.torch import load_file

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    if a.how == "load_file":
        sd = {}
        for p in shard_files(Path(a.dir)):
            sd.update(load_file(str(p), device="cuda"))
        torch.cuda.synchronize()
        what = "safetensors.torch.load_file(shard, device=\"cuda\"), every shard"
    elif a.how == "from_pretrained":
        major = int(transformers.__version__.split(".")[0])
        kw = {"dtype" if major >= 5 else "torch_dtype": torch.bfloat16, "device_map": "cuda"}
        transformers.AutoModelForCausalLM.from_pretrained(a.dir, **kw)
        torch.cuda.synchronize()
        what = "transformers AutoModelForCausalLM.from_pretrained(dir, device_map=\"cuda\", dtype=bfloat16)"
    else:
        gpushm.transformers.from_pretrained(a.name)
        what = "gpushm.transformers.from_pretrained(name), the bundle " + (
            "evicted to host memory (restore included)" if a.how == "gpushm-evicted" else "on the GPU")
    return {"load_s": time.perf_counter() - t, "what": what}


# ---- main -------------------------------------------------------------------------------------

def main():
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        return worker(sys.argv[2:])
    ap = _run.parser(__doc__)
    ap.add_argument("--budget", default="24GiB", help="the daemon's --gpu-budget ('default': its own default)")
    ap.add_argument("--host-reserve", help="the daemon's --host-reserve (default: its own default)")
    ap.add_argument("--after-start", type=float,
                    help="seconds after the daemon started at which part 1's first eviction comes, whatever the "
                         "reserve holds then (default: once a --host-reserve given is full)")
    ap.add_argument("--big", type=int, default=16 * GIB, help="bytes of part 1's segment")
    ap.add_argument("--reps", type=int, default=3, help="rounds of part 1 that open read-only")
    ap.add_argument("--write-reps", type=int, default=2, help="rounds of part 1 that open read-write")
    ap.add_argument("--bundles", type=int, default=6)
    ap.add_argument("--layers", type=int, default=9, help="layers of each checkpoint (9: 5.9 GiB)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=120, help="how long the workers open bundles")
    ap.add_argument("--parts", default="restore,churn,loaders")
    ap.add_argument("--smoke", action="store_true", help="CI: host backend, tiny bundles, 2 workers, 3 seconds")
    a = ap.parse_args()
    if a.smoke:
        # Two workers: each holds a bundle while it checks it, and two and
        # a half fit.
        a.backend, a.big, a.reps, a.write_reps, a.seconds, a.workers = "host", 8 << 20, 1, 1, 3, 2
    os.makedirs(a.out, exist_ok=True)
    made = a.work is None
    if made:
        a.work = tempfile.mkdtemp(prefix="gpushm-tiers-", dir=str(REPO / ".gpu") if (REPO / ".gpu").is_dir() else None)
    parts = set(a.parts.split(","))
    missing = have("torch", "safetensors", "transformers")
    torch_ok = not missing and a.backend == "cuda"
    if torch_ok:
        import torch
        torch_ok = torch.cuda.is_available()
    print(f"bench_tiers: {time.strftime('%Y-%m-%d %H:%M:%S')}, backend {a.backend}, budget {a.budget}; python "
          f"{platform.python_version()}" + ("".join(f", {m} {__import__(m).__version__}"
                                                    for m in ("torch", "transformers")) if torch_ok else ""), flush=True)
    print("command: python3 " + " ".join(sys.argv), flush=True)
    if not torch_ok:
        say("SKIP", "torch", "no torch with a GPU here (" + (", ".join(missing) or a.backend) + "): workers check with "
            "numpy, and the loaders' comparison (part 3) is skipped")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    used0 = testing.gpu_memory_used() if a.backend == "cuda" else None
    run = Run(a)
    try:
        from bench_models import synthesize  # noqa: F401
        if a.smoke:
            # Two and a half of the tiny bundles: size one first.
            from bench_models import llama_tensors
            import numpy as np
            one = sum(2 * int(np.prod(sh)) for _, sh in llama_tensors(layers=2, **SHAPE_SMOKE))
            a.budget = str(max(int(2.5 * one), a.big + (1 << 20)))
        started = time.perf_counter()
        run.start_daemon("--log-level", "info", *(["--gpu-budget", a.budget] if a.budget != "default" else []),
                         *(["--host-reserve", a.host_reserve] if a.host_reserve else []))
        a.budget_bytes = run.client.info()["tiers"]["devices"][0]["budget_bytes"]
        a.started = started
        if a.after_start is None and a.host_reserve:
            # The reserve is made in the background once the daemon
            # serves: the first eviction is timed against a full one.
            t = time.perf_counter()
            while True:
                tiers = run.client.info()["tiers"]
                if tiers.get("reserve_bytes", 0) >= tiers.get("reserve_target_bytes", 1) or time.perf_counter() - t > 120:
                    break
                time.sleep(0.2)
            print(f"host reserve: {tiers.get('reserve_bytes', 0) / GIB:.2f} GiB of "
                  f"{tiers.get('reserve_target_bytes', 0) / GIB:.2f} GiB made in {time.perf_counter() - t:.1f} s")
        if "restore" in parts:
            print(f"\n=== {time.strftime('%H:%M:%S')} 1. restore", flush=True)
            part_restore(run, torch_ok)
        bundles = None
        if "churn" in parts:
            print(f"\n=== {time.strftime('%H:%M:%S')} 2. churn", flush=True)
            bundles = part_churn(run, torch_ok, used0)
        if "loaders" in parts and torch_ok and bundles:
            print(f"\n=== {time.strftime('%H:%M:%S')} 3. loaders", flush=True)
            part_loaders(run, bundles)
    except Exception as e:
        import traceback
        traceback.print_exc()
        check(False, "run", f"{type(e).__name__}: {e}")
    finally:
        status = run.finish(used0, testing.gpu_memory_used, made)
    return status


if __name__ == "__main__":
    sys.exit(main())
