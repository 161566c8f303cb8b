#!/usr/bin/env python3
"""Weights that move and change under a running process, on a cuda daemon.

    GPUSHM_BIN=.gpu/gpushm PYTHONPATH=python python3 python/tests/gpu/gpu_remap.py

A reader process maps a model's weights from a bundle, captures a CUDA
graph of its forward and keeps it for the whole run. Then, 20 times:

- the reader releases the weights (gpushm.torch.release); a filler process
  creates a segment that fills the daemon's GPU budget, so the daemon
  evicts the model to host memory; the filler removes its segment; the
  reader reacquires the weights and replays the graph: the output equals
  the one before the release, and the weights sit at the same addresses;
- a trainer process makes the next version current (new weights, from its
  own GPU tensors); the reader, told by its epoch page, refreshes and
  replays the same graph: the output equals an eager forward of a model
  built from that version's weights in the reader's own memory.

The serving process is killed (SIGKILL) between some of these steps. At
the end the name holds the last version only, and the GPU memory in use
is what it was before the daemon started. Prints PASS/FAIL lines; exits 1
if any failed. The same file is the workers' program ('worker KIND ...').
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[3]
sys.path.insert(0, str(REPO / "python"))

LAYERS, WIDTH = 8, 4096  # 8 fp32 layers of 4096x4096: 512 MiB a version
CYCLES = int(os.environ.get("REMAP_CYCLES", "20"))
failed = []


def check(ok, name, detail=""):
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        failed.append(name)


# ---- the model and its versions ---------------------------------------------

def weights(torch, version, device):
    """Version `version`'s weights, the same in every process."""
    g = torch.Generator().manual_seed(1000 + version)
    out = {}
    for i in range(LAYERS):
        out[f"l{i}.weight"] = (torch.randn(WIDTH, WIDTH, generator=g) / WIDTH ** 0.5).to(device)
        out[f"l{i}.bias"] = (torch.randn(WIDTH, generator=g) * 0.01).to(device)
    return out


def model_of(torch):
    layers = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU()]
    m = torch.nn.Sequential(*layers)
    return m


def load(torch, sd):
    with torch.device("meta"):
        m = model_of(torch)
    # An inference model: parameters that need no grad take the bundle's
    # read-only (inference) tensors as they are.
    m.requires_grad_(False)
    m.load_state_dict(_renamed(sd), assign=True)
    return m.eval()


def _renamed(sd):
    # l{i}.x is layer 2*i of the Sequential (a GELU follows each Linear).
    out = {}
    for k, v in sd.items():
        i, rest = k[1:].split(".", 1)
        out[f"{2 * int(i)}.{rest}"] = v
    return out


def the_input(torch):
    g = torch.Generator().manual_seed(7)
    return torch.randn(64, WIDTH, generator=g).cuda()


# ---- workers -----------------------------------------------------------------

