#!/usr/bin/env python3
"""Loaders that read safetensors, unchanged, under python -m gpushm.run, on
a cuda daemon: each runs in a fresh process once reading from disk and once
under the hook, and their outputs must be equal.

    GPUSHM_BIN=.gpu/gpushm PYTHONPATH=python python3 python/tests/gpu/gpu_loaders.py

- transformers from_pretrained(dir, device_map="cuda") (its loader asks
  for CPU tensors): by default private GPU copies, under --cpu-tensors=gpu
  views of the bundle, under --cpu-tensors=copy CPU copies, logits equal
  every way; from_pretrained(dir) onto the CPU, read from disk by default;
- accelerate load_checkpoint_and_dispatch, peft PeftModel.from_pretrained
  of an adapter put on its own;
- vLLM's and SGLang's loops (python/bench/_engine_loops.py, loaded under
  the engines' module names) into tensor-parallel halves, by default and
  under --cpu-tensors=gpu;
- shared weights that a model writes: a BatchNorm model trained a step
  (its running statistics are private copies) and one that rescales a
  weight after loading (a Python error, no fault); the bundle is unchanged
  and another worker holding it keeps its outputs.

Prints PASS/FAIL lines; exits 1 if any failed. The same file is the
workers' program ('worker KIND ...').
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[3]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "python" / "bench"))

failed = []


def check(ok, name, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        failed.append(name)


# ---- workers -----------------------------------------------------------------

# Opens the hook saw and served from a bundle, in a worker under it
# (_run.count_hook_opens).
SERVED = {"opens": 0, "served": 0}


def _shared(t):
    """Whether t is a view of a bundle: gpushm.safetensors.shared, in a
    worker under the hook; False in one reading from disk."""
    mod = sys.modules.get("gpushm.safetensors")
    return bool(mod is not None and mod.shared(t))


def _llama_input(torch):
    return torch.arange(24, device="cuda").reshape(1, 24) % 200


def w_tf(out, ck):
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(ck, device_map="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        logits = m(_llama_input(torch)).logits
    torch.save({"logits": logits.cpu(), "inference": sum(_shared(p) for p in m.parameters()),
                "params": len(list(m.parameters())), **SERVED}, out)


def w_tf_cpu(out, ck):
    """from_pretrained without a device_map: a CPU model, whose tensors
    gpushm's default leaves to the library (from disk)."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.bfloat16)
    devices = sorted({p.device.type for p in m.parameters()})
    with torch.no_grad():
        logits = m(_llama_input(torch).cpu()).logits
    torch.save({"logits": logits, "devices": devices, "inference": sum(_shared(p) for p in m.parameters()), **SERVED},
               out)


def w_acc(out, ck):
    import accelerate
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(ck)
    with accelerate.init_empty_weights():
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    m = accelerate.load_checkpoint_and_dispatch(m, ck, device_map={"": 0}, dtype=torch.bfloat16)
    m.tie_weights()
    with torch.no_grad():
        logits = m(_llama_input(torch)).logits
    torch.save({"logits": logits.cpu(), "inference": sum(_shared(p) for p in m.parameters()), **SERVED}, out)


def w_peft(out, ck, adapter):
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(ck, device_map="cuda", dtype=torch.bfloat16)
    m = peft.PeftModel.from_pretrained(base, adapter)
    with torch.no_grad():
        logits = m(_llama_input(torch)).logits
    torch.save({"logits": logits.cpu(), **SERVED}, out)


