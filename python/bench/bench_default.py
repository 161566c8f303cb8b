#!/usr/bin/env python3
"""The default of python -m gpushm.run against not using gpushm, for every
loader python/tests/gpu/gpu_loaders.py checks, on the same checkpoint, in the
same run.

    GPUSHM_BIN=.gpu/gpushm PYTHONPATH=python python3 python/bench/bench_default.py --out gpu-out/default
    python3 python/bench/bench_default.py --smoke      # CI: host backend, a tiny checkpoint, numpy

For each size (2G: TinyLlama-1.1B's shapes, 2.05 GiB of bf16; 16G:
Llama-3-8B's shapes, 16.2 GiB in four shards; bench_loaders.SIZES) it
writes a checkpoint directory as save_pretrained lays it out and a LoRA
adapter for it (q_proj and v_proj, rank 4), puts both with 'gpushm put
NAME DIR', and reads the files once so that they sit in the page cache.
Then each loader runs in a fresh process, started by the command line a
user types, in three ways, alternating, every round:

  plain     python3 bench_default.py worker LOADER ...
  default   python3 -m gpushm.run python3 bench_default.py worker LOADER ...
            (README.md and docs/engines.md give this command line)
  gpu       python3 -m gpushm.run --cpu-tensors=gpu python3 bench_default.py ...

The loaders (each worker imports what it uses and makes its CUDA context
before its timer; only the load is timed):

  transformers  AutoModelForCausalLM.from_pretrained(dir, device_map="cuda",
                dtype=torch.bfloat16)
  accelerate    load_checkpoint_and_dispatch(model made under
                init_empty_weights, dir, device_map={"": 0})
  peft          from_pretrained as above, then PeftModel.from_pretrained(
                model, adapter dir)
  vllm          vLLM's loop (_engine_loops.load_into, loaded as
                vllm.model_executor.model_loader.weight_utils, the engine's
                own module name) into TP=2 halves, rank 0 then rank 1, into
                parameters preallocated before the timer
  sglang        SGLang's loop the same way (as
                sglang.srt.model_loader.weight_utils)

The engines cannot be installed here: their loops stand in for them, under
the module names gpushm's default recognises them by. Every model loader
saves the logits of one input, which must be equal every way; the engine
loops report a digest of each rank's parameters, equal every way.

Targets (FAIL lines): the default at least as fast as plain (ratio >= 1.0,
medians) for every loader at every size; at 16G, transformers and vllm at
least 3x. The table gives each loader's medians and ratios; OUT/default.json
has every figure.

--smoke (CI, no torch, no GPU): the host backend, a tiny float32
checkpoint, the vllm and sglang loops with framework="np" plain and under
the default (the stand-in safetensors library where the real one is
missing); checks the digests and that the default served every open.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(HERE.parent))

import _run  # noqa: E402
import bench_loaders as bl  # noqa: E402
from _report import check, say, table  # noqa: E402
from _run import fixed_prompt_logits, fmt_s, logits_equal  # noqa: E402

GIB = 1 << 30
MODES = {"plain": None, "default": [], "gpu": ["--cpu-tensors=gpu"]}
LOADERS = ("transformers", "accelerate", "peft", "vllm", "sglang")
TARGET_SIZE, FAST = "16G", {"transformers": 3.0, "vllm": 3.0}


class Run(bl.Run):
    def __init__(self, a):
        _run.Run.__init__(self, a, HERE, "default")
        self.deadline = time.monotonic() + a.budget
        self.extra_path = []

    def command(self, mode, *argv):
        """The command line of a worker run plain or under gpushm.run."""
        me = [sys.executable, "-u", self.program, "worker", *argv]
        if MODES[mode] is None:
            return me
        return [sys.executable, "-m", "gpushm.run", *MODES[mode], *me]

    def run_mode(self, label, mode, *argv, timeout=900):
        env = self.env_for("plain")  # gpushm.run, when the command has it, sets the rest
        with open(self.out / f"{self.prefix}-{label}.log", "w") as log:
            p = subprocess.Popen(self.command(mode, *argv), env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        self.started[p.pid] = _run.testing.start_time(p.pid)
        return self.collect(p, label, timeout)


def write_adapter(d: Path, shape, layers, rank=4):
    """A LoRA adapter for the checkpoint's q_proj and v_proj, as peft's
    save_pretrained writes it (adapter_config.json, adapter_model.safetensors),
    with small random float32 weights."""
    import numpy as np

    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    hidden, kv = shape["hidden"], shape["kv_heads"] * (shape["hidden"] // shape["heads"])
    ts = {}
    for i in range(layers):
        for proj, out in (("q_proj", hidden), ("v_proj", kv)):
            pre = f"base_model.model.model.layers.{i}.self_attn.{proj}"
            ts[f"{pre}.lora_A.weight"] = (rng.standard_normal((rank, hidden)) * 0.02).astype(np.float32)
            ts[f"{pre}.lora_B.weight"] = (rng.standard_normal((out, rank)) * 0.02).astype(np.float32)
    bl._write_st(d / "adapter_model.safetensors", ts, {"format": "pt"})
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "inference_mode": True, "base_model_name_or_path": None, "modules_to_save": None}))


def _median(xs):
    return statistics.median(xs) if xs else None


def compare_size(run, label, torch_ok, figures):
    a = run.a
    fw = "np" if a.backend == "host" else "pt"
    d, name, size, files = bl.make_checkpoint(run, label, fw)
    shape, layers = bl.SIZES[label]
    loaders = LOADERS if torch_ok and fw == "pt" else ("vllm", "sglang")
    adapter = run.work / f"adapter-{label}"
    if "peft" in loaders:
        write_adapter(adapter, shape, layers)
        rc, out, _ = run.gpushm("put", f"{name}-adapter", str(adapter))
        if rc != 0:
            raise RuntimeError(f"gpushm put {name}-adapter: exit {rc}: {out[-500:]}")
        with open(adapter / "adapter_model.safetensors", "rb") as f:
            f.read()
    modes = list(MODES) if fw == "pt" else ["plain", "default"]
    times = {ld: {m: [] for m in modes} for ld in loaders}
    reports = {ld: {m: [] for m in modes} for ld in loaders}
    figures["sizes"][label] = {"bytes": size, "shards": len(files), "seconds": times}
    logits = run.work / f"logits-{label}"
    logits.mkdir(exist_ok=True)
    for i in run.rounds(label):
        order = modes if i % 2 == 0 else modes[::-1]
        for ld in loaders:
            for mode in order:
                r = run.run_mode(f"{label}-{ld}-{mode}-{i}", mode, ld, "--dir", str(d), "--adapter", str(adapter),
                                 "--framework", fw, "--logits", str(logits / f"{ld}-{mode}.pt") if i == 0 else "")
                if "error" in r:
                    check(False, f"{label}-{ld}-{mode}", r["error"])
                    continue
                times[ld][mode].append(r["load_s"])
                reports[ld][mode].append(r)
                if "device" in r:
                    figures.setdefault("device", r["device"])

    rows, target = [], label == TARGET_SIZE
    for ld in loaders:
        rs = reports[ld]
        # The same result every way.
        if ld in ("vllm", "sglang"):
            ds = {tuple(r["digests"]) for m in modes for r in rs[m]}
            check(len(ds) == 1, f"{label}-{ld}-same", f"each rank's parameters equal every way (digests {sorted(ds)})")
        else:
            eqs = {m: logits_equal(logits / f"{ld}-{m}.pt", logits / f"{ld}-plain.pt") for m in modes if m != "plain"}
            check(all(v is True for v in eqs.values()), f"{label}-{ld}-same",
                  "logits equal to plain: " + ", ".join(f"{m} {v}" for m, v in eqs.items()))
        served = {m: [f"{r['served']}/{r['opens']}" for r in rs[m]] for m in modes}
        detail = "opens served from a bundle (of the opens the hook saw): " + "; ".join(
            f"{m} {', '.join(v)}" for m, v in served.items())
        if ld == "accelerate":  # its first open reads keys on the CPU: the library's, by design
            say("INFO", f"{label}-{ld}-served", detail)
        else:
            check(all(0 < r["served"] == r["opens"] for m in modes[1:] for r in rs[m]) and rs[modes[1]],
                  f"{label}-{ld}-served", detail)
        p = _median(times[ld]["plain"])
        row = [ld, fmt_s(p)]
        for m in modes[1:]:
            g = _median(times[ld][m])
            ratio = p / g if p and g else None
            row += [fmt_s(g), f"{ratio:.2f}x" if ratio else "-"]
            figures["sizes"][label].setdefault("ratios", {}).setdefault(ld, {})[m] = ratio
            if m == "default" and ratio is not None:
                want = FAST.get(ld, 1.0) if target else 1.0
                (check if fw == "pt" else lambda ok, n, dd: say("INFO", n, dd))(
                    ratio >= want, f"{label}-{ld}-default",
                    f"python -m gpushm.run (default) {fmt_s(g)} against plain {fmt_s(p)}: {ratio:.2f}x "
                    f"(medians of {len(times[ld][m])} and {len(times[ld]['plain'])}; target {want:.1f}x)")
        rows.append(row)
    heads = ["loader", "plain (page cache)"]
    for m in modes[1:]:
        heads += ["gpushm.run" + (" " + " ".join(MODES[m]) if MODES[m] else " (default)"), "ratio"]
    table(f"{label} ({size / GIB:.2f} GiB): each loader in a fresh process after its imports and CUDA context, "
          f"median of {a.reps} (the load only)", heads, rows)
    for n in (name, f"{name}-adapter"):
        try:
            run.client.unlink(n)
        except OSError:
            pass
    return [[label] + r for r in rows]


# ---- workers ---------------------------------------------------------------------

def worker(argv):
    ap = argparse.ArgumentParser(prog="bench_default.py worker")
    ap.add_argument("loader", choices=LOADERS)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--framework", default="pt", choices=["pt", "np"])
    ap.add_argument("--logits", default="")
    a = ap.parse_args(argv)
    t = time.perf_counter()
    torch = None
    if a.framework == "pt":
        import torch
        import safetensors.torch  # noqa: F401
    import numpy  # noqa: F401
    import safetensors
    if a.loader in ("transformers", "accelerate", "peft"):
        import transformers as tf
        import transformers.models.llama.modeling_llama  # noqa: F401  (imported lazily otherwise)
        for cls in ("AutoConfig", "AutoModelForCausalLM", "GenerationConfig"):
            getattr(tf, cls)
        if a.loader == "accelerate":
            import accelerate  # noqa: F401
        if a.loader == "peft":
            import peft  # noqa: F401
    rep = {"import_s": time.perf_counter() - t, "opens": 0, "served": 0}
    hooked = getattr(safetensors.safe_open, "_gpushm_real", None) is not None
    if hooked:
        _run.count_hook_opens(rep)
    if torch is not None:
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        rep["device"] = torch.cuda.get_device_name(0)
    rep.update(LOAD[a.loader](a, torch, safetensors))
    print(json.dumps(rep), flush=True)


def _model_load(a, torch, safetensors):
    import transformers

    t = time.perf_counter()
    if a.loader == "accelerate":
        import accelerate

        cfg = transformers.AutoConfig.from_pretrained(a.dir)
        with accelerate.init_empty_weights():
            m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        m = accelerate.load_checkpoint_and_dispatch(m, a.dir, device_map={"": 0}, dtype=torch.bfloat16)
        m.tie_weights()
    else:
        m = transformers.AutoModelForCausalLM.from_pretrained(a.dir, device_map="cuda", dtype=torch.bfloat16)
        if a.loader == "peft":
            import peft

            m = peft.PeftModel.from_pretrained(m, a.adapter)
    torch.cuda.synchronize()
    took = time.perf_counter() - t
    if a.logits:
        torch.save(fixed_prompt_logits(torch, m).cpu(), a.logits)
    return {"load_s": took}


def _engine_load(a, torch, safetensors):
    """vLLM's or SGLang's loop into TP=2 halves, both ranks on this GPU."""
    import numpy as np

    import _engine_loops

    loops = _engine_loops.as_engine(a.loader)
    load = loops.load_into if a.loader == "vllm" else loops.sglang_load_into
    files = [str(p) for p in sorted(Path(a.dir).glob("*.safetensors"))]
    headers = bl.parse_headers(files)
    took, digests = 0.0, []
    for rank in range(bl.TP):
        if torch is not None:
            params = {k: torch.empty(bl.part_shape(k, sh), dtype=getattr(torch, bl._PT[dt]), device="cuda")
                      for k, (dt, sh) in headers.items()}
            torch.cuda.synchronize()
        else:
            params = {k: np.empty(bl.part_shape(k, sh), dtype=bl._NP[dt]) for k, (dt, sh) in headers.items()}
        t = time.perf_counter()
        loaded = load(params, files, rank, bl.TP, safe_open=safetensors.safe_open, framework=a.framework)
        if torch is not None:
            torch.cuda.synchronize()
        took += time.perf_counter() - t
        if loaded != set(params):
            raise RuntimeError(f"rank {rank}: loaded {len(loaded)} of {len(params)} parameters")
        digests.append(bl.digest_pt(torch, params) if torch is not None else bl.digest_np(params))
        del params
    return {"load_s": took, "digests": digests}


LOAD = {"transformers": _model_load, "accelerate": _model_load, "peft": _model_load,
        "vllm": _engine_load, "sglang": _engine_load}


# ---- main ------------------------------------------------------------------------

def main():
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        return worker(sys.argv[2:])

    def summarize(rows, sizes, a):
        if rows and len(sizes) > 1:
            table("every size", ["size"] + ["loader", "plain", "default", "ratio", "gpu", "ratio"][:len(rows[0]) - 1],
                  rows)

    return bl.bench_main("default", __doc__, 540, ("torch", "safetensors", "transformers", "accelerate", "peft"), Run,
                         compare_size, summarize)


if __name__ == "__main__":
    sys.exit(main())
