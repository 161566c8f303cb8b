"""CUDA segments with torch, CuPy and JAX, against a daemon on the cuda
backend. Every test here skips, saying why, on a machine without a GPU or
without the framework it needs; python/tests/gpu/gpu_run.sh runs them on the GPU
machine."""

import gc
import hashlib
import os
import random
import subprocess
import sys
import textwrap
import time

import pytest

import gpushm
from gpushm import _cuda
from conftest import Daemon, Peer, child, env_for


def _cuda_reason():
    try:
        _cuda.device(0)
    except _cuda.CUDAError as e:
        return str(e)
    return None


_REASON = _cuda_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"needs a GPU: {_REASON}")


@pytest.fixture(scope="module")
def gpu_daemon():
    d = Daemon("cuda")
    yield d
    d.stop()


@pytest.fixture
def gclient(gpu_daemon):
    c = gpushm.connect(gpu_daemon.socket)
    assert c.backend == "cuda"
    yield c
    c.close()


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="torch is not installed")


def test_torch_producer_consumer_processes(gpu_daemon, name):
    producer = Peer(gpu_daemon.socket, """
        import sys, torch, gpushm
        c = gpushm.connect()
        seg = c.create(sys.argv[1], shape=(1024, 1024), dtype="float32", device=0)
        t = torch.from_dlpack(seg)
        assert t.is_cuda and t.shape == (1024, 1024) and t.dtype == torch.float32
        t.copy_(torch.arange(1024 * 1024, device="cuda", dtype=torch.float32).reshape(1024, 1024))
        torch.cuda.synchronize()
        print("filled")
        assert input() == "check"
        want = 2 * torch.arange(1024 * 1024, device="cuda", dtype=torch.float32).reshape(1024, 1024) + 1
        assert torch.equal(t, want), "producer does not see the consumer's write"
        print("ok")
    """, name)
    producer.expect("filled")
    consumer = Peer(gpu_daemon.socket, """
        import sys, torch, gpushm
        t = torch.from_dlpack(gpushm.connect().open(sys.argv[1]))   # typed by the segment's meta
        assert t.is_cuda and t.dtype == torch.float32 and t.shape == (1024, 1024), (t.dtype, t.shape)
        assert torch.equal(t, torch.arange(1024 * 1024, device="cuda", dtype=torch.float32).reshape(1024, 1024))
        t.mul_(2).add_(1)                                             # write back
        torch.cuda.synchronize()
        print("written")
    """, name)
    consumer.expect("written")
    consumer.close()
    producer.send("check")
    producer.expect("ok")
    producer.close()


@pytest.fixture
def shared_arange(gclient, name, torch):
    gclient.share(name, torch.arange(4096, device="cuda", dtype=torch.float32))
    return name


def _skip_if(out):
    if out.startswith("SKIP"):
        pytest.skip(out.strip())
    return out


def test_cupy_opens_the_segment(gclient, gpu_daemon, shared_arange, torch):
    out = _skip_if(child(gpu_daemon.socket, """
        import sys
        try:
            import cupy
        except ImportError as e:
            print("SKIP cupy:", e); sys.exit(0)
        import gpushm
        s = gpushm.connect().open(sys.argv[1])
        a = cupy.from_dlpack(s)
        b = cupy.asarray(s)                       # __cuda_array_interface__
        assert a.data.ptr == b.data.ptr == s.ptr
        assert float(a.sum()) == sum(range(4096)), float(a.sum())
        b[0] = -1
        cupy.cuda.runtime.deviceSynchronize()
        print("cupy ok", a.dtype, a.shape)
    """, shared_arange))
    assert out.startswith("cupy ok float32 (4096,)")
    assert float(torch.from_dlpack(gclient.open(shared_arange))[0]) == -1   # the write came back


