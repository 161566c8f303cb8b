#!/usr/bin/env python3
"""Models by name, measured: a checkpoint directory loaded once with
'gpushm put', and workers that get a model from it without copying.

    python3 python/bench/bench_models.py --gpushm .gpu/gpushm --out OUT
    python3 python/bench/bench_models.py --tiny --backend host   # CI: the smallest size, no GPU

It starts its own daemon (--backend, default cuda) on a private socket and
runs two parts, each on its own even if the other fails:

  a  a small random Llama-style model (transformers' LlamaConfig), saved
     with save_pretrained in several shards; put, get back and compared with
     diff -r; four workers at once call gpushm.transformers.from_pretrained
     and four call AutoModelForCausalLM.from_pretrained(dir,
     device_map="cuda"): attach time, start-to-first-token, logits against
     the original model's, GPU memory with all four alive; an in-place
     write to the shared weights, and a kernel write, must each fail
     loudly and leave the shared copy intact.
  b  a big checkpoint (Llama-3-8B shapes, 35 layers: 16.2 GiB of bf16)
     synthesized as safetensors shards: 'gpushm put' as a whole command
     from the page cache against safetensors.torch.load_file(device="cuda")
     in the same run; the disk read with dd (O_DIRECT, after dropping the
     caches) against a cold 'gpushm put'; four workers attaching the model
     against four transformers loads, and GPU memory for each.

It prints tables and one PASS, FAIL, SKIP or INFO line per check, and
exits 1 if anything failed. Logs and raw figures go to --out. Nothing is
fetched from a network; torch, transformers and safetensors are used where
installed, and the checks that need them are skipped otherwise (as in CI).
The same file is the workers' program ('worker' subcommand).
python/bench/bench_pretrained.py times from_pretrained alone, one fresh
process at a time, against transformers' own, at 1.1B and 16 GB.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
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

import gpushm  # noqa: E402
from gpushm import testing  # noqa: E402

GB = 1e9
GIB = 1 << 30

# ---- reporting ---------------------------------------------------------------

from _report import check, say, table, verdicts as _verdicts  # noqa: E402


def part(name, fn, *args):
    print(f"\n=== {time.strftime('%H:%M:%S')} {name}", flush=True)
    try:
        fn(*args)
    except Exception as e:  # one part failing must not stop the other
        import traceback
        traceback.print_exc()
        say("FAIL", name, f"{type(e).__name__}: {e}")


def have(module):
    try:
        __import__(module)
        return True
    except Exception:
        return False


# ---- processes ---------------------------------------------------------------

class Ctx:
    """What every part needs: the binary, the daemon, where to write."""

    def __init__(self, args, daemon):
        self.args, self.daemon = args, daemon
        self.bin, self.out, self.work = args.gpushm, Path(args.out), Path(args.work)
        self.env = dict(os.environ, GPUSHM_SOCKET=daemon.socket, PYTHONPATH=str(REPO / "python"))
        self.env.pop("PYTHONSTARTUP", None)
        self.client = gpushm.connect(daemon.socket)
        self.gpu = args.backend == "cuda"
        self.deadline = time.monotonic() + args.budget

    def time_for(self, name, seconds):
        """Whether an optional step of about seconds fits the time budget;
        says so when it does not."""
        left = self.deadline - time.monotonic()
        if left < seconds:
            say("SKIP", name, f"{left:.0f}s of the time budget left, the step needs about {seconds:.0f}s")
            return False
        return True

    def gpushm(self, *argv, timeout=300, log=None):
        """Runs the gpushm CLI; returns (rc, stderr, seconds)."""
        t = time.perf_counter()
        r = subprocess.run([self.bin, *argv], env=self.env, capture_output=True, text=True, timeout=timeout)
        dt = time.perf_counter() - t
        if log:
            with open(self.out / log, "a") as f:
                f.write(f"$ gpushm {' '.join(argv)}\nexit {r.returncode} in {dt:.3f}s\n{r.stdout}{r.stderr}\n")
        return r.returncode, r.stderr, dt

    def rm(self, name):
        try:
            self.client.unlink(name)
        except FileNotFoundError:
            pass

    def workers(self, label, n, argv, go_after_ready=None, timeout=600):
        """Starts n workers with argv at once; each prints a JSON line when
        ready and waits for a line on stdin before finishing. Calls
        go_after_ready() while all are alive, then lets them finish. Returns
        (reports, what go_after_ready returned)."""
        procs = []
        for i in range(n):
            t0 = time.time()
            cmd = [sys.executable, "-u", str(HERE), "worker", "--t0", repr(t0), "--index", str(i), *argv]
            procs.append(subprocess.Popen(cmd, env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=open(self.out / f"worker-{label}-{i}.log", "w"), text=True))
        reports, extra = [], None
        deadline = time.monotonic() + timeout
        try:
            for p in procs:
                line = _readline(p, deadline)
                reports.append(json.loads(line) if line.startswith("{") else {"error": f"worker said {line!r}"})
            if go_after_ready and all("error" not in r for r in reports):
                extra = go_after_ready()
            for p, r in zip(procs, reports):
                try:
                    p.stdin.write("go\n")
                    p.stdin.flush()
                except OSError:
                    pass
                line = _readline(p, deadline)
                if line.startswith("{"):
                    r.update(json.loads(line))
        finally:
            for p in procs:
                try:
                    p.wait(max(1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        for i, (p, r) in enumerate(zip(procs, reports)):
            if p.returncode != 0 and "error" not in r:
                r["error"] = f"exit status {p.returncode}"
            if "error" in r:
                r["error"] += f" (log: worker-{label}-{i}.log)"
        return reports, extra


def _readline(p, deadline):
    """The worker's next JSON line; anything else a library printed to
    stdout is passed over. A worker past the deadline is killed."""
    import threading
    left = deadline - time.monotonic()
    if left <= 0:
        p.kill()
        return "timed out"
    timer = threading.Timer(left, p.kill)
    timer.start()
    try:
        while True:
            line = p.stdout.readline()
            if not line:
                return "timed out" if time.monotonic() >= deadline else "exited"
            if line.startswith("{"):
                return line.strip()
    finally:
        timer.cancel()


def gpu_used_mib():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout
        return int(out.strip().splitlines()[0])
    except Exception:
        return None


def leftovers(started, socket, used0):
    """What the run left behind: the daemon's processes (started: pid to
    start time) and any that name its socket, and GPU memory in use against
    what the run found at its start."""
    alive = testing.still_alive(started, naming=socket)
    check(not alive, "leftover-processes", "processes of this run still alive: " + ("; ".join(alive) if alive else "none"))
    used = gpu_used_mib()
    if used0 is None or used is None:
        say("INFO", "leftover-gpu-memory", "no nvidia-smi: GPU memory not checked")
    else:
        check(used <= used0 + 64, "leftover-gpu-memory", f"GPU memory in use {used} MiB at the end, {used0} MiB at the start")


def drop_caches():
    try:
        subprocess.run(["sync"], timeout=300)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def copy_rate(stderr):
    """The copy's own rate from 'gpushm put -v' (the whole command minus
    process start, CUDA context, create and map)."""
    import re
    m = re.search(r": copy .* \(([\d.]+) GB/s\), (.*) with O_DIRECT", stderr)
    return f"{m.group(1)} ({m.group(2)} O_DIRECT)" if m else "-"


def fmt_s(x):
    return "-" if x is None else (f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s")


# ---- checkpoints made here -------------------------------------------------------

# Llama-3-8B's shapes; --layers scales the size (35 layers: 16.2 GiB of bf16).
BIG = dict(hidden=4096, inter=14336, heads=32, kv_heads=8, vocab=128256, tied=False)
TINY = dict(hidden=64, inter=128, heads=4, kv_heads=2, vocab=256, tied=False)


def llama_tensors(hidden, inter, heads, kv_heads, vocab, tied, layers):
    hd = hidden // heads
    yield "model.embed_tokens.weight", (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (hidden,)
        yield p + "self_attn.q_proj.weight", (heads * hd, hidden)
        yield p + "self_attn.k_proj.weight", (kv_heads * hd, hidden)
        yield p + "self_attn.v_proj.weight", (kv_heads * hd, hidden)
        yield p + "self_attn.o_proj.weight", (hidden, heads * hd)
        yield p + "post_attention_layernorm.weight", (hidden,)
        yield p + "mlp.gate_proj.weight", (inter, hidden)
        yield p + "mlp.up_proj.weight", (inter, hidden)
        yield p + "mlp.down_proj.weight", (hidden, inter)
    yield "model.norm.weight", (hidden,)
    if not tied:
        yield "lm_head.weight", (vocab, hidden)


def synthesize(dir: Path, shape: dict, layers: int, shard_bytes: int, seed: int = 0):
    """Writes a Llama-style checkpoint as save_pretrained would (bf16
    shards named model-0000i-of-0000n.safetensors, the index, config.json,
    generation_config.json) without torch: weights are small random bf16
    values from one pool (seed makes another), norms are ones. Returns the
    tensor bytes."""
    import numpy as np

    dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    pool = ((rng.standard_normal(8 << 20, dtype=np.float32) * 0.02).view(np.uint32) >> 16).astype(np.uint16)
    specs = list(llama_tensors(layers=layers, **shape))
    shards, cur, size = [], [], 0
    for name, sh in specs:
        n = 2 * int(np.prod(sh))
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append((name, sh, n))
        size += n
    shards.append(cur)
    total, weight_map = 0, {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, sh, n in shard:
            header[name] = {"dtype": "BF16", "shape": list(sh), "data_offsets": [off, off + n]}
            off += n
            weight_map[name] = fname
        js = json.dumps(header, separators=(",", ":")).encode()
        js += b" " * (-len(js) % 8)
        with open(dir / fname, "wb") as f:
            f.write(len(js).to_bytes(8, "little") + js)
            for k, (name, sh, n) in enumerate(shard):
                count = n // 2
                if name.endswith("norm.weight"):
                    f.write(np.full(count, 0x3F80, dtype=np.uint16).tobytes())
                    continue
                start = (k * 7919) % len(pool)
                while count:
                    m = min(count, len(pool) - start)
                    f.write(pool[start:start + m].tobytes())
                    count -= m
                    start = 0
        total += off
    (dir / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
    (dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape["hidden"],
        "intermediate_size": shape["inter"], "num_hidden_layers": layers, "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"], "vocab_size": shape["vocab"], "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": shape["tied"],
        "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
        "attention_bias": False, "mlp_bias": False}, indent=2) + "\n")
    (dir / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}, indent=2) + "\n")
    return total


def shard_files(dir: Path):
    return sorted(dir.glob("*.safetensors"))


def same_as_shards(views, dir: Path):
    """Whether views (a tensor's name to its bytes, as numpy uint8 arrays)
    hold exactly the tensors of dir's shards, byte for byte."""
    views = dict(views)
    for p in shard_files(dir):
        raw = p.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        for k, e in json.loads(raw[8:8 + n]).items():
            if k != "__metadata__":
                lo, hi = e["data_offsets"]
                v = views.pop(k, None)
                if v is None or v.tobytes() != raw[8 + n + lo:8 + n + hi]:
                    return False
    return not views


def same_tree(a: Path, b: Path):
    """diff -r where diff exists, filecmp otherwise; returns (equal, how)."""
    if shutil.which("diff"):
        r = subprocess.run(["diff", "-r", str(a), str(b)], capture_output=True, text=True)
        return r.returncode == 0, "diff -r" + (f": {r.stdout[:300]}" if r.returncode else "")
    c = filecmp.dircmp(a, b)
    names = sorted(p.name for p in a.iterdir())
    ok = not c.left_only and not c.right_only and all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)
    return ok, "filecmp"


