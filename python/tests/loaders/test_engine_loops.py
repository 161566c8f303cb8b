"""The engine loops of python/bench/_engine_loops.py on the CPU, against a
stand-in for ``safe_open`` that serves numpy arrays (framework "np") and
records every call, so that the tests check both what the loops load and
which safetensors calls they make (the engines' calls, no more)."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import _engine_loops as loops  # noqa: E402


class _Slice:
    def __init__(self, owner, name, array):
        self._owner, self._name, self._a = owner, name, array

    def get_shape(self):
        return list(self._a.shape)

    def __getitem__(self, index):
        self._owner.calls.append(("slice_getitem", self._name))
        return np.array(self._a[index])


class _Handle:
    def __init__(self, owner, path, framework, device):
        self._owner, self._path = owner, path
        self._tensors = owner.files[path]
        self.framework, self.device = framework, device

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._owner.calls.append(("close", self._path))
        return False

    def keys(self):
        return list(self._tensors)

    def metadata(self):
        return {"format": "np"}

    def get_tensor(self, name):
        self._owner.calls.append(("get_tensor", name))
        return np.array(self._tensors[name])  # a copy, as a CPU read is

    def get_slice(self, name):
        self._owner.calls.append(("get_slice", name))
        return _Slice(self._owner, name, self._tensors[name])


class FakeSafeOpen:
    """``safe_open(path, framework, device=...)`` over in-memory files."""

    def __init__(self, files):
        self.files = files
        self.calls = []

    def __call__(self, path, framework, **kw):
        if framework != "np":
            raise ValueError(f"this stand-in serves numpy only, not {framework!r}")
        self.calls.append(("safe_open", path, framework, tuple(sorted(kw.items()))))
        return _Handle(self, path, framework, kw.get("device", "cpu"))

    def load_file(self, path, device="cpu"):
        self.calls.append(("load_file", path, device))
        return {k: np.array(v) for k, v in self.files[path].items()}

    def of(self, kind):
        return [c for c in self.calls if c[0] == kind]


H, I, V = 8, 12, 16  # hidden, intermediate, vocab: divisible by 1, 2 and 4


def _checkpoint():
    rng = np.random.default_rng(26)

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    files = {
        "model-00001-of-00002.safetensors": {
            "model.embed_tokens.weight": r(V, H),
            "model.layers.0.input_layernorm.weight": r(H),
            "model.layers.0.self_attn.q_proj.weight": r(H, H),
            "model.layers.0.self_attn.k_proj.weight": r(H, H),
            "model.layers.0.self_attn.v_proj.weight": r(H, H),
            "model.layers.0.self_attn.o_proj.weight": r(H, H),
        },
        "model-00002-of-00002.safetensors": {
            "model.layers.0.mlp.gate_proj.weight": r(I, H),
            "model.layers.0.mlp.up_proj.weight": r(I, H),
            "model.layers.0.mlp.down_proj.weight": r(H, I),
            "model.layers.0.post_attention_layernorm.weight": r(H),
            "model.norm.weight": r(H),
            "lm_head.weight": r(V, H),
            "model.layers.0.self_attn.k_scale": np.array(0.5, dtype=np.float32),
            "rotary.unused_by_the_model": r(4),
        },
    }
    return files


def _params(files, tp_size):
    """The engine's preallocated per-rank parameters: every tensor but one
    the model does not have, split on its shard dimension."""
    params = {}
    for tensors in files.values():
        for name, a in tensors.items():
            if name.startswith("rotary."):
                continue
            shape = list(a.shape)
            dim = loops.llama_shard_dim(name)
            if dim is not None:
                shape[dim] //= tp_size
            params[name] = np.full(shape, np.nan, dtype=a.dtype)
    return params


def test_import_leaves_torch_alone():
    # The module imports torch only inside the "pt" paths.
    code = "import sys, _engine_loops; assert 'torch' not in sys.modules"
    import subprocess

    env_path = str(Path(__file__).resolve().parents[2] / "bench")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=env_path)


def test_shard_dims():
    d = loops.llama_shard_dim
    assert d("model.layers.3.self_attn.q_proj.weight") == 0
    assert d("model.layers.3.mlp.up_proj.weight") == 0
    assert d("model.layers.3.self_attn.o_proj.weight") == 1
    assert d("model.layers.3.mlp.down_proj.weight") == 1
    assert d("model.embed_tokens.weight") == 0
    assert d("lm_head.weight") == 0
    assert d("model.norm.weight") is None
    assert d("model.layers.3.self_attn.k_scale") is None


def test_vllm_iterate_calls_and_order():
    files = _checkpoint()
    so = FakeSafeOpen(files)
    got = list(loops.vllm_iterate(so, list(files), framework="np"))
    want = [(n, a) for t in files.values() for n, a in t.items()]
    assert [n for n, _ in got] == [n for n, _ in want]
    for (_, a), (_, b) in zip(got, want):
        np.testing.assert_array_equal(a, b)
    # vLLM's call: safe_open(st_file, framework=...) with no device=, one
    # get_tensor per key, never get_slice, each file closed after its keys.
    assert so.of("safe_open") == [("safe_open", f, "np", ()) for f in files]
    assert len(so.of("get_tensor")) == len(want)
    assert so.of("get_slice") == []
    assert so.of("close") == [("close", f) for f in files]


def test_sglang_iterate_both_paths():
    files = _checkpoint()
    so = FakeSafeOpen(files)
    names = [n for n, _ in loops.sglang_iterate(so, list(files), framework="np")]
    assert names == [n for t in files.values() for n in t]
    assert so.of("safe_open") == [("safe_open", f, "np", ()) for f in files]
    assert so.of("get_slice") == []

    so = FakeSafeOpen(files)
    names = [n for n, _ in loops.sglang_iterate(
        so, list(files), framework="np", is_all_weights_sharded=True, load_file=so.load_file)]
    assert names == [n for t in files.values() for n in t]
    assert so.of("load_file") == [("load_file", f, "cpu") for f in files]
    assert so.of("safe_open") == []
    with pytest.raises(ValueError):
        list(loops.sglang_iterate(so, list(files), framework="np", is_all_weights_sharded=True))


def test_fastsafetensors_emulation_device_and_groups():
    assert loops.vllm_fastsafetensors_device(3) == "cuda:3"
    files = _checkpoint()
    so = FakeSafeOpen(files)
    names = [n for n, _ in loops.vllm_fastsafetensors_emulated(
        so, list(files), rank=0, world_size=2, framework="np")]
    assert names == [n for t in files.values() for n in t]
    # With "np" the device is the CPU; with "pt" it would be cuda:{rank}.
    assert so.of("safe_open") == [("safe_open", f, "np", (("device", "cpu"),)) for f in files]


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("loader", ["vllm", "sglang", "sglang_sharded", "get_slice"])
def test_load_into_reassembles(tp_size, loader):
    files = _checkpoint()
    ranks = []
    for rank in range(tp_size):
        so = FakeSafeOpen(files)
        params = _params(files, tp_size)
        if loader == "vllm":
            loaded = loops.load_into(params, list(files), rank, tp_size,
                                     safe_open=so, framework="np")
        elif loader == "sglang":
            loaded = loops.sglang_load_into(params, list(files), rank, tp_size,
                                            safe_open=so, framework="np")
        elif loader == "sglang_sharded":
            loaded = loops.sglang_load_into(params, list(files), rank, tp_size, safe_open=so,
                                            framework="np", is_all_weights_sharded=True,
                                            load_file=so.load_file)
        else:
            loaded = loops.load_into_get_slice(params, list(files), rank, tp_size,
                                               safe_open=so, framework="np")
        assert loaded == set(params)
        for name, p in params.items():
            assert not np.isnan(p).any(), name
        if loader in ("vllm", "sglang"):
            # The engines read every tensor whole, on every rank.
            assert len(so.of("get_tensor")) == sum(len(t) for t in files.values())
            assert so.of("get_slice") == []
        if loader == "get_slice":
            assert len(so.of("get_slice")) == len(params)
            # Only a 0-d tensor (nothing to slice) is read with get_tensor.
            assert [c[1] for c in so.of("get_tensor")] == ["model.layers.0.self_attn.k_scale"]
        ranks.append(params)

    for tensors in files.values():
        for name, full in tensors.items():
            if name.startswith("rotary."):
                continue
            dim = loops.llama_shard_dim(name)
            if dim is None:
                for params in ranks:
                    np.testing.assert_array_equal(params[name], full)
            else:
                whole = np.concatenate([params[name] for params in ranks], axis=dim)
                np.testing.assert_array_equal(whole, full)


def test_load_into_narrows_the_right_part():
    files = _checkpoint()
    so = FakeSafeOpen(files)
    params = _params(files, 4)
    loops.load_into(params, list(files), 2, 4, safe_open=so, framework="np")
    t = files["model-00001-of-00002.safetensors"]
    np.testing.assert_array_equal(params["model.layers.0.self_attn.q_proj.weight"],
                                  t["model.layers.0.self_attn.q_proj.weight"][4:6, :])
    np.testing.assert_array_equal(params["model.layers.0.self_attn.o_proj.weight"],
                                  t["model.layers.0.self_attn.o_proj.weight"][:, 4:6])
    assert params["model.layers.0.self_attn.k_scale"].item() == 0.5


def test_load_into_rejects_mismatches():
    files = _checkpoint()
    params = _params(files, 2)
    with pytest.raises(ValueError, match="1/4"):
        loops.load_into(params, list(files), 0, 4, safe_open=FakeSafeOpen(files), framework="np")
    with pytest.raises(ValueError, match="tp_rank"):
        loops.load_into(params, list(files), 2, 2, safe_open=FakeSafeOpen(files), framework="np")
    params = _params(files, 1)
    params["model.norm.weight"] = np.zeros(H + 1, dtype=np.float32)
    with pytest.raises(ValueError, match="model.norm.weight"):
        loops.load_into(params, list(files), 0, 1, safe_open=FakeSafeOpen(files), framework="np")
    with pytest.raises(ValueError, match="framework"):
        loops.load_into({}, [], 0, 1, safe_open=FakeSafeOpen({}), framework="jax")