def test_jax_opens_the_segment(gpu_daemon, shared_arange):
    out = _skip_if(child(gpu_daemon.socket, """
        import os, sys
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        try:
            import jax, jax.dlpack, jax.numpy as jnp
        except ImportError as e:
            print("SKIP jax:", e); sys.exit(0)
        if jax.default_backend() != "gpu":
            print("SKIP jax has no GPU backend here:", jax.devices()); sys.exit(0)
        import gpushm
        s = gpushm.connect().open(sys.argv[1])
        x = jax.dlpack.from_dlpack(s)
        assert x.dtype == jnp.float32 and x.shape == (4096,), (x.dtype, x.shape)
        assert float(x.sum()) == sum(range(4096)), float(x.sum())
        print("jax ok", x.devices())
    """, shared_arange))
    assert out.startswith("jax ok")


def test_gpu_10000_open_drop_cycles_leak_nothing(gclient, name, torch):
    seg = gclient.create(name, shape=(1 << 20,), dtype="float32")   # 4 MiB: 2 granules
    torch.from_dlpack(seg).zero_()
    seg.close()
    dev = _cuda.device(0)
    torch.cuda.synchronize()
    gc.collect()
    free0, _ = dev.mem_info()
    fds = len(os.listdir("/proc/self/fd"))
    opens = gclient.info()["usage"]["opens"]
    for _ in range(10000):
        t = torch.from_dlpack(gclient.open(name))
        t[0] += 1                                  # a kernel on the mapping
        del t                                      # unmapped here; the next open maps anew
    torch.cuda.synchronize()
    gc.collect()
    free1, _ = dev.mem_info()
    assert len(os.listdir("/proc/self/fd")) == fds
    assert gclient.info()["usage"]["opens"] == opens
    # Another process's allocations can move free memory; ours would move it
    # by 4 MiB a cycle.
    assert abs(free1 - free0) < 64 << 20, (free0, free1)
    assert float(torch.from_dlpack(gclient.open(name))[0]) == 10000
    print(f"free memory before {free0}, after {free1}")


def test_gpu_idle_holder_keeps_its_lease(name, torch):
    """test_survive's test_idle_holder_keeps_its_lease on cuda: a torch
    process maps a segment and makes no call while the serving process is
    SIGKILLed and the grace period (2 s) runs out. Its client reclaims the
    lease by itself, so an evict is refused, and what its kernels write
    afterwards is what another process reads."""
    from test_survive import serving_pid, wait_grace_over, wait_new_pid
    d = Daemon("cuda", "--grace", "2s")
    try:
        with gpushm.connect(d.socket) as c:
            torch.from_dlpack(c.create(name, shape=(1 << 20,), dtype="float32")).fill_(7)
            torch.cuda.synchronize()
        peer = Peer(d.socket, """
            import sys, torch, gpushm
            c = gpushm.connect()
            t = torch.from_dlpack(c.open(sys.argv[1]))
            print("ok", flush=True)
            for line in sys.stdin:                  # idle: no call until asked
                t.fill_(float(line))                # a kernel on the mapping, no call either
                torch.cuda.synchronize()
                print(f"ok reconnects={c.reconnects}", flush=True)
        """, name)
        peer.expect("ok")
        pid = serving_pid(d.socket)
        os.kill(pid, 9)
        wait_new_pid(d.socket, pid)
        wait_grace_over(d.socket)
        with gpushm.connect(d.socket, reconnect=0) as c:
            with pytest.raises(gpushm.BusyError):
                c.evict(name)
            peer.send("9")
            peer.expect("ok reconnects=1")
            assert bool((torch.from_dlpack(c.open(name, readonly=True)) == 9).all())
        peer.close()
    finally:
        d.stop()