def w_reader(socket, name):
    import torch

    import gpushm
    import gpushm.torch as gt

    c = gpushm.connect(socket)
    sd = gt.state_dict(name, readonly=True, client=c)
    m = load(torch, sd)
    x = the_input(torch)
    ptr = m[0].weight.data_ptr()
    # Capture on a side stream after a warm-up, as torch asks.
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.inference_mode():
        for _ in range(2):
            m(x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        static_out = m(x)
    version = 1

    def replay():
        graph.replay()
        torch.cuda.synchronize()
        return static_out.clone()

    def reference(v):
        with torch.inference_mode():
            return load(torch, weights(torch, v, "cuda"))(x)

    before = replay()
    ref = reference(version)
    print(json.dumps({"ready": True, "ptr": ptr, "equal": bool(torch.allclose(before, ref, rtol=1e-4, atol=1e-5))}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        res = {"cmd": cmd[0]}
        try:
            if cmd[0] == "release":
                gt.release(m)
            elif cmd[0] == "reacquire":
                gt.reacquire(m)
                got = replay()
                res["equal"] = bool(torch.equal(got, before))
            elif cmd[0] == "refresh":
                want = int(cmd[1])
                res["stale"] = any(seg.stale() for seg in _segments(gt, m))
                t0 = time.perf_counter()
                res["changed"] = bool(gt.refresh(m))
                res["refresh_ms"] = (time.perf_counter() - t0) * 1e3
                got = replay()
                ref = reference(want)
                with torch.inference_mode():
                    eager = m(x)
                res["equal"] = bool(torch.allclose(got, ref, rtol=1e-4, atol=1e-5)) and bool(torch.equal(got, eager))
                res["maxdiff"] = float((got - ref).abs().max())
                before, version = got, want
            elif cmd[0] == "quit":
                print(json.dumps(res), flush=True)
                break
            res["ptr"] = m[0].weight.data_ptr()
            res["ok"] = True
        except Exception as e:  # reported, and the run goes on
            res["ok"], res["error"] = False, f"{type(e).__name__}: {e}"
        print(json.dumps(res), flush=True)
    del graph, static_out, m, sd
    c.close()


def _segments(gt, m):
    """The gpushm segments behind m's tensors (through the torch helpers'
    bookkeeping)."""
    return gt.segments(m)


def _serve(handlers):
    """Answers the driver's commands, a line each, with a JSON line each:
    handlers[command](arguments, result) fills the result; "quit" ends."""
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "quit":
            break
        res = {"cmd": cmd[0], "ok": True}
        try:
            handlers[cmd[0]](cmd[1:], res)
        except Exception as e:
            res["ok"], res["error"] = False, f"{type(e).__name__}: {e}"
        print(json.dumps(res), flush=True)


def w_filler(socket, nbytes):
    import gpushm

    c = gpushm.connect(socket)

    def fill(args, res):
        with c.create("filler", int(nbytes)):
            res["model_tier"] = c.stat(args[0]).tier
        c.unlink("filler")

    _serve({"fill": fill})
    c.close()


def w_trainer(socket, name):
    import torch

    import gpushm

    c = gpushm.connect(socket)

    def version(args, res):
        v = int(args[0])
        ts = weights(torch, v, "cuda")
        torch.cuda.synchronize()
        c.put_tensors(name, ts, mode=0o644, next_version=v > 1).close()
        res["version"] = c.stat(name).version

    _serve({"version": version})
    c.close()


WORKERS = {"reader": w_reader, "filler": w_filler, "trainer": w_trainer}


# ---- the run -----------------------------------------------------------------

class Worker:
    def __init__(self, kind, *args):
        self.kind = kind
        self.p = subprocess.Popen([sys.executable, str(HERE), "worker", kind, *map(str, args)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def read(self):
        line = self.p.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.kind} worker exited ({self.p.wait()})")
        return json.loads(line)

    def ask(self, cmd):
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self.read()

    def quit(self):
        try:
            self.p.stdin.write("quit\n")
            self.p.stdin.flush()
        except BrokenPipeError:
            pass
        self.p.wait(timeout=60)


def kill_serving(d):
    import gpushm

    with gpushm.connect(d.socket, timeout=5, reconnect=0) as c:
        pid = c.info()["pid"]
    os.kill(pid, 9)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with gpushm.connect(d.socket, timeout=5, reconnect=0) as c:
                if c.info()["pid"] != pid:
                    return pid
        except OSError:
            pass
        time.sleep(0.02)
    raise RuntimeError("no new serving process within 60 s")


def main():
    import gpushm
    from gpushm.testing import Daemon, gpu_memory_used

    version_bytes = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
    budget = 3 * version_bytes  # two versions and a little: the filler takes the rest
    used0 = gpu_memory_used()
    d = Daemon("cuda", "--gpu-budget", str(budget), "--grace", "1s")
    name, workers, kills = "model", [], 0
    try:
        trainer = Worker("trainer", d.socket, name)
        workers.append(trainer)
        r = trainer.ask("version 1")
        check(r["ok"] and r.get("version") == 1, "version 1 put", r.get("error", ""))
        reader = Worker("reader", d.socket, name)
        workers.append(reader)
        r = reader.read()
        ptr = r["ptr"]
        check(r["equal"], "reader captured a CUDA graph of the forward", "its output equals a model in its own memory")
        filler = Worker("filler", d.socket, budget - version_bytes // 2)
        workers.append(filler)
        version, refresh_ms = 1, []
        for cycle in range(CYCLES):
            r = reader.ask("release")
            ok = r["ok"]
            f = filler.ask(f"fill {name}")
            evicted = f["ok"] and f.get("model_tier") == "host"
            if cycle % 4 == 1:
                kill_serving(d)
                kills += 1
            r = reader.ask("reacquire")
            ok = ok and evicted and r["ok"] and r["equal"] and r["ptr"] == ptr
            check(ok, f"cycle {cycle}: release, evicted by another process, reacquire, replay",
                  f"evicted: {evicted} {f.get('error', '')}; output equal to before: {r.get('equal')}; "
                  f"same address: {r.get('ptr') == ptr} {r.get('error', '')}")
            version += 1
            t = trainer.ask(f"version {version}")
            if cycle % 4 == 3:
                kill_serving(d)
                kills += 1
            r = reader.ask(f"refresh {version}")
            ok = t["ok"] and t.get("version") == version and r["ok"] and r.get("changed") and r["equal"] and r["ptr"] == ptr
            if r.get("refresh_ms") is not None:
                refresh_ms.append(r["refresh_ms"])
            check(ok, f"cycle {cycle}: version {version} made current by the trainer, refresh, replay",
                  f"stale seen: {r.get('stale')}; output equal to an eager forward of version {version}: {r.get('equal')} "
                  f"(max diff {r.get('maxdiff')}); same address: {r.get('ptr') == ptr} {t.get('error', '')} {r.get('error', '')}")
        for w in workers:
            w.quit()
        workers = []
        with gpushm.connect(d.socket) as c:
            st = c.stat(name)
            segs = c.info()["usage"]["segments"]
        check(st.version == version and not getattr(st, "versions", None) and segs == 1,
              "at the end the name holds its last version only",
              f"version {st.version}, {segs} segments, {kills} kills of the serving process")
        if refresh_ms:
            refresh_ms.sort()
            print(f"INFO refresh of a {version_bytes / 2**20:.0f} MiB model in the reader: median {refresh_ms[len(refresh_ms) // 2]:.2f} ms, "
                  f"max {refresh_ms[-1]:.2f} ms over {len(refresh_ms)}")
    finally:
        for w in workers:
            w.p.kill()
        d.stop()
    used1 = gpu_memory_used()
    check(used0 is None or all(abs(a - b) <= 2 for a, b in zip(used0, used1)), "GPU memory in use at the end",
          f"{used0} MiB before, {used1} MiB after")
    print("FAILED: " + ", ".join(failed) if failed else "all passed")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        WORKERS[sys.argv[2]](*sys.argv[3:])
        sys.exit(0)
    sys.exit(main())
