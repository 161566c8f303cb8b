"""cpu_tensors="auto", the default of python -m gpushm.run: a CPU request on
a GPU bundle gets what the loader that made it does next allows
(gpushm.safetensors.next_step): views for vLLM's and SGLang's loaders,
private GPU copies for transformers' from_pretrained onto CUDA devices, and
the file from disk for anything else. The loader is found on the call
stack, so these tests run code under the loaders' module names. The GPU
half (what each answer is on a real GPU, and how fast) is
python/tests/gpu/gpu_loaders.py and python/bench/bench_default.py."""

import json
import textwrap

import numpy as np
import pytest

from conftest import PYDIR
from gpushm import safetensors as gst
from test_run import fake, run  # noqa: F401  (fake: a fixture)
from helpers.stfiles import put_file, write


BENCH = PYDIR / "bench"


def _in_module(module, src, **names):
    """Runs src (which defines f) as if it were code of module, and
    returns f: its frames carry that module's __name__."""
    g = {"__name__": module, **names}
    exec(textwrap.dedent(src), g)
    return g["f"]


class _Device:
    """What torch.device looks like to the rule: a type and an index."""

    def __init__(self, type, index=None):
        self.type, self.index = type, index


CALLER = """
def f():
    return next_step()
"""

TRANSFORMERS = """
def f(device_map, hf_quantizer=None, inner_quantizer=None):
    def _load_pretrained_model(hf_quantizer):
        device = "cpu"  # what transformers 5.17 passes to safe_open
        return next_step()
    return _load_pretrained_model(inner_quantizer)
"""


@pytest.mark.parametrize("module,want", [
    ("vllm.model_executor.model_loader.weight_utils", "gpu"),
    ("vllm.model_executor.model_loader", "gpu"),
    ("sglang.srt.model_loader.weight_utils", "gpu"),
    ("vllm.model_executor.model_loader_extra", None),   # only the package and its modules
    ("vllm.entrypoints.llm", None),
    ("myloader", None),
    ("__main__", None),
])
def test_engines_by_module(module, want):
    assert _in_module(module, CALLER, next_step=gst.next_step)() == want


@pytest.mark.parametrize("device_map,quantizer,want", [
    ({"": _Device("cuda", 0)}, None, "cuda:0"),       # device_map="cuda", as transformers resolves it
    ({"": _Device("cuda")}, None, "cuda"),            # the current device
    ({"": 0}, None, "cuda:0"),                         # "auto" on one GPU
    ({"": 1}, None, "cuda:1"),
    ({"a": "cuda:1", "b": _Device("cuda", 1)}, None, "cuda:1"),
    ({"": "cuda"}, None, "cuda"),
    ({"model.embed": 0, "lm_head": "cuda:1"}, None, None),  # two GPUs: which one a tensor goes to is unknown
    ({"model.embed": 0, "lm_head": "cpu"}, None, None),     # part offloaded: the CPU tensor is kept
    ({"": "disk"}, None, None),
    ({}, None, None),
    (None, None, None),                                # no device_map: the model stays on the CPU
    ({"": True}, None, None),                          # a bool is not an ordinal
    ({"": -1}, None, None),
    ({"": "cuda:x"}, None, None),
    ({"": 0}, object(), None),                         # a quantizer reads the CPU tensor itself
])
def test_transformers_by_device_map(device_map, quantizer, want):
    f = _in_module("transformers.modeling_utils", TRANSFORMERS, next_step=gst.next_step)
    assert f(device_map, quantizer) == want
    # The quantizer held by the frame nearer the open instead.
    assert f(device_map, None, quantizer) == want


def test_innermost_loader_decides():
    # transformers called from inside a vLLM frame (vLLM's own HF fallback
    # would look so): the innermost loader on the stack decides.
    tf = _in_module("transformers.modeling_utils", TRANSFORMERS, next_step=gst.next_step)
    outer = _in_module("vllm.model_executor.model_loader.default_loader", "def f():\n    return tf(None)\n", tf=tf)
    assert outer() is None
    inner = _in_module("transformers.modeling_utils", "def f():\n    return g()\n",
                       g=_in_module("vllm.model_executor.model_loader.weight_utils", CALLER, next_step=gst.next_step))
    assert inner() == "gpu"


def test_a_loader_far_up_the_stack():
    deep = _in_module("helpers", "def f(n):\n    return f(n - 1) if n else next_step()\n", next_step=gst.next_step)
    f = _in_module("sglang.srt.model_loader.loader", "def f(n):\n    return deep(n)\n", deep=deep)
    assert f(10) == "gpu"
    assert f(gst._DEPTH + 5) is None  # past the depth looked at: as anything else


# ---- through the hook, a real daemon, a second process -------------------------

PROGRAM = '''
    import json, sys
    import gpushm.safetensors as gst
    from safetensors import safe_open

    # The bundle is host memory here (no GPU): the program says it is on a
    # GPU, so that the hook takes its GPU path; the tensors it then serves
    # are the host segment's views.
    real = gst.held
    def held(*a, **kw):
        h = real(*a, **kw)
        if h is not None:
            h.gpu = True
        return h
    gst.held = held

    path, module = sys.argv[1:3]
    if module.startswith("engine:"):  # the engine loop stand-in, as the benchmarks run it
        import _engine_loops
        loops = _engine_loops.as_engine(module[7:])
        opened = []
        def recording(*a, **kw):
            f = safe_open(*a, **kw)
            opened.append(type(f).__module__)
            return f
        got = dict(loops.vllm_iterate(recording, [path], framework="np"))
        served_by, x = opened[0], got["x"].tolist()
    else:
        ns = {"safe_open": safe_open, "path": path, "__name__": module}
        exec("def load():\\n"
             "    with safe_open(path, framework='np') as f:\\n"
             "        return type(f).__module__, f.get_tensor('x').tolist()\\n", ns)
        served_by, x = ns["load"]()
    import safetensors
    print(json.dumps({"served_by": served_by, "x": x, "reads": list(safetensors.READS)}))
'''


@pytest.mark.parametrize("module,mode,served", [
    ("__main__", None, False),                                          # the default: the disk, as without gpushm
    ("vllm.model_executor.model_loader.weight_utils", None, True),     # vLLM's loop: the bundle
    ("sglang.srt.model_loader.weight_utils", None, True),
    ("engine:vllm", None, True),                                        # _engine_loops.as_engine("vllm")
    ("engine:sglang", None, True),
    ("__main__", "gpu", True),                                          # --cpu-tensors=gpu: the bundle, whoever asks
    ("__main__", "copy", True),                                         # --cpu-tensors=copy: the bundle, copied
])
def test_hook_decides_by_the_loader(client, daemon, name, fake, tmp_path, module, mode, served):
    held = tmp_path / "model.safetensors"
    write(held, {"x": np.arange(4, dtype=np.float32)})
    put_file(client, name, held)
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(PROGRAM))
    r = run(daemon, [*([f"--cpu-tensors={mode}"] if mode else []), prog, held, module], [fake, BENCH])
    out = json.loads(r.stdout)
    assert out["x"] == [0, 1, 2, 3]
    if served:
        assert out["served_by"] == "gpushm.safetensors" and out["reads"] == [], out
    else:
        assert out["served_by"] != "gpushm.safetensors" and out["reads"] == [str(held)], out
    assert "gpushm:" not in r.stderr, r.stderr
