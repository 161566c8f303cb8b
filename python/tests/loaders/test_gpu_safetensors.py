"""gpushm.safetensors and gpushm.run against the safetensors library itself,
on a cuda daemon with torch: every dtype torch and the format share, tensor
by tensor equal to what the library reads from the file; get_slice forms
equal to the library's; the device rule (views on the bundle's GPU, copies
elsewhere, GPU views for CPU requests with cpu_tensors="gpu"); and a program
under gpushm.run whose safetensors.torch.load_file and safe_open get views
of the segment. Skips, saying why, without a GPU, torch or safetensors."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import PYDIR, Daemon, env_for
from helpers.stfiles import put_dir, put_file

torch = pytest.importorskip("torch")
st_torch = pytest.importorskip("safetensors.torch")
import safetensors  # noqa: E402
from gpushm import _cuda  # noqa: E402
from gpushm import safetensors as gst  # noqa: E402


def _cuda_reason():
    try:
        _cuda.device(0)
    except _cuda.CUDAError as e:
        return str(e)
    return None if torch.cuda.is_available() else "torch sees no GPU"


_REASON = _cuda_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"needs a GPU: {_REASON}")

DTYPES = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32", "float64",
          "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "uint16", "uint32",
          "uint64", "complex64"]


def _tensors():
    g = torch.Generator().manual_seed(3)
    out = {}
    for i, name in enumerate(DTYPES):
        dt = getattr(torch, name, None)
        if dt is None:
            continue
        shape = [(), (7,), (3, 5), (2, 3, 4)][i % 4]
        raw = torch.randint(0, 256, (max(1, torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size(),),
                            dtype=torch.uint8, generator=g)
        t = raw.view(dt)[:torch.Size(shape).numel()].reshape(shape) if name != "bool" else (raw[:torch.Size(shape).numel()] % 2).bool().reshape(shape)
        try:  # a dtype this version of the library cannot write is left out
            st_torch.save({"t": t})
        except Exception:
            continue
        out[f"t.{name}"] = t.clone()
    out["w"] = torch.randn(64, 48, generator=g).to(torch.bfloat16)
    out["empty"] = torch.zeros(0, 4)
    return out


def _same(a, b):
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.numel() == 0:
        return True
    # reshape first: a 0-dim tensor cannot be viewed as bytes
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8).cpu(), b.contiguous().reshape(-1).view(torch.uint8).cpu())


@pytest.fixture(scope="module")
def cuda_daemon():
    d = Daemon("cuda")
    yield d
    d.stop()


@pytest.fixture
def gclient(cuda_daemon, monkeypatch):
    monkeypatch.setenv("GPUSHM_SOCKET", cuda_daemon.socket)
    for k in ("GPUSHM_CPU_TENSORS", "GPUSHM_SAFETENSORS"):
        monkeypatch.delenv(k, raising=False)
    return gst._client()


def _in_segment(t, name):
    seg = gst._client().open(name, True)
    return seg._m.ptr <= t.data_ptr() < seg._m.ptr + seg._m.size


def test_equal_to_the_library(gclient, name, tmp_path):
    path = tmp_path / "model.safetensors"
    ts = _tensors()
    st_torch.save_file(ts, str(path), metadata={"format": "pt"})
    put_file(gclient, name, path)
    with safetensors.safe_open(str(path), "pt", device="cuda:0") as real, gst.safe_open(path, "pt", device="cuda:0") as f:
        assert f.keys() == real.keys() and f.metadata() == real.metadata()
        if hasattr(real, "offset_keys"):
            assert f.offset_keys() == real.offset_keys()
        for k in real.keys():
            got, want = f.get_tensor(k), real.get_tensor(k)
            assert _same(got, want), k
            assert got.device == torch.device("cuda", 0), k
            if got.numel():  # an empty tensor has no memory to share
                assert gst.shared(got) and _in_segment(got, name), f"{k}: not a view of the segment"
            s, rs = f.get_slice(k), real.get_slice(k)
            assert (s.get_shape(), s.get_dtype()) == (rs.get_shape(), rs.get_dtype()), k
        w, rw = f.get_slice("w"), real.get_slice("w")
        for key in [0, -1, slice(3, 9), (slice(None), slice(8, 24)), (Ellipsis, 5), (slice(1, 60, 7), slice(None, 10))]:
            assert _same(w[key], rw[key]), key
    # CPU requests: copies by default, as the library gives.
    with safetensors.safe_open(str(path), "pt") as real, gst.safe_open(path, "pt") as f:
        for k in real.keys():
            got = f.get_tensor(k)
            assert got.device.type == "cpu" and not gst.shared(got) and _same(got, real.get_tensor(k)), k
        part = f.get_slice("w")[:, 4:8]
        assert part.device.type == "cpu" and _same(part, real.get_slice("w")[:, 4:8])
    with gst.safe_open(path, "pt", cpu_tensors="gpu") as f:
        assert f.get_tensor("w").device == torch.device("cuda", 0)
    with gst.safe_open(path, "pt", device="cuda:0", copy=True) as f:
        t = f.get_tensor("w")
        assert not gst.shared(t) and not _in_segment(t, name)
    got = gst.load_file(str(path), device="cuda:0")
    want = st_torch.load_file(str(path), device="cuda:0")
    assert list(got) == list(want) and all(_same(got[k], want[k]) for k in want)


def test_shards_and_the_hook(gclient, cuda_daemon, name, tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    a = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)}
    b = {"c": torch.full((4, 4), 3, dtype=torch.int64)}
    pa, pb = d / "model-00001-of-00002.safetensors", d / "model-00002-of-00002.safetensors"
    st_torch.save_file(a, str(pa), metadata={"format": "pt"})
    st_torch.save_file(b, str(pb), metadata={"format": "pt"})
    put_dir(gclient, name, [pa, pb])
    other = d / "other.safetensors"
    st_torch.save_file({"x": torch.ones(2)}, str(other))
    prog = textwrap.dedent('''
        import json, sys, torch
        from safetensors import safe_open
        from safetensors.torch import load_file
        import gpushm.safetensors as gst
        pa, pb, other = sys.argv[1:4]
        sd = load_file(pa, device="cuda:0")
        seg = gst._client().open(gst.held(pa).name, True)
        out = {"keys": list(sd), "in_segment": all(seg._m.ptr <= t.data_ptr() < seg._m.ptr + seg._m.size for t in sd.values()),
               "a": sd["a"].sum().item()}
        with safe_open(pb, framework="pt", device="cpu") as f:
            t = f.get_tensor("c")
            out["cpu"] = [t.device.type, t.sum().item(), f.metadata()]
        out["other"] = type(safe_open(other, framework="pt")).__module__
        print(json.dumps(out))
    ''')
    e = env_for(cuda_daemon.socket)
    e["PYTHONPATH"] = str(PYDIR)
    for mode, want_cpu in (("copy", "cpu"), ("gpu", "cuda")):
        r = subprocess.run([sys.executable, "-m", "gpushm.run", f"--cpu-tensors={mode}", "-c", prog, pa, pb, other],
                           env=e, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["keys"] == ["a", "b"] and out["in_segment"] and out["a"] == 66.0, out
        assert out["cpu"] == [want_cpu, 48, {"format": "pt"}], out
        assert out["other"] != "gpushm.safetensors", out
        assert r.stderr == "", r.stderr
