"""gpushm.safetensors on the host backend, with numpy: the safetensors API
over a bundle named directly or by the path of a file that was put, tensor
by tensor equal to what the file holds, for every dtype of the format;
slices that are views of only the slice; one shard of a directory's
bundle; and files that changed since they were put, read from disk."""

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

import gpushm
from gpushm import safetensors as gst
from helpers.stfiles import every_dtype, parse, put_dir, put_file, write

try:
    import ml_dtypes  # noqa: F401
except ImportError:
    ml_dtypes = None


@pytest.fixture(autouse=True)
def _socket(daemon, monkeypatch):
    # gpushm.safetensors' own connection goes to the test daemon.
    monkeypatch.setenv("GPUSHM_SOCKET", daemon.socket)
    monkeypatch.delenv("GPUSHM_CPU_TENSORS", raising=False)
    monkeypatch.delenv("GPUSHM_SAFETENSORS", raising=False)


def _in_segment(a, name):
    """Whether a's memory lies in the read-only mapping of segment name
    that gpushm.safetensors' connection has."""
    seg = gst._client().open(name, True)
    p = a.__array_interface__["data"][0]
    return seg._m.ptr <= p and p + a.nbytes <= seg._m.ptr + seg._m.size


@pytest.mark.parametrize("how", ["name", "path"])
def test_every_dtype(client, name, tmp_path, how):
    tensors = every_dtype()
    path = tmp_path / "model.safetensors"
    write(path, tensors, {"format": "np", "step": "3"})
    put_file(client, name, path)
    meta, want = parse(path)

    with gst.safe_open(name if how == "name" else path, framework="numpy") as f:
        assert f.keys() == sorted(want)
        assert f.offset_keys() == list(want)                        # written in data order
        assert f.metadata() == meta == {"format": "np", "step": "3"}
        for k, (st, shape, raw) in want.items():
            s = f.get_slice(k)
            assert (s.get_dtype(), s.get_shape()) == (st, list(shape)), k
            v = f._view(k)
            assert v.tobytes() == raw, k                              # byte for byte, bf16 and fp8 included
            if st in stfiles_raw() and ml_dtypes is None:
                with pytest.raises(TypeError, match="ml_dtypes"):
                    f.get_tensor(k)
                continue
            a = f.get_tensor(k)
            assert a.shape == shape and a.tobytes() == raw, k
            assert not a.flags.writeable, k
            if a.size:
                assert _in_segment(a, name), f"{k} is not a view of the segment"
        with pytest.raises(gpushm.safetensors.SafetensorError, match="does not contain tensor nope"):
            f.get_tensor("nope")
    with pytest.raises(gst.SafetensorError, match="File is closed"):
        f.keys()

    if ml_dtypes is None:  # as the library: numpy has no bfloat16 without it
        with pytest.raises(TypeError, match="ml_dtypes"):
            gst.load_file(name if how == "name" else str(path), framework="numpy")
        return
    got = gst.load_file(name if how == "name" else str(path), framework="numpy")
    assert list(got) == list(want)
    for k, a in got.items():
        assert a.tobytes() == want[k][2]


def stfiles_raw():
    from helpers.stfiles import RAW
    return RAW


def test_get_slice_indexing(client, name, tmp_path):
    full = np.arange(4 * 6 * 5, dtype=np.float32).reshape(4, 6, 5)
    path = tmp_path / "w.safetensors"
    write(path, {"w": full, "v": np.arange(7, dtype=np.int64)})
    put_file(client, name, path)
    keys = [1, -1, slice(1, 3), (slice(None), 2), (Ellipsis, 1), (1, Ellipsis, slice(2, 4)), slice(None, None, 2),
            (slice(None), slice(1, 5, 2), -1), slice(2, 2), (), Ellipsis, (slice(-3, None), slice(None, -1)),
            (3, 5, 4), (slice(10, 20),), (slice(1, 2), slice(0, 6, 4), slice(None, None, 3))]
    with gst.safe_open(path, "np") as f:
        s = f.get_slice("w")
        assert s.get_shape() == [4, 6, 5] and s.get_dtype() == "F32" and len(s) == 4
        for key in keys:
            got, want = s[key], full[key]
            assert got.shape == want.shape and np.array_equal(got, want), key
            if got.size:
                assert _in_segment(got, name), f"{key!r}: not a view of the segment"
        assert np.array_equal(f.get_slice("v")[2:5], np.arange(2, 5))
        for key, err in [(4, IndexError), ((0, 0, 0, 0), IndexError), (slice(None, None, -1), ValueError),
                         ((Ellipsis, Ellipsis), IndexError), ("a", TypeError), ([0, 1], TypeError)]:
            with pytest.raises(err):
                s[key]


def test_directory_shard(client, name, tmp_path):
    a = {"a.w": np.arange(12, dtype=np.float32).reshape(3, 4), "a.b": np.arange(5, dtype=np.uint8)}
    b = {"b.w": np.full((2, 2), 7, np.int32), "b.z": np.zeros((0,), np.float16)}
    pa, pb = tmp_path / "model-00001-of-00002.safetensors", tmp_path / "model-00002-of-00002.safetensors"
    write(pa, a, {"format": "pt"})
    write(pb, b, {"format": "pt", "shard": "2"})
    put_dir(client, name, [pa, pb])

    with gst.safe_open(pb, "numpy") as f:                             # only the shard's own tensors
        assert f.keys() == ["b.w", "b.z"] and f.metadata() == {"format": "pt", "shard": "2"}
        assert np.array_equal(f.get_tensor("b.w"), b["b.w"]) and f.get_tensor("b.z").shape == (0,)
        with pytest.raises(gst.SafetensorError):
            f.get_tensor("a.w")
    got = gst.load_file(pa, framework="numpy")
    assert list(got) == list(a) and all(np.array_equal(got[k], a[k]) for k in a)
    with gst.safe_open(name, "numpy") as f:                          # the whole bundle by name
        assert f.keys() == sorted([*a, *b])


