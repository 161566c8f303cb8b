#!/usr/bin/env python3
"""gpushm.transformers.from_pretrained against transformers' own
from_pretrained, on the same checkpoint directory, in the same run.

    GPUSHM_BIN=.gpu/gpushm PYTHONPATH=python python3 python/bench/bench_pretrained.py --out gpu-out
    python3 python/bench/bench_pretrained.py --smoke      # CI: host backend, a tiny checkpoint

For each size (1.1B: TinyLlama's shapes, 22 layers, 2.05 GiB of bf16; 16G:
Llama-3-8B's shapes, 35 layers, 16.2 GiB) it writes a checkpoint directory
of random weights as save_pretrained lays it out (safetensors shards, the
index, config.json, generation_config.json; nothing from a hub), puts it
with 'gpushm put --readonly-default', reads the shards once so that they
sit in the page cache, and then starts fresh worker processes, one at a
time, alternating:

  gpushm        gpushm.transformers.from_pretrained(name)
  transformers  AutoModelForCausalLM.from_pretrained(dir, device_map="cuda",
                dtype=torch.bfloat16) (torch_dtype= before transformers 5)

Each worker imports torch and transformers (the Llama modeling code, the
Auto classes and GenerationConfig, which transformers imports on first
use) and makes its CUDA context first; only the call is timed. The gpushm worker
also records where the call's time goes (its steps), then builds the model
a second time under a dispatch mode that counts every aten op, to show
that no weight initialisation runs (no normal_, uniform_, fill_, ...). Both
save the logits of one input, which must be equal.

The table: median (and best) of --reps calls each way, and the ratio. At
its end the program stops its daemon and prints the processes it started
that are still alive (none) and the GPU memory in use against what it found
at its start. PASS/FAIL/SKIP/INFO lines; exit 1 if anything failed.

Without torch and transformers (CI's Python) the comparison is skipped
with a message; the rest (daemon, checkpoint, put, a worker reading the
bundle with numpy, the leftover check) still runs. The same file is the
workers' program ('worker' subcommand).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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

GIB = 1 << 30

# name: (shape, layers, target seconds for gpushm's from_pretrained)
SIZES = {
    "1.1B": (dict(hidden=2048, inter=5632, heads=32, kv_heads=4, vocab=32000, tied=False), 22, 0.050),
    "16G": (dict(hidden=4096, inter=14336, heads=32, kv_heads=8, vocab=128256, tied=False), 35, 0.150),
    "tiny": (dict(hidden=64, inter=128, heads=4, kv_heads=2, vocab=256, tied=False), 2, None),
}
# aten ops that draw initial weights: torch.nn.init's and transformers'
# _init_weights' normal_, uniform_, trunc_normal_ (uniform_ + erfinv_),
# kaiming_* and xavier_* come down to these. (fill_ and zero_ are not
# counted: a constructor's torch.ones for a norm's weight may become one.)
INIT_OPS = {"normal_", "uniform_", "random_", "bernoulli_", "exponential_", "log_normal_", "cauchy_", "geometric_",
            "erfinv_"}

import _run  # noqa: E402
from _report import check, say, table  # noqa: E402
from _run import fixed_prompt_logits, fmt_s, have, logits_equal  # noqa: E402


class Run(_run.Run):
    def __init__(self, a):
        super().__init__(a, HERE, "pretrained")
        self.deadline = time.monotonic() + a.budget

    def start_daemon(self):
        super().start_daemon("--log-level", "warn")

    def time_left(self):
        return self.deadline - time.monotonic()


def make_checkpoint(run, label):
    """Writes the checkpoint (bench_models.synthesize: bf16 shards of small
    random values, as save_pretrained names them), puts it, and warms the
    page cache. Returns (dir, bundle name, tensor bytes)."""
    from bench_models import shard_files, synthesize

    shape, layers, _ = SIZES[label]
    d = run.work / f"ckpt-{label}"
    shutil.rmtree(d, ignore_errors=True)
    t = time.perf_counter()
    size = synthesize(d, shape, layers, 5 * 10 ** 9)
    made = time.perf_counter() - t
    name = f"pretrained-{label}"
    rc, out, took = run.gpushm("put", "--readonly-default", name, str(d))
    if rc != 0:
        raise RuntimeError(f"gpushm put {name} {d}: exit {rc}: {out[-500:]}")
    # The same checkpoint put as docs/engines.md and the README put it
    # (read-write bundle): from_pretrained maps it read-only all the same.
    rc, out, _ = run.gpushm("put", name + "-rw", str(d))
    if rc != 0:
        raise RuntimeError(f"gpushm put {name}-rw {d}: exit {rc}: {out[-500:]}")
    for p in shard_files(d):  # transformers reads these from the page cache
        with open(p, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass
    say("INFO", f"{label}-checkpoint", f"{size / GIB:.2f} GiB in {len(shard_files(d))} shards written in {made:.1f} s, "
        f"'gpushm put' {took:.2f} s ({size / took / 1e9:.1f} GB/s, the whole command)")
    return d, name, size


def compare_size(run, label, torch_ok):
    d, name, size = make_checkpoint(run, label)
    try:
        return _compare(run, label, torch_ok, d, name, size)
    finally:
        try:
            run.client.unlink(name + "-rw")
        except OSError:
            pass


def _compare(run, label, torch_ok, d, name, size):
    if not torch_ok:
        r = run.worker(f"{label}-numpy", "numpy", "--name", name, "--dir", str(d))
        check(r.get("ok") is True, f"{label}-bundle", "a fresh worker reads every tensor of the bundle, equal to the "
              f"shards, and its config.json: {r.get('error') or 'ok'}")
        return None
    logits = run.work / f"logits-{label}"
    logits.mkdir(exist_ok=True)
    mine, theirs, steps, rows = [], [], [], None
    rw, rw_steps = [], []
    for i in range(run.a.reps):
        if i > 0 and run.time_left() < 60:
            say("INFO", f"{label}-reps", f"{i} of {run.a.reps} rounds: {run.time_left():.0f} s of the budget left")
            break
        r = run.worker(f"{label}-gpushm-rw-{i}", "gpushm", "--name", name + "-rw", "--index", str(i))
        if "error" in r:
            check(False, f"{label}-gpushm-rw", r["error"])
        else:
            rw.append(r["load_s"])
            rw_steps.append(r.get("steps", []))
        r = run.worker(f"{label}-gpushm-{i}", "gpushm", "--name", name, "--index", str(i),
                       "--logits", str(logits / "gpushm.pt"), *(["--count-ops"] if i == 0 else []))
        if "error" in r:
            check(False, f"{label}-gpushm", r["error"])
        else:
            mine.append(r["load_s"])
            steps.append(r.get("steps", []))
            if i == 0:
                check(r.get("shared") is True and r.get("inference") is True, f"{label}-shared",
                      f"every parameter lies in the bundle's mapping ({r.get('shared')}) and is an inference tensor "
                      f"({r.get('inference')}); {r.get('params')} parameters")
                ops = r.get("ops", {})
                init = {k: v for k, v in ops.items() if k in INIT_OPS}
                check(not init, f"{label}-no-init", f"a second from_pretrained in the same worker dispatched "
                      f"{sum(ops.values())} aten ops ({_top(ops)}); weight initialisation among them: {init or 'none'}")
        r = run.worker(f"{label}-transformers-{i}", "transformers", "--dir", str(d), "--index", str(i),
                       "--logits", str(logits / "transformers.pt"))
        if "error" in r:
            check(False, f"{label}-transformers", r["error"])
        else:
            theirs.append(r["load_s"])
            run.how = r.get("how")
    if not mine:
        return None
    m = statistics.median(mine)
    target = SIZES[label][2]
    t = statistics.median(theirs) if theirs else None
    if target is not None and not run.a.smoke:
        check(m <= target, f"{label}-from_pretrained",
              f"gpushm.transformers.from_pretrained of {size / GIB:.2f} GiB in a fresh process after imports: "
              f"{fmt_s(m)} median of {len(mine)} (best {fmt_s(min(mine))}; target {fmt_s(target)}); "
              f"transformers' own {fmt_s(t)}")
    eq = logits_equal(logits / "gpushm.pt", logits / "transformers.pt")
    check(eq is True, f"{label}-logits", f"gpushm's model and transformers' own load give equal logits: {eq}")
    # Where the time goes: each step's median over the calls, both bundles.
    names = [s for s, _ in steps[0]] if steps and steps[0] else []

    def per(sts, s):
        return fmt_s(statistics.median(dict(st).get(s, 0.0) for st in sts)) if sts else "-"

    m_rw = statistics.median(rw) if rw else None
    table(f"{label}: gpushm.transformers.from_pretrained, step by step (median of {len(steps)})",
          ["step", "read-only bundle (put --readonly-default)", "read-write bundle (put)"],
          [[s, per(steps, s), per(rw_steps, s)] for s in names] + [["the whole call", fmt_s(m), fmt_s(m_rw)]])
    return [label, f"{size / GIB:.2f} GiB", f"{fmt_s(m)} (best {fmt_s(min(mine))})",
            f"{fmt_s(m_rw)} (best {fmt_s(min(rw))})" if rw else "-",
            f"{fmt_s(t)} (best {fmt_s(min(theirs))})" if theirs else "-", f"{t / m:.1f}x" if theirs else "-"]


def _top(ops, n=6):
    return ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:n]) or "none"


def gpu_memory(torch_ok):
    """MiB in use on each GPU: nvidia-smi, else torch in a fresh process."""
    used = testing.gpu_memory_used()
    if used is None and torch_ok:
        r = subprocess.run([sys.executable, "-c", "import torch\nfor i in range(torch.cuda.device_count()):\n"
                            "    f, t = torch.cuda.mem_get_info(i); print((t - f) >> 20)"],
                           capture_output=True, text=True, timeout=120)
        used = [int(x) for x in r.stdout.split()] if r.returncode == 0 and r.stdout.strip() else None
    return used


# ---- workers ---------------------------------------------------------------------

def worker(argv):
    ap = argparse.ArgumentParser(prog="bench_pretrained.py worker")
    ap.add_argument("how", choices=["gpushm", "transformers", "numpy"])
    ap.add_argument("--name")
    ap.add_argument("--dir")
    ap.add_argument("--index", type=int, default=0)
    ap.add_argument("--logits")
    ap.add_argument("--count-ops", action="store_true")
    a = ap.parse_args(argv)
    rep = {"numpy": w_numpy, "gpushm": w_model, "transformers": w_model}[a.how](a)
    print(json.dumps(rep), flush=True)


def w_model(a):
    t = time.perf_counter()
    import torch
    import transformers
    import transformers.models.llama.modeling_llama  # noqa: F401  (imported lazily otherwise, inside the timing)
    import gpushm.torch
    import gpushm.transformers
    # transformers imports these on first use: both ways use them, and a
    # program using either has imported them before it loads a model.
    for cls in ("AutoConfig", "AutoModelForCausalLM", "GenerationConfig"):
        getattr(transformers, cls)
    rep = {"import_s": time.perf_counter() - t}
    cuda = torch.cuda.is_available() and os.environ.get("GPUSHM_BENCH_BACKEND", "cuda") == "cuda"
    if cuda:
        torch.zeros(1, device="cuda")  # the CUDA context, which both ways need
        torch.cuda.synchronize()
    if a.how == "gpushm":
        gpushm.transformers._steps = steps = []
        t = time.perf_counter()
        model = gpushm.transformers.from_pretrained(a.name)
        rep["load_s"] = time.perf_counter() - t
        gpushm.transformers._steps = None
        rep["steps"] = steps
        seg = gpushm.torch._client().open(a.name, True)
        lo, hi = seg.ptr, seg.ptr + seg.size
        rep["shared"] = all(lo <= p.data_ptr() < hi for p in model.parameters())
        rep["inference"] = all(p.is_inference() for p in model.parameters())
        rep["params"] = sum(1 for _ in model.parameters())
    else:
        major = int(transformers.__version__.split(".")[0])
        kw = {"dtype" if major >= 5 else "torch_dtype": torch.bfloat16}
        if cuda:
            kw["device_map"] = "cuda"
        t = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_pretrained(a.dir, **kw)
        if cuda:
            torch.cuda.synchronize()
        rep["load_s"] = time.perf_counter() - t
        rep["how"] = f"AutoModelForCausalLM.from_pretrained(dir, {', '.join(f'{k}={v}' for k, v in kw.items())})"
    logits = fixed_prompt_logits(torch, model)
    if a.logits and a.index == 0:
        torch.save(logits.cpu(), a.logits)
    if a.count_ops:
        # Read-write, so that no inference mode meets the dispatch mode: how
        # the model is built (where initialisation would run) is the same.
        rep["ops"] = count_ops(torch, lambda: gpushm.transformers.from_pretrained(a.name, readonly=False))
    return rep


def count_ops(torch, fn):
    """The aten ops fn dispatches, by name, meta tensors' included."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.ops[name] = self.ops.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    with Count() as c:
        fn()
    return c.ops