def test_gpu_bundle(gclient, gpu_daemon, name, torch):
    ts = {
        "w": torch.randn(256, 128, device="cuda", dtype=torch.bfloat16),
        "b": torch.randn(3, device="cuda", dtype=torch.float16),
        "n": torch.arange(5, device="cuda"),
        "m": torch.tensor([True, False], device="cuda"),
        "host": torch.arange(4, dtype=torch.float64),        # a CPU tensor goes in too
    }
    seg = gclient.put_tensors(name, ts, metadata={"arch": "test"})
    assert seg.device == 0 and seg.meta["kind"] == "bundle" and seg.meta["tensors"] == 5
    got = {k: torch.from_dlpack(v) for k, v in gclient.tensors(name).items()}
    for k, t in ts.items():
        assert got[k].is_cuda and got[k].dtype == t.dtype and torch.equal(got[k].cpu(), t.cpu()), k
    assert got["w"].data_ptr() % 64 == 0
    out = child(gpu_daemon.socket, """
        import sys, torch, gpushm
        b = gpushm.connect().tensors(sys.argv[1], readonly=True)
        w = torch.from_dlpack(b["w"])
        print(w.dtype, float(w.float().sum()), b.metadata)
    """, name)
    assert out.split()[0] == "torch.bfloat16" and abs(float(out.split()[1]) - float(ts["w"].float().sum())) < 1e-2


def test_gpu_release_reacquire_refresh_under_a_cuda_graph(gclient, gpu_daemon, name, torch):
    """A CUDA graph captured over a bundle's tensors replays right after the
    bundle was released, evicted and reacquired, and reads the next version
    after a refresh: the addresses never change, the memory behind them
    does. A version laid out otherwise is refused and the graph keeps
    reading the one it has."""
    import gpushm.torch as gt

    w1, b1 = torch.randn(256, 256, device="cuda"), torch.randn(256, device="cuda")
    gclient.put_tensors(name, {"w": w1, "b": b1}).close()
    r = gpushm.connect(gpu_daemon.socket)
    sd = gt.state_dict(name, client=r)
    ptrs = {k: t.data_ptr() for k, t in sd.items()}
    x = torch.randn(8, 256, device="cuda")
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):                      # warm up off the capture
            x @ sd["w"] + sd["b"]
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = x @ sd["w"] + sd["b"]

    def replay():
        graph.replay()
        torch.cuda.synchronize()
        return y.clone()

    assert torch.allclose(replay(), x @ w1 + b1, rtol=1e-4, atol=1e-4)
    gt.release(sd)
    assert gclient.stat(name).opens == 0 and gclient.evict(name).tier == "host"
    gt.reacquire(sd)
    assert {k: t.data_ptr() for k, t in sd.items()} == ptrs
    assert torch.allclose(replay(), x @ w1 + b1, rtol=1e-4, atol=1e-4)

    w2, b2 = w1 * 2, b1 - 1
    gclient.put_tensors(name, {"w": w2, "b": b2}, next_version=True).close()
    assert gt.refresh(sd) is True and {k: t.data_ptr() for k, t in sd.items()} == ptrs
    assert torch.allclose(replay(), x @ w2 + b2, rtol=1e-4, atol=1e-4)
    st = gclient.stat(name)
    assert st.version == 2 and st.versions == () and st.opens == 1

    gclient.put_tensors(name, {"w": w2[:128], "b": b2}, next_version=True).close()
    with pytest.raises(gpushm.InvalidError):
        gt.refresh(sd)
    assert torch.allclose(replay(), x @ w2 + b2, rtol=1e-4, atol=1e-4)
    del graph, y, sd
    gc.collect()
    r.close()


def test_gpu_share_layouts_and_readonly(gclient, name, torch):
    x = torch.randn(64, 32, device="cuda").t()            # a transpose keeps its strides
    seg = gclient.share(name, x)
    assert seg.device == 0 and seg.strides == (1, 32)
    y = torch.from_dlpack(gclient.open(name))
    assert not y.is_contiguous() and torch.equal(y, x)
    ro = gclient.open(name, readonly=True)
    assert ro.__cuda_array_interface__["data"] == (ro.ptr, True)
    assert torch.equal(torch.from_dlpack(ro), x)          # versioned capsule with the read-only flag
    cpu = torch.from_dlpack(_Capsule(ro.__dlpack__(dl_device=(1, 0))))
    assert cpu.device.type == "cpu" and torch.equal(cpu, x.cpu())
    with pytest.raises(BufferError):
        ro.__dlpack__(dl_device=(1, 0), copy=False)
    z = torch.arange(6, device="cuda", dtype=torch.int16)
    assert gclient.share(name + "c", z).tobytes() == z.cpu().numpy().tobytes()   # device to host read