def w_engine(out, ck, engine):
    import torch
    from safetensors import safe_open  # under the hook: the wrapped one

    import _engine_loops

    loops = _engine_loops.as_engine(engine)  # under the engine's module name, as gpushm's "auto" sees it
    files = sorted(str(p) for p in Path(ck).glob("*.safetensors"))
    got = {}
    shapes = {}
    for fn in files:
        # From the header, not safe_open: an open from here is no engine's,
        # and the default mode rightly leaves it to the library (counted,
        # it would be an open not served).
        with open(fn, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            for k, v in json.loads(f.read(n)).items():
                if k != "__metadata__":
                    shapes[k] = list(v["shape"])
    for rank in (0, 1):
        params = {}
        for k, shape in shapes.items():
            dim = loops.llama_shard_dim(k)
            if dim is not None and dim < len(shape):
                shape = shape[:dim] + [shape[dim] // 2] + shape[dim + 1:]
            params[k] = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        load = loops.load_into if engine == "vllm" else loops.sglang_load_into
        load(params, files, rank, 2, safe_open=safe_open)
        for k, v in params.items():
            got[f"{rank}/{k}"] = v.cpu()
    torch.save({**got, **SERVED}, out)


def _bn_model(torch):
    nn = torch.nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(16, 32)
            self.bn = nn.BatchNorm1d(32)
            self.fc = nn.Linear(32, 4)
            self.register_buffer("out_scale", torch.ones(()))

        def forward(self, x):
            return self.fc(torch.relu(self.bn(self.fc1(x)))) * self.out_scale

    return Net()


def w_bn(out, path, ready=None):
    """Loads the BatchNorm model from path with load_file, then: eval
    output; a train-mode step (running statistics updated); a rescale of
    a weight, which must raise; eval output again. With ready, it is the
    other worker: eval output, then waits for a line on stdin, eval
    output again."""
    import torch
    from safetensors.torch import load_file

    x = torch.linspace(-1, 1, 8 * 16, device="cuda").reshape(8, 16)
    with torch.device("meta"):
        m = _bn_model(torch)
    sd = load_file(path, device="cuda:0")
    m.load_state_dict(sd, assign=True)
    m.eval()
    res = {}
    step = lambda what: print(f"step: {what}", file=sys.stderr, flush=True)  # noqa: E731
    step("eval forward")
    with torch.no_grad():
        res["before"] = m(x).cpu()
    if ready:
        print("ready", flush=True)
        sys.stdin.readline()
        with torch.no_grad():
            res["after"] = m(x).cpu()
        torch.save(res, out)
        return
    res["shared_weight"] = _shared(m.fc.weight)
    res["private_stats"] = not _shared(m.bn.running_mean) and not _shared(m.out_scale)
    m.train()
    mean0 = m.bn.running_mean.clone()
    step("train forward")
    with torch.no_grad():
        m(x)
    torch.cuda.synchronize()
    res["stats_moved"] = not torch.equal(m.bn.running_mean, mean0)
    step("rescale")
    # A scale the program rescales after loading: a private copy (its name
    # says so), so the write stays in this process.
    with torch.no_grad():
        m.out_scale.mul_(2.0)
    torch.cuda.synchronize()
    res["rescaled_scale"] = m.out_scale.item()
    # A write to a shared weight, where torch checks (grad mode on): it
    # must raise before any kernel runs. (Under no_grad torch checks
    # nothing: docs/python.md says so.)
    try:
        m.fc.weight.mul_(2.0)
        torch.cuda.synchronize()
        res["rescale"] = "allowed"
    except RuntimeError as e:
        res["rescale"] = f"raised: {str(e).splitlines()[0][:100]}"
    step("eval forward again")
    m.eval()
    with torch.no_grad():
        res["after"] = m(x).cpu()
    torch.cuda.synchronize()
    torch.save(res, out)


def w_unchanged(out, path, socket):
    import torch
    from safetensors.torch import load_file

    import gpushm
    from gpushm import safetensors as gst

    want = load_file(path)
    c = gpushm.connect(socket)
    with gst.safe_open("bn", framework="pt", device="cuda:0", client=c) as f:
        equal = all(torch.equal(f.get_tensor(k).cpu(), v) for k, v in want.items())
    c.close()
    torch.save({"equal": equal}, out)


WORKERS = {"unchanged": w_unchanged, "tf": w_tf, "tfcpu": w_tf_cpu, "acc": w_acc, "peft": w_peft, "engine": w_engine, "bn": w_bn}


# ---- the run -----------------------------------------------------------------

def main():
    import torch

    from gpushm import run as grun
    from gpushm.testing import Daemon
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    gbin = os.environ["GPUSHM_BIN"]
    used0 = _gpu_used()
    d = Daemon("cuda")
    work = Path(tempfile.mkdtemp(prefix="gpushm-loaders-"))
    try:
        ck = work / "llama"
        cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=4, vocab_size=1000, tie_word_embeddings=False)
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(ck, max_shard_size="1MB")
        import peft
        base = LlamaForCausalLM.from_pretrained(ck, dtype=torch.bfloat16)
        pm = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        adapter = work / "adapter"
        pm.save_pretrained(adapter)
        torch.manual_seed(1)
        bn = _bn_model(torch)
        bn.train()
        bn(torch.randn(64, 16))  # running statistics that are not the defaults
        bn_path = work / "bn.safetensors"
        save_file({k: v.contiguous() for k, v in bn.state_dict().items()}, str(bn_path))

        env = dict(os.environ, GPUSHM_SOCKET=d.socket)
        for name, src in [("llama", ck), ("adapter", adapter), ("bn", bn_path)]:
            r = subprocess.run([gbin, "put", name, str(src)], env=env, capture_output=True, text=True)
            check(r.returncode == 0, f"put {name}", r.stderr.strip()[-300:])

        def worker(kind, hooked, *args, cpu_tensors=None):
            out = work / f"{kind}-{'gpushm' if hooked else 'disk'}-{len(os.listdir(work))}.pt"
            e = grun.environment(env, cpu_tensors) if hooked else env
            r = subprocess.run([sys.executable, str(HERE), "worker", kind, str(out), *map(str, args)], env=e,
                               capture_output=True, text=True, timeout=600)
            if r.returncode != 0:
                steps = [ln for ln in r.stderr.splitlines() if ln.startswith("step:")]
                check(False, f"{kind} {'under gpushm.run' if hooked else 'from disk'}",
                      f"{steps[-1:]} {r.stderr.strip()[-1200:]}")
                return None
            notices = [ln for ln in r.stderr.splitlines() if ln.startswith("gpushm:")]
            if notices:
                print(f"INFO {kind} notices: {notices}")
            return torch.load(out)

        def same(a, b):
            return a is not None and b is not None and all(torch.equal(a[k], b[k]) for k in b if isinstance(b[k], torch.Tensor))

        # GPU_LOADERS_ONLY=bn runs the shared-weights part alone, =engines
        # the engines' loops alone.
        only = os.environ.get("GPU_LOADERS_ONLY", "")
        if only not in ("bn", "engines"):
            disk = worker("tf", False, ck)
            hooked = worker("tf", True, ck, cpu_tensors="gpu")
            check(same(hooked, disk), "transformers from_pretrained(dir, device_map='cuda') under gpushm.run --cpu-tensors=gpu",
                  f"logits equal; {hooked and hooked['inference']} of {hooked and hooked['params']} parameters are views of the bundle")
            check(hooked is not None and hooked["inference"] > 0, "transformers parameters shared", "")
            hooked = worker("tf", True, ck)
            check(same(hooked, disk) and hooked["inference"] == 0 and 0 < hooked["served"] == hooked["opens"],
                  "transformers from_pretrained(dir, device_map='cuda') under gpushm.run (default: private GPU copies)",
                  f"logits equal; {hooked and hooked['inference']} parameters are views of the bundle (want 0); "
                  f"opens served {hooked and hooked['served']} of {hooked and hooked['opens']}")
            hooked = worker("tf", True, ck, cpu_tensors="copy")
            check(same(hooked, disk), "transformers from_pretrained under gpushm.run --cpu-tensors=copy (CPU copies)", "logits equal")
            disk, hooked = worker("tfcpu", False, ck), worker("tfcpu", True, ck)
            check(same(hooked, disk) and hooked["devices"] == ["cpu"] and hooked["inference"] == 0
                  and hooked["opens"] > 0 and hooked["served"] == 0,
                  "transformers from_pretrained(dir) onto the CPU under gpushm.run (default: the library reads the files)",
                  f"logits equal; parameters on {hooked and hooked['devices']}; opens served "
                  f"{hooked and hooked['served']} of {hooked and hooked['opens']} (want none)")
            disk, hooked = worker("acc", False, ck), worker("acc", True, ck)
            check(same(hooked, disk), "accelerate load_checkpoint_and_dispatch under gpushm.run",
                  f"logits equal; {hooked and hooked['inference']} parameters are views of the bundle")
            disk = worker("peft", False, ck, adapter)
            for mode in (None, "gpu"):
                hooked = worker("peft", True, ck, adapter, cpu_tensors=mode)
                check(same(hooked, disk) and 0 < hooked["served"] == hooked["opens"],
                      f"peft PeftModel.from_pretrained (adapter put on its own) under gpushm.run"
                      f"{' --cpu-tensors=' + mode if mode else ''}",
                      f"logits equal; opens served {hooked and hooked['served']} of {hooked and hooked['opens']}")
        if only != "bn":
            for engine in ("vllm", "sglang"):
                disk = worker("engine", False, ck, engine)
                for mode in (None, "gpu"):
                    hooked = worker("engine", True, ck, engine, cpu_tensors=mode)
                    check(same(hooked, disk) and disk is not None and len(disk) > 2
                          and 0 < hooked["served"] == hooked["opens"],
                          f"{engine}'s loop, tp 2, under gpushm.run{' --cpu-tensors=' + mode if mode else ''}",
                          f"{len(disk or {})} rank tensors equal; opens served {hooked and hooked['served']} of "
                          f"{hooked and hooked['opens']}")

        if only == "engines":
            return 1 if failed else 0
        # Shared weights that a model writes: another worker holds the
        # bundle before and after.
        e = grun.environment(env)
        other_out = work / "bn-other.pt"
        other = subprocess.Popen([sys.executable, str(HERE), "worker", "bn", str(other_out), str(bn_path), "ready"],
                                 env=e, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        check(other.stdout.readline().strip() == "ready", "the other BatchNorm worker loaded", "")
        disk, hooked = worker("bn", False, bn_path), worker("bn", True, bn_path)
        other.stdin.write("go\n")
        other.stdin.flush()
        other.wait(timeout=120)
        o = torch.load(other_out)
        ok = hooked is not None and disk is not None
        check(ok and hooked["shared_weight"] and hooked["private_stats"], "BatchNorm: weights shared, running statistics private",
              f"fc.weight a view: {ok and hooked['shared_weight']}; bn.running_mean private: {ok and hooked['private_stats']}")
        check(ok and hooked.get("stats_moved", False) and torch.equal(hooked["before"], disk["before"]),
              "BatchNorm in train mode under gpushm.run", "a step ran, no fault; outputs before it equal to disk's")
        check(ok and hooked["rescaled_scale"] == 2.0 and hooked["rescale"].startswith("raised"),
              "a scale rescaled after loading (private), a shared weight written in grad mode (raises)",
              f"scale now {ok and hooked['rescaled_scale']}; the weight: {ok and hooked['rescale']} (from disk: {disk and disk['rescale']})")
        check(torch.equal(o["before"], o["after"]), "another worker keeps its outputs", "equal before and after")
        # In a worker: this process makes no CUDA context of its own, so
        # that the GPU memory in use at the end is the daemon's and the
        # workers' alone.
        same_mem = worker("unchanged", False, bn_path, d.socket)
        check(same_mem is not None and same_mem["equal"], "the bundle is unchanged", "every tensor equal to the file")
    finally:
        d.stop()
    used1 = _gpu_used()
    check(used0 is None or abs(used1 - used0) <= 2, "GPU memory in use at the end", f"{used0} MiB before, {used1} MiB after")
    print("FAILED: " + ", ".join(failed) if failed else "all passed")
    return 1 if failed else 0


def _gpu_used():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        if os.environ.get("GPUSHM_SAFETENSORS"):
            import _run

            _run.count_hook_opens(SERVED)
        WORKERS[sys.argv[2]](*sys.argv[3:])
        sys.exit(0)
    sys.exit(main())
