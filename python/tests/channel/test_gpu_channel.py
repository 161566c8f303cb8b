"""Channels on a GPU: torch and CuPy ends in separate processes, ordered by
stream memory operations only (no synchronize on either side), a producer
killed with its GPU work in flight, and a consumer on a second GPU. Every
test skips, saying why, without a GPU (or without CuPy, or a second GPU);
scripts/gpu-channel runs them on the GPU machine."""

import os
import signal

import pytest

import gpushm
from gpushm import _cuda
from conftest import Daemon, Peer


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
def torch():
    return pytest.importorskip("torch", reason="torch is not installed")


# Message k: base + k, base = arange; the producer's stream spins first now
# and then, so that the CPU hands messages over before the GPU wrote them.
TORCH_PRODUCER = """
    import sys, torch, gpushm
    name, count, shape = sys.argv[1], int(sys.argv[2]), (512, 512)
    c = gpushm.connect()
    tx = c.channel(name, shape=shape, dtype="float32", slots=2, device=0)
    base = torch.arange(512 * 512, dtype=torch.float32, device="cuda").reshape(shape)
    s = torch.cuda.Stream()
    print("open", flush=True)
    with torch.cuda.stream(s):             # the current stream is the one send() uses
        for k in range(count):
            with tx.send() as t:
                assert t.is_cuda and t.shape == shape and t.dtype == torch.float32
                if k % 8 == 0:
                    torch.cuda._sleep(1_000_000)
                torch.add(base, k, out=t)
    tx.close()
    print("closed", flush=True)
"""


def test_torch_ends_in_two_processes(gpu_daemon, name, torch):
    count = 300
    p = Peer(gpu_daemon.socket, TORCH_PRODUCER, name, count)
    p.expect("open")
    c = gpushm.connect(gpu_daemon.socket)
    rx = c.channel(name)
    assert rx.framework == "torch" and rx.device == 0
    base = torch.arange(512 * 512, dtype=torch.float32, device="cuda").reshape(512, 512)
    bad = torch.zeros((), dtype=torch.int64, device="cuda")
    n = 0
    for t in rx:
        assert isinstance(t, torch.Tensor) and t.is_cuda
        if n % 8 == 4:
            torch.cuda._sleep(1_000_000)     # slots come back late
        bad += (t != base + n).sum()
        n += 1
    assert n == count
    assert bad.item() == 0
    p.expect("closed")
    p.close()
    rx.close()
    c.close()


def test_cupy_ends_with_explicit_streams(gpu_daemon, name):
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    p = Peer(gpu_daemon.socket, """
        import sys, cupy, gpushm
        c = gpushm.connect()
        tx = c.channel(sys.argv[1], shape=(1 << 16,), dtype="int32", slots=3, framework="cupy")
        s = cupy.cuda.Stream(non_blocking=True)
        print("open", flush=True)
        for k in range(200):
            with tx.send(stream=s) as t:
                assert isinstance(t, cupy.ndarray)
                with s:
                    t[...] = cupy.arange(1 << 16, dtype=cupy.int32) * 3 + k
        tx.close()
        print("closed", flush=True)
    """, name)
    p.expect("open")
    c = gpushm.connect(gpu_daemon.socket)
    rx = c.channel(name, framework="cupy")
    s = cupy.cuda.Stream(non_blocking=True)
    bad = cupy.zeros((), dtype=cupy.int64)
    n = 0
    while True:
        try:
            m = rx.recv(timeout=60, stream=s)
        except EOFError:
            break
        with m as t:
            with s:
                bad += (t != cupy.arange(1 << 16, dtype=cupy.int32) * 3 + m.seq).sum()
        n += 1
    s.synchronize()
    assert n == 200 and int(bad) == 0
    p.expect("closed")
    p.close()
    rx.close()
    c.close()