class _Capsule:
    def __init__(self, cap):
        self.cap = cap

    def __dlpack__(self, **kw):
        return self.cap

    def __dlpack_device__(self):
        return (1, 0)


def test_cuda_tensor_into_host_segment(client, name, torch):
    t = torch.arange(10, device="cuda", dtype=torch.int32)
    seg = client.share(name, t)                            # device to host copy
    assert seg.device is None and seg.numpy().tolist() == list(range(10))


def test_gpu_segment_survives_client_close(gpu_daemon, name, torch):
    c = gpushm.connect(gpu_daemon.socket)
    t = torch.from_dlpack(c.create(name, shape=(8,), dtype="int64"))
    c.close()
    t.fill_(3)                                             # still mapped: the tensor holds it
    torch.cuda.synchronize()
    assert int(t.sum()) == 24


def _put_dir(gpu_daemon, name, d, *flags):
    env = dict(os.environ, GPUSHM_SOCKET=gpu_daemon.socket)
    r = subprocess.run([os.environ["GPUSHM_BIN"], "put", *flags, name, str(d)], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_gpu_checkpoint_state_dict(gclient, gpu_daemon, name, torch, tmp_path):
    from test_checkpoint import SHARDS, make_checkpoint
    d = make_checkpoint(tmp_path)
    _put_dir(gpu_daemon, name, d)
    import gpushm.torch as gt
    sd = gt.state_dict(name, client=gclient)
    want = {k: v for ts in SHARDS.values() for k, v in ts.items()}
    assert list(sd) == list(want)
    for k, t in sd.items():
        assert t.is_cuda and t.is_inference(), k
        assert torch.equal(t.cpu(), torch.from_numpy(want[k].copy())), k
    # An in-place update is refused, but torch (2.11) has queued its kernel
    # by then: the write faults on the read-only mapping and costs that
    # process its CUDA context. So it runs in a process of its own, and the
    # weights are checked unchanged after it.
    out = child(gpu_daemon.socket, """
        import sys, torch, gpushm.torch as gt
        sd = gt.state_dict(sys.argv[1])
        try:
            sd["lm_head.weight"].add_(1)
        except RuntimeError as e:
            print("refused" if "Inplace update to inference tensor" in str(e) else e)
        try:
            torch.cuda.synchronize()
        except Exception:
            pass
    """, name)
    assert out.strip() == "refused", out
    for k, t in sd.items():
        assert torch.equal(t.cpu(), torch.from_numpy(want[k].copy())), k
    rw = gt.state_dict(name, readonly=False, client=gclient)
    assert not rw["step"].is_inference()
    rw["step"].fill_(9)
    torch.cuda.synchronize()
    out = child(gpu_daemon.socket, """
        import sys, gpushm.torch as gt
        print(int(gt.state_dict(sys.argv[1])["step"]))
    """, name)
    assert out.strip() == "9"                              # one copy, seen by every process
    assert gclient.files(name)["config.json"].startswith(b'{"model_type"')


def test_gpu_from_pretrained(gclient, gpu_daemon, name, torch, tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(torch.float32)
    try:
        model.save_pretrained(tmp_path / "m", safe_serialization=True, max_shard_size="100KB")
    except TypeError:  # transformers versions that write nothing but safetensors
        model.save_pretrained(tmp_path / "m", max_shard_size="100KB")
    assert len(list((tmp_path / "m").glob("*.safetensors"))) > 1
    _put_dir(gpu_daemon, name, tmp_path / "m", "--readonly-default")
    ids = torch.arange(12).reshape(1, 12).cuda()
    model.cuda()
    with torch.no_grad():
        want = model(ids).logits
    import gpushm.transformers as gtf
    got = gtf.from_pretrained(name, client=gclient)
    assert got.lm_head.weight is got.model.embed_tokens.weight            # tied again
    assert all(p.is_cuda and p.is_inference() and not p.requires_grad for p in got.parameters())
    assert all(b.is_cuda for b in got.buffers())                          # rotary inv_freq: made, then moved
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want)
        out = got.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, do_sample=False,
                           pad_token_id=config.eos_token_id)
    assert out.shape == (1, 15)
    # No weight initialisation at all: no aten op that initialises a tensor
    # runs while the model is built, on the meta device or anywhere else.
    # Read-write, so that no inference mode meets the dispatch mode: the
    # model is built the same way.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    gtf._steps = steps = []
    try:
        with Ops() as ops:
            again = gtf.from_pretrained(name, client=gclient, readonly=False)
    finally:
        gtf._steps = None
    # What torch.nn.init and _init_weights draw weights with (a norm's
    # torch.ones in its constructor may show as fill_, so that is not one).
    init = ops.seen & {"normal_", "uniform_", "random_", "bernoulli_", "erfinv_", "exponential_"}
    assert not init, f"from_pretrained initialised weights: {sorted(init)} among {sorted(ops.seen)}"
    assert [s for s, _ in steps][-1] == "finish" and all(t >= 0 for _, t in steps), steps
    with torch.no_grad():
        assert torch.equal(again(ids).logits, want)
    # Refused, but after torch queued the kernel that faults on the
    # read-only mapping (test_gpu_checkpoint_state_dict): in a process of
    # its own.
    out = child(gpu_daemon.socket, """
        import sys, torch, gpushm.transformers as gtf
        got = gtf.from_pretrained(sys.argv[1])
        try:
            got.model.norm.weight.mul_(2)
        except RuntimeError as e:
            print("refused" if "inference tensor" in str(e) else e)
        try:
            torch.cuda.synchronize()
        except Exception:
            pass
    """, name)
    assert out.strip() == "refused", out
    with pytest.raises(ValueError, match="would need a copy"):
        gtf.from_pretrained(name, client=gclient, torch_dtype=torch.float32)
    with pytest.raises(ValueError, match="would need a copy"):
        gtf.from_pretrained(name, client=gclient, device_map="cpu")
    gclient.put_tensors(name + "single", {"w": torch.ones(2, device="cuda")})
    with pytest.raises(ValueError, match="has no config.json"):
        gtf.from_pretrained(name + "single", client=gclient)


