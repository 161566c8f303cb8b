"""The safetensors hook's trust on a cuda daemon, where read-only protects
nothing from its holder: the descriptor a read-only open gets is a CUDA
export, which whoever holds it may map read-write (docs/security.md, "What
read-only can and cannot promise"). User nobody, who may read root's
bundle, writes it so; root's loads must never get those bytes. Skips,
saying why, without a GPU or root."""

import os

import numpy as np
import pytest

from gpushm import _cuda
from gpushm import safetensors as gst
from conftest import Daemon
from helpers.stfiles import put_file
from test_hook_trust import _as_nobody, _model, _served, shared_dir  # noqa: F401 (a fixture)


def _reason():
    if os.geteuid() != 0:
        return "needs root to run a client as another user"
    try:
        _cuda.device(0)
    except _cuda.CUDAError as e:
        return f"needs a GPU: {e}"
    return None


_REASON = _reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))


@pytest.fixture(scope="module")
def cuda_daemon():
    d = Daemon("cuda")
    yield d
    d.stop()


@pytest.fixture
def gclient(cuda_daemon, monkeypatch):
    import gpushm
    monkeypatch.setenv("GPUSHM_SOCKET", cuda_daemon.socket)
    gst._holdings.clear()
    c = gpushm.connect(cuda_daemon.socket)
    assert c.backend == "cuda"
    yield c
    c.close()


# nobody opens the bundle read-only, as its mode allows, maps the export
# read-write itself and writes 666.0 over the last n floats.
_WRITE_THROUGH_A_READ_ONLY_OPEN = """
    import ctypes, struct, sys, gpushm
    from gpushm import _cuda
    c = gpushm.connect()
    rep, fd = c._call("open", name=sys.argv[1], readonly=True)
    seg = rep["segment"]
    dev = _cuda.device(0)
    ptr = dev.import_map(fd, seg["alloc_size"], False)
    n = int(sys.argv[2])
    buf = ctypes.create_string_buffer(struct.pack("<f", 666.0) * n)
    _cuda.copy(ptr + seg["size"] - 4 * n, dev, ctypes.addressof(buf), None, 4 * n)
    dev.synchronize()
    print("wrote")
"""


def test_gpu_a_reader_s_writes_are_never_served(gclient, cuda_daemon, name, shared_dir):
    path = _model(shared_dir)
    seg = put_file(gclient, name, path, mode=0o644)
    assert seg.info.handle_type == "cuda_fd"
    assert len(gclient.stat(name).sources) == 1
    out = _as_nobody(cuda_daemon, shared_dir, _WRITE_THROUGH_A_READ_ONLY_OPEN, name, 6)
    assert out.split() == ["wrote"], out
    # nobody's bytes are in root's bundle: the attack worked on the memory.
    assert np.frombuffer(gclient.open(name, readonly=True).tobytes()[-24:], "<f4").tolist() == [666.0] * 6
    # Root's load gets the file's bytes, from disk: neither the bundle
    # others may read, nor the bundle once made private, is served.
    got = _served(path)
    assert got is None or not any((t == 666.0).any() for t in got.values()), got
    gclient._call("chmod", name=name, mode=0o600)
    gst._holdings.clear()
    got = _served(path)
    assert got is None, got
    assert gclient.stat(name).sources == ()


def test_gpu_a_private_bundle_is_served(gclient, name, shared_dir):
    path = _model(shared_dir, value=3.0)
    put_file(gclient, name, path, mode=0o600)
    got = _served(path)
    assert got is not None and all((t == 3.0).all() for t in got.values()), got