def w_numpy(a):
    """The bundle through numpy in a fresh process (host backend, no torch):
    every tensor equal to the shards' bytes, and the config among its
    files."""
    import numpy as np

    from bench_models import same_as_shards

    c = gpushm.connect()
    t = time.perf_counter()
    b = c.tensors(a.name)
    views = {k: np.frombuffer(v.memoryview(), dtype=np.uint8) for k, v in b.items()}
    files = b.files(lambda n: n.endswith(".json"))
    rep = {"attach_s": time.perf_counter() - t, "tensors": len(views)}
    ok = all(not v.flags.writeable for v in views.values()) and same_as_shards(views, Path(a.dir))
    rep["ok"] = ok and json.loads(files["config.json"])["model_type"] == "llama"
    return rep


# ---- main ------------------------------------------------------------------------

def main():
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        return worker(sys.argv[2:])
    ap = _run.parser(__doc__)
    ap.add_argument("--sizes", default="1.1B,16G", help=f"comma-separated, of {', '.join(SIZES)}")
    ap.add_argument("--reps", type=int, default=3, help="fresh workers each way per size")
    ap.add_argument("--budget", type=float, default=210, help="seconds; later rounds are skipped to stay within it")
    ap.add_argument("--smoke", action="store_true", help="CI: --backend host --sizes tiny --reps 1")
    a, sizes = _run.sized_args(ap, SIZES)
    made = a.work is None
    if made:
        a.work = tempfile.mkdtemp(prefix="gpushm-pretrained-", dir=str(REPO / ".gpu") if (REPO / ".gpu").is_dir() else None)
    os.environ["GPUSHM_BENCH_BACKEND"] = a.backend
    missing = have("torch", "transformers", "safetensors")
    torch_ok = not missing
    if torch_ok and a.backend == "cuda":
        import torch
        if not torch.cuda.is_available():
            torch_ok, missing = False, ["a CUDA device for torch"]
    print(f"bench_pretrained: {time.strftime('%Y-%m-%d %H:%M:%S')}, backend {a.backend}, sizes {', '.join(sizes)}, "
          f"{a.reps} rounds; python {platform.python_version()}"
          + ("".join(f", {m} {__import__(m).__version__}" for m in ("torch", "transformers")) if torch_ok else ""),
          flush=True)
    print("command: python3 " + " ".join(sys.argv), flush=True)
    if not torch_ok:
        say("SKIP", "from_pretrained", "needs " + ", ".join(missing) + ": the comparison with transformers is skipped; "
            "the daemon, the checkpoint, its put, a numpy worker and the leftover check still run")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    used0 = gpu_memory(torch_ok) if a.backend == "cuda" else None
    run = Run(a)
    try:
        run.start_daemon()
        rows = [r for r in run.per_size(sizes, lambda label: compare_size(run, label, torch_ok)) if r]
        if rows:
            table(f"from_pretrained in a fresh process after imports, one process at a time (median of {a.reps}); "
                  f"transformers: {getattr(run, 'how', '-')}, its files in the page cache",
                  ["model", "weights", "gpushm.transformers.from_pretrained (put --readonly-default)",
                   "the same, bundle put read-write", "transformers' own", "ratio"], rows)
    except Exception as e:
        check(False, "setup", f"{type(e).__name__}: {e}")
    finally:
        # Also when stopped by SIGTERM (a time limit): what ran is reported.
        status = run.finish(used0, lambda: gpu_memory(torch_ok), made)
    return status


if __name__ == "__main__":
    sys.exit(main())