def test_torch_by_uuid(gpu_daemon, gclient, name, torch):
    """A process that sees the segment's GPU under CUDA_VISIBLE_DEVICES=<its
    UUID> (its GPU 0, whatever the daemon's number) maps it there; one that
    cannot see it gets an error naming the GPU. And share() of a tensor puts
    the segment on the tensor's own GPU, matched by UUID."""
    for dev in gclient.info()["devices"]:
        uuid, n = dev["uuid"], dev["index"]
        seg = gclient.create(f"{name}-{n}", shape=(1024,), dtype="float32", device=n)
        assert seg.info.uuid == uuid
        torch.from_dlpack(seg).copy_(torch.arange(1024, dtype=torch.float32, device=f"cuda:{seg.device}"))
        torch.cuda.synchronize()
        out = child(gpu_daemon.socket, """
            import sys, torch, gpushm
            seg = gpushm.connect().open(sys.argv[1])
            t = torch.from_dlpack(seg)
            assert seg.device == 0 and t.device.index == 0, (seg.device, t.device)
            assert (t == torch.arange(1024, dtype=torch.float32, device="cuda")).all()
            u = gpushm.connect().share(sys.argv[1] + "-shared", t * 2)
            print(u.info.uuid)
        """, f"{name}-{n}", env={"CUDA_VISIBLE_DEVICES": uuid})
        assert out.strip().lower() == uuid.lower(), out
        others = [d["uuid"] for d in gclient.info()["devices"] if d["index"] != n]
        if others:
            r = subprocess.run([__import__("sys").executable, "-c", "import sys, gpushm; gpushm.connect().open(sys.argv[1])", f"{name}-{n}"],
                               env=dict(env_for(gpu_daemon.socket), CUDA_VISIBLE_DEVICES=",".join(others)),
                               capture_output=True, text=True)
            assert r.returncode != 0 and "is not among the" in r.stderr, r.stderr