def test_producer_killed_with_gpu_work_in_flight(gpu_daemon, name, torch):
    """The messages whose writes finished arrive; the one the GPU never
    wrote ends the stream as broken; the consumer's stream never hangs."""
    p = Peer(gpu_daemon.socket, """
        import sys, time, torch, gpushm
        tx = gpushm.connect().channel(sys.argv[1], shape=(1024,), dtype="float32", slots=4)
        print("open", flush=True)
        for k in range(3):
            with tx.send() as t:
                t.fill_(k)
        torch.cuda.synchronize()          # only to set the stage: 0, 1 and 2 are written
        with tx.send() as t:
            torch.cuda._sleep(20_000_000_000)   # seconds of GPU time before the write
            t.fill_(3)
        print("sent", flush=True)
        time.sleep(600)
    """, name)
    p.expect("open")
    c = gpushm.connect(gpu_daemon.socket)
    rx = c.channel(name)
    p.expect("sent")
    os.kill(p.p.pid, signal.SIGKILL)
    p.p.wait()
    for k in range(3):
        with rx.recv(timeout=30) as t:
            assert t[0].item() == k and t[-1].item() == k
    with pytest.raises(gpushm.BrokenMessageError, match="died before it finished message 3"):
        rx.recv(timeout=30)
    torch.cuda.synchronize()              # nothing the consumer queued waits forever
    rx.close()
    c.close()


def test_producer_killed_after_the_consumer_took_its_unwritten_messages(gpu_daemon, name, torch):
    """recv returns before the producer's GPU wrote a message (the stream
    waits, not the CPU): the consumer takes and releases messages 3 and 4
    while their writes are still queued; the producer dies. The next recv
    names message 3, the first unwritten; the work queued on 0 to 2 saw
    them whole; the consumer's stream never hangs."""
    p = Peer(gpu_daemon.socket, """
        import sys, time, torch, gpushm
        tx = gpushm.connect().channel(sys.argv[1], shape=(1024,), dtype="float32", slots=4)
        print("open", flush=True)
        for k in range(3):
            with tx.send() as t:
                t.fill_(k)
        torch.cuda.synchronize()          # only to set the stage: 0, 1 and 2 are written
        for k in range(3, 5):
            with tx.send() as t:
                torch.cuda._sleep(20_000_000_000)   # seconds of GPU time before each write
                t.fill_(k)
        print("sent", flush=True)
        time.sleep(600)
    """, name)
    p.expect("open")
    c = gpushm.connect(gpu_daemon.socket)
    rx = c.channel(name)
    whole = []
    for k in range(5):
        m = rx.recv(timeout=30)
        assert m.seq == k
        with m as t:                      # no synchronization: checked on the GPU
            whole.append((t == k).all())
    p.expect("sent")
    os.kill(p.p.pid, signal.SIGKILL)
    p.p.wait()
    with pytest.raises(gpushm.BrokenMessageError, match="died before it finished message 3;") as e:
        rx.recv(timeout=30)
    assert e.value.seq == 3
    with pytest.raises(EOFError):
        rx.recv(timeout=30)
    torch.cuda.synchronize()              # nothing the consumer queued waits forever
    assert [bool(w.item()) for w in whole[:3]] == [True, True, True]
    rx.close()
    c.close()


def test_consumer_on_a_second_gpu(gpu_daemon, name, torch):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two GPUs; this machine has {torch.cuda.device_count()}")
    count = 100
    p = Peer(gpu_daemon.socket, TORCH_PRODUCER, name, count)
    p.expect("open")
    c = gpushm.connect(gpu_daemon.socket)
    rx = c.channel(name, devices=[1])
    assert rx.device == 1
    base = torch.arange(512 * 512, dtype=torch.float32, device="cuda:1").reshape(512, 512)
    bad = torch.zeros((), dtype=torch.int64, device="cuda:1")
    n = 0
    for t in rx:
        assert t.device == torch.device("cuda", 1)
        bad += (t != base + n).sum()
        n += 1
    assert n == count and bad.item() == 0
    p.expect("closed")
    p.close()
    rx.close()
    c.close()
