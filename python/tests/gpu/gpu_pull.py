#!/usr/bin/env python3
"""Two GPUs as two nodes: a daemon on GPU 0 and one on GPU 1, each with its
own socket and state, peers over loopback (UCX's tcp). A Llama-shaped
checkpoint put on the first and offered is pulled by the second, then
loaded with gpushm.transformers.from_pretrained there, every tensor
compared with the files on disk; then the same bytes moved GPU to GPU by
NCCL (torch.distributed send/recv) with its sockets forced
(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1) and with its own transports, for
comparison.

    GPUSHM_BIN=.gpu/gpushm PYTHONPATH=python python3 python/tests/gpu/gpu_pull.py [--size 16G]

Prints PASS/FAIL and INFO lines; exits 1 if any failed. The same file is
the workers' program ('worker ...', 'nccl RANK ...').
"""

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[3]
sys.path.insert(0, str(REPO / "python"))
sys.path.insert(0, str(REPO / "python" / "bench"))

failed = []
GIB = 1 << 30


def check(ok, name, detail=""):
    print(f"{'PASS' if ok else 'FAIL'}  {name}" + (f": {detail}" if detail else ""), flush=True)
    if not ok:
        failed.append(name)
    return ok


def worker(socket, name, ckdir, out):
    """from_pretrained of the pulled bundle on this node; every parameter
    compared with the checkpoint's files read from disk to the same GPU."""
    import torch
    import transformers  # noqa: F401 (imported before the clock starts)
    from safetensors.torch import load_file

    import gpushm
    from gpushm.transformers import from_pretrained

    c = gpushm.Client(socket)
    t = time.perf_counter()
    model = from_pretrained(name, client=c)
    took = time.perf_counter() - t
    sd = model.state_dict()
    dev = next(iter(sd.values())).device
    n = bad = 0
    for shard in sorted(Path(ckdir).glob("*.safetensors")):
        for k, v in load_file(str(shard), device=str(dev)).items():
            n += 1
            if k not in sd or not torch.equal(sd[k], v):
                bad += 1
    Path(out).write_text(json.dumps({"tensors": n, "bad": bad, "seconds": took, "device": str(dev)}))


def nccl(rank, size, port, out):
    """Rank 0 on GPU 0 sends size bytes to rank 1 on GPU 1, in 1 GiB
    messages, after a warm-up; rank 1 says how long it took."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    step = min(size, GIB)
    buf = torch.empty(step, dtype=torch.uint8, device=f"cuda:{rank}")
    if rank == 0:
        buf.fill_(7)
    for warm in (True, False):
        dist.barrier()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(1 if warm else size // step):
            if rank == 0:
                dist.send(buf, 1)
            else:
                dist.recv(buf, 0)
        torch.cuda.synchronize()
        took = time.perf_counter() - t
    ok = rank == 0 or bool((buf == 7).all())
    if rank == 1:
        Path(out).write_text(json.dumps({"seconds": took, "ok": ok}))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="16G", choices=("2G", "16G"),
                    help="the checkpoint: 2G or 16G (Llama-3-8B's shapes)")
    a = ap.parse_args()

    from bench_loaders import SIZES
    from bench_models import synthesize

    from gpushm.testing import Daemon

    gbin = os.environ["GPUSHM_BIN"]
    work = Path(tempfile.mkdtemp(prefix="gpushm-pull-", dir="/var/tmp"))
    secret = work / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    os.environ.setdefault("UCX_TLS", "tcp")
    common = ["--peer-secret", str(secret), "--log-level", "info"]
    a_node = Daemon("cuda", "--devices", "0", "--node", "a", "--listen-peers", "127.0.0.1:17946", *common)
    b_node = Daemon("cuda", "--devices", "1", "--node", "b", "--listen-peers", "127.0.0.1:17947",
                    "--peers", "127.0.0.1:17946", *common)
    try:
        ck = work / "ckpt"
        shape, layers = SIZES[a.size]
        t = time.perf_counter()
        size = synthesize(ck, shape, layers, 5 * 10 ** 9)
        print(f"INFO  checkpoint: {size / GIB:.2f} GiB, written in {time.perf_counter() - t:.1f} s", flush=True)

        def g(node, *args):
            r = subprocess.run([gbin, "--socket", node.socket, *args], capture_output=True, text=True)
            return r.returncode, (r.stdout + r.stderr).strip()

        rc, out = g(a_node, "put", "ckpt", str(ck), "--offer")
        check(rc == 0, "put the checkpoint on node a (GPU 0), offered", out[-300:])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            rc, out = g(b_node, "peers", "-o", "json")
            if rc == 0 and "ckpt" in out:
                break
            time.sleep(0.2)
        check("ckpt" in out, "node b sees a offer it", "" if "ckpt" in out else out[-300:])

        t = time.perf_counter()
        rc, out = g(b_node, "pull", "ckpt")
        took = time.perf_counter() - t
        check(rc == 0, "pull on node b (GPU 1)", out[-400:])
        rc, st = g(b_node, "stat", "ckpt", "-o", "json")
        seg = json.loads(st) if rc == 0 else {}
        check(seg.get("device") == 1, "the pulled bundle is on GPU 1", st[-300:])
        print(f"INFO  pull: {seg.get('size', 0) / GIB:.2f} GiB in {took:.2f} s "
              f"({seg.get('size', 0) / took / 1e9:.2f} GB/s, the whole command): {out}", flush=True)

        res = work / "worker.json"
        r = subprocess.run([sys.executable, str(HERE), "worker", b_node.socket, "ckpt", str(ck), str(res)],
                           capture_output=True, text=True, timeout=1800)
        if check(r.returncode == 0, "from_pretrained of the pulled bundle on node b", r.stderr[-1500:]):
            w = json.loads(res.read_text())
            check(w["tensors"] > 0 and w["bad"] == 0, "every tensor equal to the files",
                  f"{w['tensors'] - w['bad']} of {w['tensors']} equal, on {w['device']}, from_pretrained {w['seconds']:.2f} s")

        for label, env in [("sockets (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)", {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}),
                           ("its own transports", {})]:
            out = work / "nccl.json"
            e = dict(os.environ, NCCL_NVLS_ENABLE="0", **env)
            port = 29500 + secrets.randbelow(1000)
            ps = [subprocess.Popen([sys.executable, str(HERE), "nccl", str(rank), str(seg.get("size", GIB)), str(port), str(out)],
                                   env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
            logs = [p.communicate(timeout=1800)[0] for p in ps]
            if check(all(p.returncode == 0 for p in ps), f"NCCL send/recv, {label}", "".join(logs)[-800:]):
                n = json.loads(out.read_text())
                check(n["ok"], f"NCCL's bytes arrived, {label}")
                gb = seg.get("size", GIB) / n["seconds"] / 1e9
                print(f"INFO  NCCL send/recv GPU 0 -> GPU 1, {label}: {n['seconds']:.2f} s ({gb:.2f} GB/s); "
                      f"gpushm pull {took:.2f} s: {n['seconds'] / took:.2f}x", flush=True)
    finally:
        for d in (a_node, b_node):
            d.stop()
        subprocess.run(["rm", "-rf", str(work)])
    print(f"{'FAIL' if failed else 'PASS'}  gpu_pull: {len(failed)} failed", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(*sys.argv[2:6])
    elif len(sys.argv) > 1 and sys.argv[1] == "nccl":
        nccl(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    else:
        main()