def test_gpu_commit_waits_for_the_writers_kernels(gpu_daemon, name, torch):
    # Readers wait for the name before the writer exists; the writer fills
    # the segment with a slow kernel and commits without synchronizing:
    # commit() must wait for the kernel, so no reader sees old bytes.
    reader = """
        import sys, torch, gpushm
        c = gpushm.connect()
        print("asking", flush=True)
        t = torch.from_dlpack(c.open(sys.argv[1], readonly=True, wait=300))
        print(int((t == 7).sum()), t.numel(), flush=True)
    """
    readers = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(reader), name],
                                env=env_for(gpu_daemon.socket), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for _ in range(3)]
    try:
        for r in readers:
            assert r.stdout.readline().strip() == "asking"
        child(gpu_daemon.socket, """
            import sys, torch, gpushm
            c = gpushm.connect()
            seg = c.create(sys.argv[1], shape=(64 << 20,), dtype="int32", device=0, mode=0o644, uncommitted=True)
            t = torch.from_dlpack(seg)
            torch.cuda._sleep(200_000_000)   # about 0.1 s of GPU time before the fill
            t.fill_(7)
            seg.commit()                     # no synchronize of our own
        """, name)
        for r in readers:
            out, err = r.communicate(timeout=300)
            assert r.returncode == 0, err
            assert out.split() == [str(64 << 20)] * 2
    finally:
        for r in readers:
            r.kill()
            r.wait()
    with gpushm.connect(gpu_daemon.socket) as c:
        c.unlink(name)


def test_gpu_killed_put_is_gone_or_whole(gpu_daemon, tmp_path):
    src = tmp_path / "blob.bin"
    src.write_bytes(os.urandom(256 << 20))
    want = hashlib.sha256(src.read_bytes()).hexdigest()
    env = dict(os.environ, GPUSHM_SOCKET=gpu_daemon.socket)
    put = [os.environ["GPUSHM_BIN"], "put"]
    t0 = time.monotonic()
    subprocess.run(put + ["whole", str(src)], env=env, check=True)
    took = time.monotonic() - t0
    c = gpushm.connect(gpu_daemon.socket)
    c.unlink("whole")
    outcomes = {"whole": 0, "gone": 0}
    for i in range(10):
        p = subprocess.Popen(put + [f"k-{i}", str(src)], env=env, stderr=subprocess.DEVNULL)
        time.sleep(random.uniform(0, took * 1.5))
        p.kill()
        p.wait()
        deadline = time.monotonic() + 60
        while True:
            try:
                seg = c.open(f"k-{i}", True)
            except gpushm.NotFoundError:
                outcomes["gone"] += 1
                break
            except gpushm.NotCommittedError:
                assert time.monotonic() < deadline
                time.sleep(0.01)
                continue
            assert hashlib.sha256(seg.read()).hexdigest() == want, f"k-{i} is served half made"
            seg.close()
            c.unlink(f"k-{i}")
            outcomes["whole"] += 1
            break
    print(f"10 killed puts of 256 MiB on cuda (a put runs {took:.2f}s): {outcomes}")
    c.close()
