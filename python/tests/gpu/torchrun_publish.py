"""Two processes, one per GPU, sharing what PyTorch allocated (run by
scripts/gpu-multi on a machine with two GPUs and a daemon serving both):

    python3 torchrun_publish.py --baseline
    torchrun --standalone --nproc_per_node=2 torchrun_publish.py
    python3 torchrun_publish.py --after
    python3 torchrun_publish.py --memory

Rank 0 builds a model on GPU 0 under gpushm.torch.shareable() and publishes
its weight; rank 1 opens it by name with access for GPU 1 only and checks
every element against rank 0's copy (sent over gloo), then sees rank 0's
in-place change: the same memory, not a copy. After rank 0 has exited,
--after reads the tensor by name again on GPU 1 and unlinks it, and
--memory, in a process with no CUDA context, checks that GPU 0's free memory
is back where --baseline found it.
"""

import os
import sys
import time

import torch

import gpushm

NAME = "rank0.linear.weight"
STATE = os.path.join(os.environ.get("TMPDIR", "/tmp"), "gpushm-torchrun-state")


def free_on(c, index):
    return next(d for d in c.info()["devices"] if d["index"] == index)["free_bytes"]


def main():
    c = gpushm.connect()
    if "--baseline" in sys.argv:
        # This process has no CUDA context: the daemon's own is all there is.
        with open(STATE, "w") as f:
            f.write(str(free_on(c, 0)))
        print("baseline: GPU 0 free", free_on(c, 0))
        return
    if "--after" in sys.argv:
        want = torch.load(STATE + ".pt")
        t0 = time.perf_counter()
        seg = c.open(NAME, devices=[1])
        t = torch.from_dlpack(seg)
        print(f"after the publisher exited: open + from_dlpack {1e3 * (time.perf_counter() - t0):.2f} ms, {t.dtype} {tuple(t.shape)} on {t.device}")
        assert t.device == torch.device("cuda", 1), t.device
        assert torch.equal(t.cpu(), want), "the tensor read by name differs from what rank 0 left"
        print("after: all elements equal to rank 0's last version")
        del t, seg
        c.unlink(NAME)
        print("after: unlinked")
        return
    if "--memory" in sys.argv:
        # A fresh process with no CUDA context, like --baseline: what GPU 0
        # has free now is the daemon's doing alone.
        with open(STATE) as f:
            base = int(f.read())
        deadline = time.time() + 5
        while True:
            now = free_on(c, 0)
            if abs(now - base) <= 8 << 20 or time.time() > deadline:
                break
            time.sleep(0.05)
        print(f"GPU 0 free memory: {base} before publishing, {now} after unlink ({now - base:+d} bytes)")
        assert abs(now - base) <= 8 << 20, "GPU 0 memory not back to its baseline"
        print("memory: back to the baseline")
        return

    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    import gpushm.torch as gt
    if rank == 0:
        torch.manual_seed(0)
        with gt.shareable():
            model = torch.nn.Linear(4096, 4096).cuda()
        w = model.weight.data
        info = c.publish(NAME, w)
        print(f"rank 0: published {NAME}: {info.size} bytes on GPU {info.device}, meta {info.meta}; allocator {gt.stats()}")
        cpu = w.cpu()
        dist.send(cpu, dst=1)
        dist.barrier()  # rank 1 checked the first version
        w.add_(1.0)
        torch.cuda.synchronize()
        torch.save(w.cpu(), STATE + ".pt")
        dist.barrier()  # rank 1 may look now
        dist.barrier()  # rank 1 saw the change
    else:
        want = torch.empty(4096, 4096)
        dist.recv(want, src=0)
        t0 = time.perf_counter()
        seg = c.open(NAME, devices=[1])
        t = torch.from_dlpack(seg)
        dt = time.perf_counter() - t0
        assert t.device == torch.device("cuda", 1), t.device
        assert t.dtype == torch.float32 and tuple(t.shape) == (4096, 4096), (t.dtype, t.shape)
        assert torch.equal(t.cpu(), want), "rank 1 does not see rank 0's weight"
        print(f"rank 1: opened {NAME} on {t.device} in {1e3 * dt:.2f} ms; all 16777216 elements equal")
        dist.barrier()
        dist.barrier()
        assert torch.equal(t.cpu(), want + 1), "rank 1 does not see rank 0's in-place change"
        print("rank 1: sees rank 0's in-place add: the same memory, zero-copy")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