# ---- part a: a small model, many workers ---------------------------------------------

def part_small(ctx: Ctx):
    if not ctx.gpu:
        say("SKIP", "a", "needs the cuda backend")
        return
    if not (have("torch") and have("transformers")):
        say("SKIP", "a", "needs torch and transformers")
        return
    d = ctx.work / "small"
    shutil.rmtree(d, ignore_errors=True)
    ref = ctx.work / "small-ref.pt"
    r = subprocess.run([sys.executable, "-u", str(HERE), "worker", "--t0", repr(time.time()), "make-small",
                        "--dir", str(d), "--ref", str(ref)], env=ctx.env, capture_output=True, text=True, timeout=300)
    (ctx.out / "make-small.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"making the small model failed; see make-small.log:\n{r.stderr[-2000:]}")
    made = json.loads(r.stdout.strip().splitlines()[-1])
    shards = shard_files(d)
    check(len(shards) >= 3, "a-shards", f"save_pretrained wrote {len(shards)} shards, {made['params'] / 1e6:.1f}M parameters, "
          f"tied embeddings: {made['tied']}")
    ctx.rm("small")
    rc, err, dt = ctx.gpushm("put", "-v", "small", str(d), log="small-put.log")
    if not check(rc == 0, "a-put", f"gpushm put small: exit {rc} in {dt:.2f}s {err.strip()[-300:]}"):
        return
    back = ctx.work / "small-back"
    shutil.rmtree(back, ignore_errors=True)
    rc, err, _ = ctx.gpushm("get", "small", str(back), log="small-put.log")
    eq, how = same_tree(d, back) if rc == 0 else (False, err)
    check(rc == 0 and eq, "a-get", f"gpushm get small DIR, then {how}")

    used0 = gpu_used_mib()
    mem = {}
    gp, mem["gpushm"] = ctx.workers("a-gpushm", 4, ["hf", "gpushm", "--name", "small", "--ref", str(ref), "--check-writes"],
                                    go_after_ready=gpu_used_mib)
    hf, mem["transformers"] = ctx.workers("a-transformers", 4, ["hf", "disk", "--dir", str(d), "--ref", str(ref)],
                                          go_after_ready=gpu_used_mib)
    _worker_table("a: small model, four workers each way", gp, hf, mem, used0, made["bytes"])
    bad = [r for r in gp + hf if "error" in r]
    check(not bad, "a-workers", "all eight workers ran" if not bad else "; ".join(r["error"] for r in bad))
    equal = bool(gp) and all(r.get("logits_equal") for r in gp)
    check(equal, "a-logits", "from_pretrained through gpushm: logits equal the original model's exactly, in each of 4 workers"
          if equal else f"logits differ, max |diff| per worker: {[r.get('logits_maxdiff') for r in gp]}")
    say("INFO", "a-logits-transformers", f"{hf[0].get('how') if hf else 'transformers'}: logits equal the original's: "
        f"{[r.get('logits_equal') for r in hf]}, dtype {hf[0].get('dtype') if hf else '-'}")
    check(bool(gp) and all(r.get("tied") for r in gp), "a-tied",
          f"lm_head.weight is embed_tokens.weight: {[r.get('tied') for r in gp]}")
    check(bool(gp) and all(r.get("params_shared") and r.get("inference") for r in gp), "a-zero-copy",
          f"every parameter lies inside the bundle's mapping, as an inference tensor: "
          f"{[(r.get('params_shared'), r.get('inference')) for r in gp]}")
    w = gp[0].get("inplace_error") if gp else None
    check(bool(w) and "inference" in w, "a-inplace-write", f"param.add_(1) outside inference mode raised: {w!r}")
    say("INFO", "a-inplace-context", f"this process's CUDA context after the refused update: "
        f"{gp[0].get('context_after_inplace') if gp else None}")
    tok = gp[0].get("tokenizer") if gp else None
    say("INFO" if tok is None else ("PASS" if tok.startswith("ok") else "FAIL"), "a-tokenizer",
        f"gpushm.transformers.tokenizer: {tok}")

    # A kernel that writes the read-only weights: its process's CUDA context
    # is lost; every other process's copy stays intact.
    r = subprocess.run([sys.executable, "-u", str(HERE), "worker", "--t0", repr(time.time()), "fault", "--name", "small"],
                       env=ctx.env, capture_output=True, text=True, timeout=180)
    (ctx.out / "fault.log").write_text(r.stdout + r.stderr)
    last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else "{}"
    fault = json.loads(last) if last.startswith("{") else {}
    after, _ = ctx.workers("a-after-fault", 1, ["hf", "gpushm", "--name", "small", "--ref", str(ref)])
    intact = bool(after) and after[0].get("logits_equal")
    check(bool(fault.get("error")) and intact, "a-kernel-write",
          f"a write inside torch.inference_mode() gave {fault.get('error')!r} (exit {r.returncode}); "
          f"a fresh worker then sees the original logits: {intact}")


def _worker_table(title, gp, hf, mem, used0, weight_bytes):
    def row(label, rs, key):
        vals = [r.get(key) for r in rs if r.get(key) is not None]
        if not vals:
            return [label, "-", "-", "-"]
        return [label, fmt_s(min(vals)), fmt_s(statistics.median(vals)), fmt_s(max(vals))]
    table(title, ["per worker", "min", "median", "max"], [
        row("gpushm: attach (state_dict, warm CUDA context)", gp, "attach_s"),
        row("gpushm: from_pretrained (config, model on meta, assign)", gp, "load_s"),
        row("transformers: from_pretrained(dir, device_map=\"cuda\")", hf, "load_s"),
        row("gpushm: process start to first token", gp, "first_token_s"),
        row("transformers: process start to first token", hf, "first_token_s"),
        row("python + torch + transformers import (gpushm workers)", gp, "import_s"),
    ])
    rows = []
    for k in ("gpushm", "transformers"):
        if used0 is not None and mem.get(k) is not None:
            rows.append([k, f"{used0} MiB", f"{mem[k]} MiB", f"{mem[k] - used0} MiB",
                         f"{(mem[k] - used0) * (1 << 20) / weight_bytes:.2f}"])
    if rows:
        table("GPU memory (nvidia-smi, GPU 0) with the four workers alive",
              ["workers", "before (daemon holds the bundle)", "with 4 workers", "increase", "increase / weights"], rows)


# ---- part b: a big checkpoint at line rate -----------------------------------------------

def part_big(ctx: Ctx):
    a = ctx.args
    shape = TINY if a.tiny else BIG
    layers = 2 if a.tiny else a.layers
    d = ctx.work / "big"
    shutil.rmtree(d, ignore_errors=True)
    t = time.perf_counter()
    total = synthesize(d, shape, layers, 40_000 if a.tiny else 5 * 10 ** 9)
    wrote = time.perf_counter() - t
    t = time.perf_counter()
    subprocess.run(["sync"], timeout=600)
    synced = time.perf_counter() - t
    ctx.write_rate = total / (wrote + synced)  # about what the disk takes, to budget cold reads
    shards = shard_files(d)
    size = sum(p.stat().st_size for p in shards)
    fs = subprocess.run(["df", "-T", str(d)], capture_output=True, text=True).stdout.strip().splitlines()[-1:]
    print(f"checkpoint: {len(shards)} shards, {size / GIB:.2f} GiB ({total / GB:.2f} GB of tensors), "
          f"written in {wrote:.1f}s + sync {synced:.1f}s; file system: {' '.join(fs)}", flush=True)

    # Warm the page cache, and see what one reader gets from it.
    t = time.perf_counter()
    for p in shards:
        with open(p, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass
    cat = time.perf_counter() - t
    rows = [["one reader, page cache (read(2), 16 MiB)", fmt_s(cat), f"{size / cat / GB:.2f}", "-"]]

    puts = []
    for i in range(1 if a.tiny else 3):
        ctx.rm("big")
        rc, err, dt = ctx.gpushm("put", "-v", "--readonly-default", "big", str(d), log="big-put.log")
        if rc != 0:
            check(False, "b-put", f"exit {rc}: {err.strip()[-500:]}")
            return
        puts.append(dt)
        rows.append([f"gpushm put, page cache, run {i + 1} (whole command)", fmt_s(dt), f"{size / dt / GB:.2f}", copy_rate(err)])
    best = min(puts)
    # The tuning knobs, once each: copiers (default min(16, CPUs)) and chunk (8 MiB).
    for flag, val in ([] if a.tiny else [("--workers", "8"), ("--workers", "24"), ("--chunk", "4MiB"), ("--chunk", "16MiB")]):
        if not ctx.time_for(f"b-put{flag}={val}", 60):
            break
        ctx.rm("big")
        rc, err, dt = ctx.gpushm("put", "-v", flag, val, "big", str(d), log="big-put.log")
        rows.append([f"gpushm put {flag} {val}", fmt_s(dt) if rc == 0 else f"exit {rc}", f"{size / dt / GB:.2f}", copy_rate(err)])
    st = None
    if ctx.gpu and have("torch") and have("safetensors"):
        r = subprocess.run([sys.executable, "-u", str(HERE), "worker", "--t0", repr(time.time()), "st-load",
                            "--dir", str(d)], env=ctx.env, capture_output=True, text=True, timeout=600)
        (ctx.out / "st-load.log").write_text(r.stdout + r.stderr)
        if r.returncode == 0:
            rep = json.loads(r.stdout.strip().splitlines()[-1])
            st = rep["load_s"]
            rows.append(["safetensors.torch.load_file(device=\"cuda\"), in-process, warm CUDA", fmt_s(st), f"{size / st / GB:.2f}", "-"])
            rows.append(["  the same, whole process", fmt_s(rep["process_s"]), f"{size / rep['process_s'] / GB:.2f}", "-"])
        else:
            say("FAIL", "b-safetensors", f"load_file failed; see st-load.log: {r.stderr[-300:]}")
    table(f"b: {size / GIB:.2f} GiB checkpoint, {len(shards)} shards, from the page cache",
          ["what", "time", "GB/s", "copy alone, GB/s (put -v)"], rows)
    if a.tiny:
        say("INFO", "b-put", f"gpushm put of the {size / GIB * 1024:.2f} MiB checkpoint: {size / best / GB:.3f} GB/s (smallest size)")
        back = ctx.work / "big-back"
        rc, err, _ = ctx.gpushm("get", "big", str(back), log="big-put.log")
        eq, how = same_tree(d, back) if rc == 0 else (False, err)
        check(rc == 0 and eq, "b-get", f"gpushm get big DIR, then {how}")
    else:
        check(size / best / GB >= 20, "b-put-rate", f"gpushm put from the page cache: {size / best / GB:.1f} GB/s (target 20)")
        if st is None:
            say("SKIP", "b-put-vs-safetensors", "needs torch, safetensors and the cuda backend")
        else:
            check(st / best >= 4, "b-put-vs-safetensors", f"{st / best:.1f}x safetensors.torch.load_file (target 4x)")

    # Leave room for the attach comparison, the headline of the part.
    if not a.tiny and ctx.time_for("b-cold", 150 + 4 * size / ctx.write_rate):
        part_cold(ctx, d, shards, size)
    part_attach(ctx, d, size)


def part_cold(ctx, d, shards, size):
    if os.geteuid() != 0 or not drop_caches():
        say("SKIP", "b-cold", "cannot drop the page cache (needs root and a writable /proc/sys/vm/drop_caches)")
        return
    rows = []

    def dd(paths, label):
        drop_caches()
        t = time.perf_counter()
        procs = [subprocess.Popen(["dd", f"if={p}", "of=/dev/null", "bs=16M", "iflag=direct", "status=none"],
                                  stderr=subprocess.PIPE) for p in paths]
        ok = all(p.wait(900) == 0 for p in procs)
        dt = time.perf_counter() - t
        rows.append([label, fmt_s(dt) if ok else "failed", f"{size / dt / GB:.2f}" if ok else "-", "-"])
        return size / dt / GB if ok else 0

    def dd_seq():
        drop_caches()
        t = time.perf_counter()
        ok = all(subprocess.run(["dd", f"if={p}", "of=/dev/null", "bs=16M", "iflag=direct", "status=none"],
                                timeout=900).returncode == 0 for p in shards)
        dt = time.perf_counter() - t
        rows.append(["dd iflag=direct bs=16M, shards one after another", fmt_s(dt) if ok else "failed", f"{size / dt / GB:.2f}", "-"])
        return size / dt / GB if ok else 0

    disk = dd(shards, f"dd iflag=direct bs=16M, {len(shards)} shards at once")
    if ctx.time_for("b-dd-sequential", 120 + 3 * size / max(disk * GB, 1)):
        disk = max(disk, dd_seq())
    ctx.rm("big")
    drop_caches()
    rc, err, dt = ctx.gpushm("put", "-v", "big", str(d), log="big-put.log")
    rows.append(["gpushm put, cold (whole command)", fmt_s(dt) if rc == 0 else f"exit {rc}", f"{size / dt / GB:.2f}", copy_rate(err)])
    if ctx.time_for("b-cold-buffered", 120 + 2 * size / max(disk * GB, 1)):
        ctx.rm("big")
        drop_caches()
        rc2, err2, dt2 = ctx.gpushm("put", "-v", "--direct", "never", "big", str(d), log="big-put.log")
        rows.append(["gpushm put --direct never, cold", fmt_s(dt2) if rc2 == 0 else f"exit {rc2}", f"{size / dt2 / GB:.2f}", copy_rate(err2)])
    table("b: cold reads (after echo 3 > /proc/sys/vm/drop_caches)", ["what", "time", "GB/s", "copy alone, GB/s (put -v)"], rows)
    if rc == 0 and disk:
        check(size / dt / GB >= 0.9 * disk, "b-cold-vs-disk",
              f"cold gpushm put {size / dt / GB:.2f} GB/s = {size / dt / GB / disk:.0%} of dd's best {disk:.2f} GB/s (target 90%)")
    else:
        check(False, "b-cold-vs-disk", f"put exit {rc}, dd {disk:.2f} GB/s")
    # The attach comparison wants the page cache warm again (transformers
    # reads the files), and the bundle loaded.
    for p in shards:
        subprocess.run(["dd", f"if={p}", "of=/dev/null", "bs=16M", "status=none"], timeout=900)
    ctx.rm("big")
    ctx.gpushm("put", "--readonly-default", "big", str(d), log="big-put.log")


def part_attach(ctx, d, size):
    try:
        ctx.client.stat("big")
    except FileNotFoundError:
        rc, err, _ = ctx.gpushm("put", "--readonly-default", "big", str(d), log="big-put.log")
        if rc != 0:
            check(False, "b-attach", f"could not put the checkpoint: {err[-300:]}")
            return
    if not (ctx.gpu and have("torch")):
        # The host backend in CI: the same attach with numpy, no torch.
        rs, _ = ctx.workers("b-numpy", 2, ["np", "numpy", "--name", "big", "--dir", str(d)])
        bad = [r for r in rs if "error" in r or not r.get("ok")]
        table("b: attach with numpy (host backend)", ["worker", "tensors", "attach"],
              [[i, r.get("tensors"), fmt_s(r.get("attach_s"))] for i, r in enumerate(rs)])
        check(not bad, "b-attach", "workers read every tensor, equal to the files" if not bad else str(bad))
        return
    logits = ctx.work / "big-logits"
    logits.mkdir(exist_ok=True)
    used0 = gpu_used_mib()
    mem = {}
    gp, mem["gpushm"] = ctx.workers("b-gpushm", 4, ["hf", "gpushm", "--name", "big", "--save-logits", str(logits / "gpushm")],
                                    go_after_ready=gpu_used_mib, timeout=900)
    if have("transformers") and ctx.time_for("b-transformers", 90):
        hf, mem["transformers"] = ctx.workers("b-transformers", 4, ["hf", "disk", "--dir", str(d), "--save-logits", str(logits / "disk")],
                                              go_after_ready=gpu_used_mib, timeout=900)
    else:
        hf = []
    _worker_table(f"b: {size / GIB:.2f} GiB model, four workers each way", gp, hf, mem, used0, size)
    bad = [r for r in gp + hf if "error" in r]
    check(not bad, "b-workers", "all workers ran" if not bad else "; ".join(r["error"] for r in bad))
    att = [r["attach_s"] for r in gp if r.get("attach_s") is not None]
    if att:
        check(max(att) < 0.05, "b-attach", f"state_dict of {size / GIB:.1f} GiB in {fmt_s(min(att))} to {fmt_s(max(att))} per worker (target 50 ms)")
    mine = [r["load_s"] for r in gp if r.get("load_s")]
    theirs = [r["load_s"] for r in hf if r.get("load_s")]
    if mine and theirs:
        check(statistics.median(theirs) / statistics.median(mine) >= 20, "b-attach-vs-transformers",
              f"from_pretrained {fmt_s(statistics.median(mine))} through gpushm vs {fmt_s(statistics.median(theirs))} "
              f"from disk: {statistics.median(theirs) / statistics.median(mine):.0f}x (target 20x)")
    if used0 is not None and mem.get("gpushm") is not None:
        inc = (mem["gpushm"] - used0) * (1 << 20)
        check(inc < size / 4, "b-one-copy", f"four attached workers add {inc / GIB:.2f} GiB of GPU memory "
              f"for a {size / GIB:.1f} GiB model (under a quarter copy: contexts and activations only)")
    if gp and hf and have("torch"):
        r = subprocess.run([sys.executable, "-c", "import sys, torch; a, b = (torch.load(p) for p in sys.argv[1:]); "
                            "print(torch.equal(a, b), (a.float() - b.float()).abs().max().item())",
                            str(logits / "gpushm-0.pt"), str(logits / "disk-0.pt")], capture_output=True, text=True, timeout=120)
        say("INFO", "b-logits", f"gpushm model vs transformers' own load, same input: equal, max |diff| = {r.stdout.strip() or r.stderr[-200:]}")


# ---- workers ---------------------------------------------------------------------

def worker(argv):
    ap = argparse.ArgumentParser(prog="bench_models.py worker")
    ap.add_argument("--t0", type=float, required=True)
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("mode")
    ap.add_argument("how", nargs="?")
    ap.add_argument("--name")
    ap.add_argument("--dir")
    ap.add_argument("--ref")
    ap.add_argument("--save-logits")
    ap.add_argument("--check-writes", action="store_true")
    a = ap.parse_args(argv)
    {"make-small": w_make_small, "hf": w_hf, "np": w_np, "fault": w_fault, "st-load": w_st_load}[a.mode](a)


def _ready(report):
    print(json.dumps(report), flush=True)
    sys.stdin.readline()


def _input_ids(torch, vocab):
    return (torch.arange(16, dtype=torch.long) * 7919 % vocab).reshape(1, 16)


def w_make_small(a):
    import torch
    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                                      tie_word_embeddings=True)
    torch.set_default_dtype(torch.bfloat16)
    model = transformers.LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.generation_config.pad_token_id = config.eos_token_id
    try:
        model.save_pretrained(a.dir, safe_serialization=True, max_shard_size="20MB")
    except TypeError:  # transformers versions that write nothing but safetensors
        model.save_pretrained(a.dir, max_shard_size="20MB")
    try:  # a word-level tokenizer, made here: nothing from a hub
        import tokenizers
        vocab = {f"w{i}": i for i in range(1000)}
        vocab["[UNK]"] = 1000
        tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
        tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
        transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]").save_pretrained(a.dir)
    except Exception as e:
        print(f"no tokenizer: {e}", file=sys.stderr)
    model.to("cuda")
    with torch.no_grad():
        logits = model(_input_ids(torch, config.vocab_size).cuda()).logits
    torch.save(logits.cpu(), a.ref)
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"params": params, "bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                      "tied": model.lm_head.weight is model.model.embed_tokens.weight}))


