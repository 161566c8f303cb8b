#!/usr/bin/env python3
"""Loaders that read safetensors, unchanged, from disk against the same code
under python -m gpushm.run, on the same checkpoint, in the same run.

    GPUSHM_BIN=.gpu/gpushm PYTHONPATH=python python3 python/bench/bench_loaders.py --out gpu-out/loaders
    python3 python/bench/bench_loaders.py --smoke      # CI: host backend, a tiny checkpoint, numpy

For each size (2G: TinyLlama-1.1B's shapes, 22 layers, 2.05 GiB of bf16 in
one shard; 16G: Llama-3-8B's shapes, 35 layers, 16.2 GiB in four) it writes
a checkpoint directory of random weights as save_pretrained lays it out
(bench_models.synthesize), puts it with 'gpushm put NAME DIR' (which
records where each shard came from: the hook serves a file only while it
is the one that was put), and reads the shards once so that they sit in
the page cache. Then, one fresh worker process at a time, each importing
what it uses (torch, safetensors, and transformers for its part; under the
hook also gpushm.safetensors, which the hook imports at the first open)
and making its CUDA context before its timer, alternating plain and
gpushm in every round:

  safe_open     with safe_open(shard, framework="pt", device="cuda:0") as h:
                    for k in h.keys(): sd[k] = h.get_tensor(k)
                over every shard, then torch.cuda.synchronize(); plain: the
                safetensors library from the page cache; gpushm: the same
                code under the hook (views of the bundle, no copy).
  transformers  AutoModelForCausalLM.from_pretrained(dir, device_map="cuda",
                dtype=torch.bfloat16) plain, and under the hook with
                --cpu-tensors=gpu (transformers asks for CPU tensors);
                logits of one input must be equal; the gpushm worker counts
                the parameters that are views of the bundle (inference
                tensors).
  tp            vLLM's loading loop (_engine_loops.load_into: safe_open
                without device=, get_tensor, narrow to the rank's part,
                copy_ into the engine's own preallocated parameters) for
                tensor-parallel rank 0 and then rank 1 of 2, both on this
                GPU: under the hook with --cpu-tensors=gpu (device-to-device
                copies from the bundle) every round, plain (host-to-device
                copies from the page cache) in the first round only. Bytes
                copied over both ranks / their time = GB/s; rank 0's time
                includes the process's first open (its connection to the
                daemon, the bundle's mapping).

Every worker reports a digest of what it loaded (each tensor's byte sum,
first and last 4 KiB): plain and gpushm must agree, and every gpushm open
must have been served by gpushm (every plain one by the library).

Targets, checked at 16G (INFO lines at other sizes): safe_open >= 20x
faster under the hook, from_pretrained >= 5x, the TP loop >= 100 GB/s. At
its end the program stops its daemon and prints the processes it started
that are still alive (none) and the GPU memory in use against what it found
at its start. PASS/FAIL/SKIP/INFO lines, tables, OUT/loaders.json with the
figures; exit 1 if anything failed. Rounds after the first are skipped when
the next would not fit in --budget.

--smoke (CI, no torch, no GPU): the host backend, a tiny float32 checkpoint
in two shards, the safe_open and tp workers with framework="np"; where the
safetensors library is not installed, a small stand-in package of that
name reads the files, so that the hook still has a library to wrap. Both
ways are also checked against the files parsed directly.

Without torch, transformers, safetensors or a CUDA device (and no --smoke)
the comparison is skipped with a message. The same file is the workers'
program ('worker' subcommand).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import signal
import statistics
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

import gpushm  # noqa: E402,F401
import gpushm.run as gprun  # noqa: E402
from gpushm.testing import safetensors_standin  # noqa: E402

import _run  # noqa: E402
from _report import check, say, table, verdicts  # noqa: E402
from _run import fixed_prompt_logits, fmt_s, have, logits_equal  # noqa: E402

GIB = 1 << 30

# name: (shape, layers)
SIZES = {
    "2G": (dict(hidden=2048, inter=5632, heads=32, kv_heads=4, vocab=32000, tied=False), 22),
    "16G": (dict(hidden=4096, inter=14336, heads=32, kv_heads=8, vocab=128256, tied=False), 35),
    "tiny": (dict(hidden=64, inter=128, heads=4, kv_heads=2, vocab=256, tied=False), 2),
}
TARGET_SIZE = "16G"
TARGETS = {"safe_open": 20.0, "transformers": 5.0, "tp": 100.0}  # x, x, GB/s
TP = 2
EDGE = 4096  # bytes of each tensor's head and tail in the digest


class Run(_run.Run):
    def __init__(self, a):
        super().__init__(a, HERE, "loaders")
        self.deadline = time.monotonic() + a.budget
        self.extra_path = []  # the smoke's stand-in safetensors, when the library is missing

    def start_daemon(self):
        super().start_daemon("--log-level", "warn")

    def time_left(self):
        return self.deadline - time.monotonic()

    def rounds(self, label):
        """The round numbers up to --reps, ending early (with an INFO line)
        where the next round would not fit in what is left of --budget."""
        last = None
        for i in range(self.a.reps):
            if last is not None and self.time_left() < last * 1.1:
                say("INFO", f"{label}-reps", f"{i} of {self.a.reps} rounds: {self.time_left():.0f} s of the budget "
                    f"left, a round took {last:.0f} s")
                return
            t0 = time.monotonic()
            yield i
            last = time.monotonic() - t0

    def env_for(self, how, cpu_tensors=None):
        """A worker's environment: plain (no hook), or what python -m
        gpushm.run [--cpu-tensors=...] gives the program it runs."""
        env = dict(self.env)
        for k in ("GPUSHM_SAFETENSORS", "GPUSHM_CPU_TENSORS"):
            env.pop(k, None)
        env["PYTHONPATH"] = os.pathsep.join([*self.extra_path, env["PYTHONPATH"]])
        return gprun.environment(env, cpu_tensors=cpu_tensors) if how == "gpushm" else env

    def run_worker(self, label, env, *argv, timeout=600):
        """Run.worker with an environment of its own."""
        with open(self.out / f"{self.prefix}-{label}.log", "w") as log:
            p = subprocess.Popen([sys.executable, "-u", self.program, "worker", *argv], env=env,
                                 stdout=subprocess.PIPE, stderr=log, text=True)
        self.started[p.pid] = _run.testing.start_time(p.pid)
        return self.collect(p, label, timeout)


# ---- checkpoints ---------------------------------------------------------------

def _write_st(path, tensors, metadata=None):
    """{name: float32 array} as a safetensors file, laid out as the library
    writes it."""
    header, chunks, off = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, a in tensors.items():
        b = a.astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        chunks.append(b)
        off += len(b)
    js = json.dumps(header).encode()
    js += b" " * (-len(js) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(js)) + js + b"".join(chunks))
    return off


def write_tiny(d: Path, shape, layers):
    """The smoke's checkpoint: Llama's tensor names at a tiny shape, float32
    (numpy reads it without ml_dtypes), in two shards. Returns the tensor
    bytes."""
    import numpy as np

    from bench_models import llama_tensors

    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    specs = list(llama_tensors(layers=layers, **shape))
    half = len(specs) // 2
    total = 0
    for i, part in enumerate((specs[:half], specs[half:])):
        ts = {n: (rng.standard_normal(sh) * 0.02).astype(np.float32) for n, sh in part}
        total += _write_st(d / f"model-{i + 1:05d}-of-00002.safetensors", ts, {"format": "pt"})
    return total


def make_checkpoint(run, label, framework):
    """Writes the checkpoint, puts it (origin recorded), and warms the page
    cache. Returns (dir, bundle name, tensor bytes, shard paths)."""
    from bench_models import shard_files, synthesize

    shape, layers = SIZES[label]
    d = run.work / f"ckpt-{label}"
    shutil.rmtree(d, ignore_errors=True)
    t = time.perf_counter()
    size = write_tiny(d, shape, layers) if framework == "np" else synthesize(d, shape, layers, 5 * 10 ** 9)
    made = time.perf_counter() - t
    name = f"loaders-{label}"
    rc, out, took = run.gpushm("put", name, str(d))
    if rc != 0:
        raise RuntimeError(f"gpushm put {name} {d}: exit {rc}: {out[-500:]}")
    if "records no origin" in out:
        raise RuntimeError(f"gpushm put {name} {d}: {out.strip()[-500:]}")
    files = shard_files(d)
    for p in files:  # the library reads these from the page cache
        with open(p, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass
    say("INFO", f"{label}-checkpoint", f"{size / GIB:.2f} GiB in {len(files)} shards written in {made:.1f} s, "
        f"'gpushm put {name} DIR' {took:.2f} s ({size / took / 1e9:.1f} GB/s, the whole command), "
        "shards read once into the page cache")
    return d, name, size, files


def standin(run):
    """The smoke's stand-in for the safetensors library (when it is not
    installed): gpushm.testing's, which records what it read."""
    return safetensors_standin(run.work / "standin")