def test_changed_files_are_not_served(client, name, tmp_path, capfd):
    path = tmp_path / "model.safetensors"
    write(path, {"x": np.ones(4, np.float32)})
    put_file(client, name, path)
    assert gst.held(str(path)) is not None
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert gst.held(str(path)) is None
    err = capfd.readouterr().err
    assert f"gpushm: reading model.safetensors from disk: changed since it was put in {name!r} (mtime, ctime)" in err, err
    with pytest.raises(gpushm.NotFoundError, match="is not held by gpushm"):
        gst.safe_open(path, "np")

    # Not put at all, or another file of the same name in another directory.
    other = tmp_path / "other"
    other.mkdir()
    write(other / "model.safetensors", {"x": np.ones(4, np.float32)})
    assert gst.held(str(other / "model.safetensors")) is None
    assert gst.held(str(tmp_path / "missing.safetensors")) is None


def test_held_by_the_daemon_s_record(client, name, tmp_path):
    path = tmp_path / "model.safetensors"
    write(path, {"x": np.ones(4, np.float32)})
    put_file(client, name, path)
    # Found by the file's device and inode in the sources the daemon
    # recorded as it filled the bundle; the owner rule reads stat's uid.
    h = gst._Holdings(client)
    h.refresh()
    st = os.stat(path)
    found, _ = h.find(st, client.peer_uid)
    assert found is not None and found.name == name
    assert [(s.offset, s.at, s.len) for s in found.sources] == [(0, 0, st.st_size)]
    # Other users' bundles: test_hook_trust.py.


def test_bundle_without_origin_by_name_only(client, name, tmp_path):
    path = tmp_path / "model.safetensors"
    write(path, {"x": np.arange(3, dtype=np.int16)})
    put_file(client, name, path, origin=False)
    assert gst.held(str(path)) is None
    assert np.array_equal(gst.load(name, framework="numpy")["x"], np.arange(3, dtype=np.int16))


def test_put_by_the_binary_records_origin(client, daemon, name, tmp_path):
    path = tmp_path / "model.safetensors"
    write(path, {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}, {"format": "pt"})
    r = subprocess.run([os.environ["GPUSHM_BIN"], "--socket", daemon.socket, "put", name, str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    meta = client.stat(name).meta
    if "origin" not in meta:
        pytest.skip(f"this gpushm binary's put records no origin yet (meta: {json.dumps(meta)})")
    with gst.safe_open(str(path), "np") as f:
        assert f.metadata() == {"format": "pt"}
        assert np.array_equal(f.get_tensor("x"), np.arange(6, dtype=np.float32).reshape(2, 3))


def test_tensors_models_write_are_private(client, name, tmp_path):
    # BatchNorm's running statistics and quantization scales are written
    # after loading: they come as private, writable copies; the weights
    # beside them stay read-only views of the segment.
    rng = np.random.default_rng(5)
    tensors = {"bn.weight": rng.standard_normal(8).astype(np.float32),
               "bn.running_mean": rng.standard_normal(8).astype(np.float32),
               "bn.running_var": rng.random(8).astype(np.float32),
               "bn.num_batches_tracked": np.array(3, np.int64),
               "fc.weight": rng.standard_normal((4, 8)).astype(np.float32),
               "fc.weight_scale": np.array([0.5], np.float32),
               "fc.input_scale_inv": np.array([2.0], np.float32)}
    path = tmp_path / "bn.safetensors"
    write(path, tensors)
    put_file(client, name, path)
    with gst.safe_open(path, framework="numpy") as f:
        for k, want in tensors.items():
            got = f.get_tensor(k)
            assert np.array_equal(got, want), k
            private = gst.written_after_load(k)
            assert private == (k not in ("bn.weight", "fc.weight")), k
            assert got.flags.writeable == private, k
            assert _in_segment(got, name) != private, k
            part = f.get_slice(k)[...]
            assert part.flags.writeable == private and _in_segment(part, name) != private, k
        m = f.get_tensor("bn.running_mean")
        m += 1  # a private copy: the segment keeps the checkpoint's values
        assert np.array_equal(f.get_tensor("bn.running_mean"), tensors["bn.running_mean"])


def test_errors_are_the_library_s_too(client, name, tmp_path, monkeypatch):
    # Where the safetensors library is loaded, a missing tensor raises an
    # error that both its except clauses and ours catch.
    lib = types.ModuleType("safetensors")

    class LibraryError(Exception):
        pass

    lib.SafetensorError = LibraryError
    monkeypatch.setitem(sys.modules, "safetensors", lib)
    p = tmp_path / "model.safetensors"
    write(p, {"w": np.arange(4, dtype=np.float32)}, None)
    put_dir(client, name, [p])
    with gst.safe_open(p, "numpy") as f:
        for cls in (LibraryError, gst.SafetensorError):
            with pytest.raises(cls, match="does not contain tensor nope"):
                f.get_tensor("nope")