def w_hf(a):
    t = time.perf_counter()
    import torch
    import transformers
    import gpushm.torch
    import gpushm.transformers
    import transformers.models.llama.modeling_llama  # noqa: F401  (imported lazily otherwise, inside the timing)
    rep = {"import_s": time.perf_counter() - t}
    torch.zeros(1, device="cuda")  # the CUDA context, which both ways need
    torch.cuda.synchronize()
    if a.how == "gpushm":
        t = time.perf_counter()
        sd = gpushm.torch.state_dict(a.name)
        rep["attach_s"] = time.perf_counter() - t
        rep["tensors"] = len(sd)
        t = time.perf_counter()
        model = gpushm.transformers.from_pretrained(a.name)
        rep["load_s"] = time.perf_counter() - t
        seg = gpushm.torch._client().open(a.name, True)
        lo, hi = seg.ptr, seg.ptr + seg.size
        rep["params_shared"] = all(lo <= p.data_ptr() < hi for p in model.parameters())
        rep["inference"] = all(p.is_inference() for p in model.parameters())
        del sd
    else:
        # transformers 5 renamed torch_dtype to dtype; without "auto" 4.x loads float32.
        kw = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": "auto"}
        t = time.perf_counter()
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(a.dir, device_map="cuda", **kw)
            rep["how"] = 'from_pretrained(dir, device_map="cuda")'
        except (ImportError, ValueError) as e:
            if "accelerate" not in str(e):
                raise
            model = transformers.AutoModelForCausalLM.from_pretrained(a.dir, **kw).to("cuda")
            rep["how"] = 'from_pretrained(dir).to("cuda"): no accelerate for device_map'
        torch.cuda.synchronize()
        rep["load_s"] = time.perf_counter() - t
    rep["dtype"] = str(next(model.parameters()).dtype)
    vocab = model.config.vocab_size
    ids = _input_ids(torch, vocab).to(model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                             pad_token_id=model.config.eos_token_id)
    torch.cuda.synchronize()
    rep["first_token_s"] = time.time() - a.t0
    rep["generated"] = out[0, -1].item()
    with torch.no_grad():
        logits = model(ids).logits
    if a.ref:
        ref = torch.load(a.ref).to(logits.device)
        rep["logits_equal"] = bool(torch.equal(logits, ref))
        rep["logits_maxdiff"] = (logits.float() - ref.float()).abs().max().item()
    if a.save_logits and a.index == 0:
        torch.save(logits.cpu(), f"{a.save_logits}-0.pt")
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    rep["tied"] = head is not None and head.weight is emb
    if a.check_writes and a.how == "gpushm" and a.index == 0:
        try:
            tok = gpushm.transformers.tokenizer(a.name)
            rep["tokenizer"] = f"ok, {type(tok).__name__}, {len(tok)} tokens"
        except Exception as e:
            rep["tokenizer"] = f"{type(e).__name__}: {e}"
        try:
            head.weight.add_(1)
            rep["inplace_error"] = None
        except RuntimeError as e:
            rep["inplace_error"] = str(e).splitlines()[0]
        # Did the refused update reach the GPU (a kernel faulting on the
        # read-only mapping would lose this process's CUDA context)?
        try:
            torch.cuda.synchronize()
            rep["context_after_inplace"] = "usable: " + str(float(torch.ones(4, device=model.device).sum()))
        except Exception as e:
            rep["context_after_inplace"] = f"lost: {type(e).__name__}: {str(e).splitlines()[0]}"
    _ready(rep)
    print(json.dumps({"done": True}), flush=True)