# ---- digests ---------------------------------------------------------------------

def _digest(names, sums, heads, tails):
    h = hashlib.sha256()
    for k, s, a, b in zip(names, sums, heads, tails):
        h.update(f"{k}:{s}:{len(a)}:{len(b)};".encode())
        h.update(a)
        h.update(b)
    return h.hexdigest()[:16]


def digest_np(arrays):
    import numpy as np

    names = sorted(arrays)
    us = [np.ascontiguousarray(arrays[k]).reshape(-1).view(np.uint8) for k in names]
    return _digest(names, [int(u.sum(dtype=np.uint64)) for u in us], [u[:EDGE].tobytes() for u in us],
                   [u[-EDGE:].tobytes() if len(u) else b"" for u in us])


def digest_pt(torch, tensors):
    """The same digest of torch tensors, computed on their device: one
    copy to the host for every sum, head and tail together."""
    names = sorted(tensors)
    us = [tensors[k].contiguous().reshape(-1).view(torch.uint8) for k in names]
    sums = torch.stack([u.sum(dtype=torch.int64) for u in us]).cpu().tolist() if us else []
    heads = [u[:EDGE] for u in us]
    tails = [u[-EDGE:] if u.numel() else u for u in us]
    hb = torch.cat(heads).cpu().numpy().tobytes() if us else b""
    tb = torch.cat(tails).cpu().numpy().tobytes() if us else b""
    ha, ta, i, j = [], [], 0, 0
    for h, t in zip(heads, tails):
        ha.append(hb[i:i + h.numel()])
        ta.append(tb[j:j + t.numel()])
        i, j = i + h.numel(), j + t.numel()
    return _digest(names, sums, ha, ta)