def w_np(a):
    import numpy as np
    c = gpushm.connect()
    t = time.perf_counter()
    b = c.tensors(a.name)  # put with --readonly-default: mapped read-only
    views = {k: np.frombuffer(v.memoryview(), dtype=np.uint8) for k, v in b.items()}
    rep = {"attach_s": time.perf_counter() - t, "tensors": len(views)}
    ok = all(not v.flags.writeable for v in views.values()) and same_as_shards(views, Path(a.dir))
    files = c.files(a.name)
    rep["ok"] = ok and json.loads(files["config.json"])["model_type"] == "llama"
    _ready(rep)
    print(json.dumps({"done": True}), flush=True)


def w_fault(a):
    import torch
    import gpushm.transformers
    model = gpushm.transformers.from_pretrained(a.name)
    w = model.get_input_embeddings().weight
    rep = {}
    try:
        with torch.inference_mode():
            w.add_(1)  # torch allows it here; the GPU's read-only mapping does not
        torch.cuda.synchronize()
        rep["error"] = None
    except Exception as e:
        rep["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    print(json.dumps(rep), flush=True)
    os._exit(0)  # the CUDA context may be unusable: skip its teardown


def w_st_load(a):
    import torch
    import safetensors.torch
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    n = 0
    for p in shard_files(Path(a.dir)):
        sd = safetensors.torch.load_file(str(p), device="cuda")
        n += len(sd)
    torch.cuda.synchronize()
    load = time.perf_counter() - t
    print(json.dumps({"load_s": load, "process_s": time.time() - a.t0, "tensors": n}), flush=True)


# ---- main ------------------------------------------------------------------------

def main():
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        return worker(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpushm", default=os.environ.get("GPUSHM_BIN", str(REPO / ".gpu" / "gpushm")))
    ap.add_argument("--backend", default="cuda", choices=["cuda", "host"])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    ap.add_argument("--work", default=None, help="where checkpoints are written (default: a new directory beside the repository's .gpu)")
    ap.add_argument("--parts", default="a,b")
    ap.add_argument("--layers", type=int, default=35, help="layers of the big Llama-3-8B-shaped checkpoint (35: 16.2 GiB)")
    ap.add_argument("--tiny", action="store_true", help="the smallest size, for CI: part b only, no cold reads")
    ap.add_argument("--budget", type=float, default=360, help="seconds; optional steps are skipped to stay within it")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    made = a.work is None
    if made:
        a.work = tempfile.mkdtemp(prefix="gpushm-models-", dir=str(REPO / ".gpu") if (REPO / ".gpu").is_dir() else None)
    print(f"bench_models: {time.strftime('%Y-%m-%d %H:%M:%S')}, backend {a.backend}, work in {a.work}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    daemon, started = None, {}
    used0 = gpu_used_mib()
    try:
        daemon = testing.Daemon(a.backend, binary=a.gpushm, log=os.path.join(a.out, f"daemon-{a.backend}.log"),
                                new_session=True)
        started = {pid: testing.start_time(pid) for pid in daemon.pids()}
        ctx = Ctx(a, daemon)
        parts = a.parts.split(",")
        if "a" in parts and not a.tiny:
            part("part a: a small model, many workers", part_small, ctx)
        if "b" in parts:
            part("part b: a big checkpoint at line rate", part_big, ctx)
    except Exception as e:
        say("FAIL", "setup", f"{type(e).__name__}: {e}")
    finally:
        # Also when stopped by SIGTERM (the time limit): what ran is reported.
        if daemon is not None:
            daemon.stop()
            leftovers(started, daemon.socket, used0)
        for sub in ("small", "small-back", "big", "big-back", "big-logits", "small-ref.pt"):
            p = Path(a.work) / sub
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        if made:
            shutil.rmtree(a.work, ignore_errors=True)
        print("\n=== summary")
        for v in _verdicts:
            print(v)
        (Path(a.out) / "verdicts.txt").write_text("\n".join(_verdicts) + "\n")
    return 1 if any(v.startswith("FAIL") for v in _verdicts) else 0


if __name__ == "__main__":
    sys.exit(main())