def parse_headers(files):
    """{name: (dtype, shape)} over the shards' own headers."""
    out = {}
    for p in files:
        with open(p, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            h = json.loads(f.read(n))
        h.pop("__metadata__", None)
        out.update({k: (e["dtype"], tuple(e["shape"])) for k, e in h.items()})
    return out


def part_shape(name, shape, rank_count=TP):
    """The shape of one rank's parameter for a checkpoint tensor."""
    from _engine_loops import llama_shard_dim

    dim = llama_shard_dim(name)
    if dim is None or dim >= len(shape):
        return shape
    return tuple(s // rank_count if i == dim else s for i, s in enumerate(shape))


def reference(files):
    """The smoke's expectations from the files parsed directly: the digest
    of every tensor, and of each TP rank's parameters."""
    import numpy as np

    from _engine_loops import llama_shard_dim

    arrays = {}
    for p in files:
        data = Path(p).read_bytes()
        (n,) = struct.unpack_from("<Q", data)
        h = json.loads(data[8:8 + n])
        h.pop("__metadata__", None)
        for k, e in h.items():
            assert e["dtype"] == "F32", e
            lo, hi = e["data_offsets"]
            arrays[k] = np.frombuffer(data[8 + n + lo:8 + n + hi], "<f4").reshape(e["shape"])
    ranks = []
    for rank in range(TP):
        parts = {}
        for k, a in arrays.items():
            dim, sh = llama_shard_dim(k), part_shape(k, a.shape)
            if dim is not None and dim < a.ndim:
                size = sh[dim]
                a = a[(slice(None),) * dim + (slice(rank * size, rank * size + size),)]
            parts[k] = a
        ranks.append(digest_np(parts))
    return digest_np(arrays), ranks


# ---- the comparison -------------------------------------------------------------

def _median(xs):
    return statistics.median(xs) if xs else None


def _rows_for(res, fw):
    so, tf, tp = res["safe_open"], res["transformers"], res["tp"]
    dev = "cuda:0" if fw == "pt" else "the CPU (numpy)"

    def ratio(k):
        p, g = _median(res[k]["plain"]), _median(res[k]["gpushm"])
        return None if not (p and g) else p / g

    def gbps(xs):
        return "-" if not xs else f"{_median(xs):.1f} GB/s (best {max(xs):.1f})"

    def t(xs):
        return "-" if not xs else f"{fmt_s(_median(xs))} (best {fmt_s(min(xs))})"

    rows = [[f"safe_open every tensor to {dev} ({len(so['plain'])}+{len(so['gpushm'])} runs)", t(so["plain"]),
             t(so["gpushm"]), f"{ratio('safe_open'):.1f}x" if ratio("safe_open") else "-"]]
    if tf["plain"] or tf["gpushm"]:
        rows.append([f"from_pretrained(dir, device_map=\"cuda\") ({len(tf['plain'])}+{len(tf['gpushm'])} runs)",
                     t(tf["plain"]), t(tf["gpushm"]) + " --cpu-tensors=gpu",
                     f"{ratio('transformers'):.1f}x" if ratio("transformers") else "-"])
    rows.append([f"vLLM loop, TP={TP}, both ranks ({len(tp['gbps']['plain'])}+{len(tp['gbps']['gpushm'])} runs)",
                 gbps(tp["gbps"]["plain"]), gbps(tp["gbps"]["gpushm"]) + (" --cpu-tensors=gpu" if fw == "pt" else ""),
                 (f"{_median(tp['gbps']['gpushm']) / _median(tp['gbps']['plain']):.1f}x"
                  if tp["gbps"]["plain"] and tp["gbps"]["gpushm"] else "-")])
    return rows


def compare_size(run, label, torch_ok, figures):
    a = run.a
    fw = "np" if a.backend == "host" else "pt"
    d, name, size, files = make_checkpoint(run, label, fw)
    ref = reference(files) if fw == "np" else None
    res = {"safe_open": {"plain": [], "gpushm": []}, "transformers": {"plain": [], "gpushm": []},
           "tp": {"plain": [], "gpushm": [], "gbps": {"plain": [], "gpushm": []}}}
    figures["sizes"][label] = fig = {"bytes": size, "shards": len(files), "results": res}
    so_reports = {"plain": [], "gpushm": []}
    tp_reports = {"plain": [], "gpushm": []}
    tf_reports = {"plain": [], "gpushm": []}
    fig["workers"] = {"safe_open": so_reports, "transformers": tf_reports, "tp": tp_reports}  # every report
    logits = run.work / f"logits-{label}"
    logits.mkdir(exist_ok=True)
    env = {"safe_open": {h: run.env_for(h) for h in ("plain", "gpushm")},
           "gpu": {h: run.env_for(h, cpu_tensors="gpu") for h in ("plain", "gpushm")}}
    for i in run.rounds(label):
        for how in ("plain", "gpushm"):
            r = run.run_worker(f"{label}-safe_open-{how}-{i}", env["safe_open"][how], "safe_open", "--dir", str(d),
                               "--framework", fw)
            if "error" in r:
                check(False, f"{label}-safe_open-{how}", r["error"])
                continue
            res["safe_open"][how].append(r["load_s"])
            so_reports[how].append(r)
            if "device" in r:  # (the parent makes no CUDA context: it would hold GPU memory)
                figures.setdefault("device", r["device"])
        if torch_ok and fw == "pt":
            for how in ("plain", "gpushm"):
                r = run.run_worker(f"{label}-transformers-{how}-{i}", env["gpu"][how], "transformers", "--dir", str(d),
                                   "--index", str(i), "--logits", str(logits / f"{how}.pt"))
                if "error" in r:
                    check(False, f"{label}-transformers-{how}", r["error"])
                    continue
                res["transformers"][how].append(r["load_s"])
                tf_reports[how].append(r)
        for how in (("plain", "gpushm") if i == 0 else ("gpushm",)):
            r = run.run_worker(f"{label}-tp-{how}-{i}", env["gpu"][how], "tp", "--dir", str(d), "--framework", fw)
            if "error" in r:
                check(False, f"{label}-tp-{how}", r["error"])
                continue
            res["tp"][how].append([x["load_s"] for x in r["ranks"]])
            res["tp"]["gbps"][how].append(r["gbps"])
            tp_reports[how].append(r)

    # What the workers saw: the same tensors both ways, served as intended.
    # (library_reads: the smoke's stand-in counts the files the library itself read.)
    reports = {h: so_reports[h] + tp_reports[h] for h in ("plain", "gpushm")}
    served_ok = (all(r["hooked"] and r["served"] == r["opens"] and r.get("library_reads", 0) == 0
                     for r in reports["gpushm"])
                 and all(not r["hooked"] and r["served"] == 0 and r.get("library_reads", r["opens"]) == r["opens"]
                         for r in reports["plain"]))

    def counts(how):
        return ", ".join(f"{r['served']}/{r['opens']}" for r in reports[how])

    detail = f"opens served from the bundle, under the hook: {counts('gpushm')}; plain: {counts('plain')}"
    if any("library_reads" in r for h in reports for r in reports[h]):
        detail += "; files the stand-in library read: " + "; ".join(
            f"{h} " + ", ".join(str(r.get("library_reads")) for r in reports[h]) for h in ("gpushm", "plain"))
    check(bool(served_ok and reports["gpushm"] and reports["plain"]), f"{label}-served", detail)

    digests = {r["digest"] for h in so_reports for r in so_reports[h]}
    n = so_reports["gpushm"][0]["tensors"] if so_reports["gpushm"] else "?"
    detail = f"every safe_open worker loaded the same {n} tensors (digest {', '.join(sorted(digests))}"
    detail += f"; the files parsed here: {ref[0]})" if ref else ")"
    check(bool(len(digests) == 1 and (not ref or digests == {ref[0]}) and so_reports["plain"] and so_reports["gpushm"]),
          f"{label}-same-tensors", detail)
    views = [(r["views"], r["tensors"]) for r in so_reports["gpushm"]]
    check(bool(views) and all(v == n for v, n in views), f"{label}-views",
          "the gpushm safe_open workers' tensors are read-only views of the bundle (no copy): "
          + ", ".join(f"{v} of {n}" for v, n in views))
    tpd = {h: {tuple(r["digests"]) for r in tp_reports[h]} for h in tp_reports}
    allv = tpd["plain"] | tpd["gpushm"]
    detail = f"the engine's parameters of each rank are equal plain and gpushm (digests " \
             f"{'; '.join(', '.join(x) for x in sorted(allv))}"
    detail += f"; the files parsed here: {', '.join(ref[1])})" if ref else ")"
    check(bool(len(allv) == 1 and tpd["plain"] and tpd["gpushm"] and (not ref or allv == {tuple(ref[1])})),
          f"{label}-tp-same", detail)
    fig["tp_bytes"] = tp_reports["gpushm"][0]["bytes"] if tp_reports["gpushm"] else None

    if torch_ok and fw == "pt":
        eq = logits_equal(logits / "gpushm.pt", logits / "plain.pt")
        check(eq is True, f"{label}-logits", f"from_pretrained under the hook and plain give equal logits: {eq}")
        if tf_reports["gpushm"]:
            r = tf_reports["gpushm"][0]
            check(r["inference"] > 0, f"{label}-transformers-views",
                  f"{r['inference']} of {r['params']} parameters of the model under the hook are views of the bundle")
            fig["transformers_views"] = [r["inference"], r["params"]]

    # The targets.
    target = label == TARGET_SIZE
    kind = check if target else (lambda ok, n, d: say("INFO", n, d))
    for k, what in (("safe_open", "safe_open of every tensor to " + ("cuda:0" if fw == "pt" else "the CPU (numpy)")),
                    ("transformers", "transformers from_pretrained(dir, device_map=\"cuda\")")):
        p, g = _median(res[k]["plain"]), _median(res[k]["gpushm"])
        if p is None or g is None:
            continue
        fig[f"{k}_ratio"] = p / g
        kind(p / g >= TARGETS[k], f"{label}-{k}",
             f"{what} of {size / GIB:.2f} GiB in a fresh process after imports: plain {fmt_s(p)}, under gpushm.run "
             f"{fmt_s(g)} (medians of {len(res[k]['plain'])} and {len(res[k]['gpushm'])}): {p / g:.1f}x "
             f"(target {TARGETS[k]:.0f}x{'' if target else f' at {TARGET_SIZE}'})")
    g = _median(res["tp"]["gbps"]["gpushm"])
    if g is not None:
        per = tp_reports["gpushm"][0]["ranks"]
        kind(g >= TARGETS["tp"], f"{label}-tp",
             f"vLLM's loop into TP={TP} halves under the hook{', device-to-device' if fw == 'pt' else ''}: "
             f"{g:.1f} GB/s median of "
             f"{len(res['tp']['gbps']['gpushm'])} ({fig['tp_bytes'] / 1e9:.2f} GB copied; the first run's ranks "
             + ", ".join(f"{k}: {fmt_s(x['load_s'])}, {x['bytes'] / x['load_s'] / 1e9:.1f} GB/s"
                         for k, x in enumerate(per))
             + ", rank 0 with the process's first open of the bundle"
             + f"); plain from the page cache {_median(res['tp']['gbps']['plain']) or 0:.1f} GB/s "
             f"(target {TARGETS['tp']:.0f} GB/s{'' if target else f' at {TARGET_SIZE}'})")
    rows = _rows_for(res, fw)
    table(f"{label} ({size / GIB:.2f} GiB): a fresh process each after its imports, median (best)",
          ["loop", "plain (page cache)", "under gpushm.run", "ratio"], rows)
    return [[label] + r for r in rows]


# ---- workers ---------------------------------------------------------------------

def worker(argv):
    ap = argparse.ArgumentParser(prog="bench_loaders.py worker")
    ap.add_argument("kind", choices=["safe_open", "transformers", "tp"])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--framework", default="pt", choices=["pt", "np"])
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--logits")
    a = ap.parse_args(argv)
    rep = {"safe_open": w_safe_open, "transformers": w_transformers, "tp": w_tp}[a.kind](a)
    print(json.dumps(rep), flush=True)


def _imports(a, with_transformers=False):
    """Imports what the worker uses (gpushm.safetensors too under the hook,
    which imports it at the first open), then makes the CUDA context.
    Returns (torch or None, safe_open, report)."""
    t = time.perf_counter()
    torch = None
    if a.framework == "pt":
        import torch
        import safetensors.torch  # noqa: F401
    import numpy  # noqa: F401
    import safetensors
    if with_transformers:
        import transformers as tf
        import transformers.models.llama.modeling_llama  # noqa: F401  (imported lazily otherwise)
        for cls in ("AutoConfig", "AutoModelForCausalLM", "GenerationConfig"):
            getattr(tf, cls)
    import _engine_loops  # noqa: F401
    safe_open = safetensors.safe_open
    hooked = getattr(safe_open, "_gpushm_real", None) is not None
    rep = {"import_s": time.perf_counter() - t, "hooked": hooked}
    if hooked:
        t = time.perf_counter()
        import gpushm.safetensors  # noqa: F401
        rep["gpushm_import_s"] = time.perf_counter() - t
    if torch is not None:
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        rep["device"] = torch.cuda.get_device_name(0)
    return torch, safe_open, rep


def _shards(a):
    return [str(p) for p in sorted(Path(a.dir).glob("*.safetensors"))]


def _served_by_gpushm(h):
    return type(h).__module__ == "gpushm.safetensors"


def _sync(torch):
    if torch is not None:
        torch.cuda.synchronize()


def w_safe_open(a):
    torch, safe_open, rep = _imports(a)
    files = _shards(a)
    device = "cuda:0" if torch is not None else "cpu"
    fw = a.framework
    opens = []
    t = time.perf_counter()
    sd = {}
    for f in files:
        with safe_open(f, framework=fw, device=device) as h:
            opens.append(_served_by_gpushm(h))
            for k in h.keys():
                sd[k] = h.get_tensor(k)
    _sync(torch)
    rep["load_s"] = time.perf_counter() - t
    rep.update(opens=len(opens), served=sum(opens), tensors=len(sd))
    if torch is not None:
        rep["bytes"] = sum(x.numel() * x.element_size() for x in sd.values())
        rep["views"] = sum(1 for x in sd.values() if x.device.type == "cuda" and _shared(x))
        rep["digest"] = digest_pt(torch, sd)
    else:
        rep["bytes"] = sum(x.nbytes for x in sd.values())
        rep["views"] = sum(1 for x in sd.values() if not x.flags.writeable)
        rep["digest"] = digest_np(sd)
    _library_reads(rep)
    return rep


def w_transformers(a):
    torch, _, rep = _imports(a, with_transformers=True)
    import transformers

    kw = {"device_map": "cuda", "dtype": torch.bfloat16}
    if int(transformers.__version__.split(".")[0]) < 5:
        kw["torch_dtype"] = kw.pop("dtype")
    t = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(a.dir, **kw)
    torch.cuda.synchronize()
    rep["load_s"] = time.perf_counter() - t
    params = list(model.parameters())
    rep["params"] = len(params)
    rep["inference"] = sum(1 for p in params if _shared(p))
    logits = fixed_prompt_logits(torch, model)
    if a.logits and a.index == 0:
        torch.save(logits.cpu(), a.logits)
    return rep


_PT = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
_NP = {"F16": "<f2", "F32": "<f4"}


def w_tp(a):
    """vLLM's loop (_engine_loops.load_into) for rank 0 and then rank 1 of
    TP, each into parameters preallocated before its timer."""
    torch, safe_open, rep = _imports(a)
    import numpy as np

    import _engine_loops as el

    files = _shards(a)
    headers = parse_headers(files)
    opens = []

    def recording(*args, **kw):
        h = safe_open(*args, **kw)
        opens.append(_served_by_gpushm(h))
        return h

    ranks, digests = [], []
    for rank in range(TP):
        if torch is not None:
            params = {k: torch.empty(part_shape(k, sh), dtype=getattr(torch, _PT[dt]), device="cuda")
                      for k, (dt, sh) in headers.items()}
        else:
            params = {k: np.empty(part_shape(k, sh), dtype=_NP[dt]) for k, (dt, sh) in headers.items()}
        _sync(torch)
        t = time.perf_counter()
        loaded = el.load_into(params, files, rank, TP, safe_open=recording, framework=a.framework)
        _sync(torch)
        took = time.perf_counter() - t
        if loaded != set(params):
            raise RuntimeError(f"rank {rank}: loaded {len(loaded)} of {len(params)} parameters")
        n = sum((x.numel() * x.element_size()) if torch is not None else x.nbytes for x in params.values())
        ranks.append({"load_s": took, "bytes": n})
        digests.append(digest_pt(torch, params) if torch is not None else digest_np(params))
        del params
    rep.update(ranks=ranks, digests=digests, opens=len(opens), served=sum(opens),
               bytes=sum(r["bytes"] for r in ranks))
    rep["gbps"] = rep["bytes"] / sum(r["load_s"] for r in ranks) / 1e9
    _library_reads(rep)
    return rep


def _library_reads(rep):
    st = sys.modules.get("safetensors")
    if hasattr(st, "READS"):  # the smoke's stand-in: the files the library itself read
        rep["library_reads"] = len(st.READS)


# ---- main ------------------------------------------------------------------------

def _shared(t):
    """Whether t is a view of a bundle (gpushm.safetensors.shared), in a
    worker under the hook; False elsewhere."""
    mod = sys.modules.get("gpushm.safetensors")
    return bool(mod is not None and mod.shared(t))


def bench_main(name, doc, budget, modules, make_run, compare, summarize, figures=None):
    """The main of a program that compares loaders over model sizes (this
    one, bench_default.py): its arguments, what the machine lacks (SKIP),
    the run's daemon, compare(run, label, torch_ok, figures) for each size,
    summarize(rows, sizes, a) with the rows they returned, the leftover
    check, and OUT/NAME.json with the figures. modules: what the GPU
    comparison imports. Returns the exit status."""
    ap = _run.parser(doc)
    ap.add_argument("--sizes", default="2G,16G", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--reps", type=int, default=3, help="rounds of fresh workers per size")
    ap.add_argument("--budget", type=float, default=budget, help="seconds; later rounds are skipped to stay within it")
    ap.add_argument("--smoke", action="store_true", help="CI: --backend host --sizes tiny --reps 1, numpy workers")
    a, sizes = _run.sized_args(ap, SIZES)
    if a.backend == "host" and sizes != ["tiny"]:
        ap.error("--backend host runs numpy workers on the tiny checkpoint only (--sizes tiny, or --smoke)")
    torch_ok, missing = False, []
    if a.backend == "cuda":
        missing = have(*modules)
        torch_ok = not missing
        if torch_ok:
            import torch
            if not torch.cuda.is_available():
                torch_ok, missing = False, ["a CUDA device for torch"]
    versions = {"python": platform.python_version()}
    if torch_ok:
        for m in modules:
            versions[m] = __import__(m).__version__
    print(f"bench_{name}: {time.strftime('%Y-%m-%d %H:%M:%S')}, backend {a.backend}, sizes {', '.join(sizes)}, "
          f"{a.reps} rounds, budget {a.budget:.0f} s; " + ", ".join(f"{k} {v}" for k, v in versions.items()),
          flush=True)
    print("command: python3 " + " ".join(sys.argv), flush=True)
    if a.backend == "cuda" and not torch_ok:
        say("SKIP", name, "needs " + ", ".join(missing) + " (--smoke runs the numpy part on the host backend)")
        return 0
    made = a.work is None
    if made:
        gpu_dir = REPO / ".gpu"
        a.work = tempfile.mkdtemp(prefix=f"gpushm-{name}-", dir=str(gpu_dir) if gpu_dir.is_dir() else None)
    os.environ["GPUSHM_BENCH_BACKEND"] = a.backend
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    from bench_pretrained import gpu_memory

    used0 = gpu_memory(torch_ok) if a.backend == "cuda" else None
    figures = {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "backend": a.backend, "versions": versions,
               "reps": a.reps, **(figures or {}), "sizes": {}}
    run = make_run(a)
    status = 1
    try:
        run.start_daemon()
        if a.backend == "host" and have("safetensors"):
            run.extra_path = [str(standin(run))]
            say("INFO", "library", "the safetensors library is not installed: a stand-in package reads the files "
                "(the hook wraps it as it would the library)")
        rows = [r for rs in run.per_size(sizes, lambda label: compare(run, label, torch_ok, figures)) for r in rs]
        summarize(rows, sizes, a)
    except Exception as e:
        check(False, "setup", f"{type(e).__name__}: {e}")
    finally:
        # Also when stopped by SIGTERM (a time limit): what ran is reported.
        status = run.finish(used0, lambda: gpu_memory(torch_ok), made)
        figures["verdicts"] = list(verdicts)
        with open(Path(a.out) / f"{name}.json", "w") as f:
            json.dump(figures, f, indent=2)
            f.write("\n")
    return status


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        return worker(sys.argv[2:])

    def summarize(rows, sizes, a):
        if rows:
            table(f"safetensors loaders in a fresh process after imports and CUDA context, plain (files in the page "
                  f"cache) against python -m gpushm.run, one process at a time (median of up to {a.reps})",
                  ["size", "loop", "plain", "under gpushm.run", "ratio"], rows)

    targets = {"size": TARGET_SIZE, "safe_open_x": TARGETS["safe_open"], "transformers_x": TARGETS["transformers"],
               "tp_gbps": TARGETS["tp"]}
    return bench_main("loaders", __doc__, 420, ("torch", "safetensors", "transformers"), Run, compare_size, summarize,
                      {"targets": targets})


if __name__ == "__main__":
    sys.exit(main())
