"""python -m gpushm.run and the hook it installs, with a stand-in for the
safetensors library (gpushm.testing's small pure-Python package of the same
name, which records every file it reads): a file gpushm holds is served from
the bundle and never read by the library; a file not put, or changed since,
is read by the library (the second with a notice); a program that never
imports safetensors never imports gpushm; a sitecustomize already on the
path still runs."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import PYDIR, env_for
from gpushm.testing import safetensors_standin
from helpers.stfiles import put_dir, put_file, write

PROGRAM = '''
    import json, sys
    import safetensors.numpy
    from safetensors import safe_open
    from safetensors.torch import load_file as torch_load_file, safe_open as torch_safe_open
    import safetensors.torch

    held, dir_shard, not_put, changed = sys.argv[1:5]
    out = {"finder": type(sys.meta_path[0]).__name__}
    with safe_open(held, framework="np") as f:
        a = f.get_tensor("x")
        out["served_by"] = type(f).__module__
        out["keys"], out["metadata"] = f.keys(), f.metadata()
        out["x"], out["writeable"] = a.tolist(), bool(a.flags.writeable)
        out["slice"] = f.get_slice("x")[1:3].tolist()
    # The array lies in the segment this process mapped.
    import gpushm.safetensors as gst
    h = gst.held(held)
    seg = gst._client().open(h.name, True)
    p = a.__array_interface__["data"][0]
    out["in_segment"] = seg._m.ptr <= p < seg._m.ptr + seg._m.size
    out["numpy_load_file"] = {k: v.tolist() for k, v in safetensors.numpy.load_file(dir_shard).items()}
    out["not_put"] = safetensors.numpy.load_file(not_put)["x"].tolist()
    with safe_open(changed, framework="numpy") as f:
        out["changed"] = f.get_tensor("x").tolist()
    out["wrapped"] = [getattr(fn, "_gpushm_real", None) is not None for fn in (
        safe_open, torch_safe_open, torch_load_file, safetensors.numpy.load_file, safetensors.torch.load_file)]
    out["torch_load_unwrapped"] = not hasattr(safetensors.torch.load, "_gpushm_real")
    out["reads"] = list(safetensors.READS)
    print(json.dumps(out))
'''


@pytest.fixture
def fake(tmp_path):
    return safetensors_standin(tmp_path / "fake")


def run(daemon, args, pythonpath=(), env=None, check=True):
    e = env_for(daemon.socket)
    e["PYTHONPATH"] = os.pathsep.join([*map(str, pythonpath), str(PYDIR)])
    e.update(env or {})
    for k in ("GPUSHM_SAFETENSORS", "GPUSHM_CPU_TENSORS"):
        if k not in (env or {}):
            e.pop(k, None)
    r = subprocess.run([sys.executable, "-m", "gpushm.run", *map(str, args)], env=e, capture_output=True, text=True,
                       timeout=120)
    if check and r.returncode != 0:
        pytest.fail(f"gpushm.run failed ({r.returncode}):\n{r.stderr}\nstdout:\n{r.stdout}")
    return r


def test_hook_serves_held_files(client, daemon, name, fake, tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    held = models / "model.safetensors"
    write(held, {"x": np.arange(5, dtype=np.float32)}, {"format": "np"})
    put_file(client, name, held)
    sharded = models / "sharded"
    sharded.mkdir()
    s1, s2 = sharded / "model-00001-of-00002.safetensors", sharded / "model-00002-of-00002.safetensors"
    write(s1, {"a": np.arange(3, dtype=np.int64)})
    write(s2, {"b": np.arange(4, dtype=np.uint8), "c": np.ones(2, np.float32)})
    put_dir(client, name + "-dir", [s1, s2])
    not_put = models / "other.safetensors"
    write(not_put, {"x": np.arange(2, dtype=np.int64)})
    changed = models / "changed.safetensors"
    write(changed, {"x": np.arange(3, dtype=np.float32)})
    put_file(client, name + "-changed", changed)
    with open(changed, "r+b") as f:  # same size, new mtime and ctime
        f.seek(os.path.getsize(changed) - 4)
        f.write(np.float32(9).tobytes())

    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(PROGRAM))
    r = run(daemon, [prog, held, s2, not_put, changed], [fake])
    out = json.loads(r.stdout)
    assert out["finder"] == "_Finder"
    assert out["served_by"] == "gpushm.safetensors"
    assert out["keys"] == ["x"] and out["metadata"] == {"format": "np"}
    assert out["x"] == [0, 1, 2, 3, 4] and out["slice"] == [1, 2] and out["writeable"] is False
    assert out["in_segment"] is True
    assert out["numpy_load_file"] == {"b": [0, 1, 2, 3], "c": [1.0, 1.0]}     # only the shard's tensors
    assert out["not_put"] == [0, 1]
    assert out["changed"] == [0.0, 1.0, 9.0]                                    # what the disk has now
    assert out["wrapped"] == [True] * 5 and out["torch_load_unwrapped"]
    assert out["reads"] == [str(not_put), str(changed)], "the library read a file gpushm holds"
    assert r.stderr.count("gpushm: ") == 1, r.stderr
    assert f"gpushm: reading changed.safetensors from disk: changed since it was put in '{name}-changed' (mtime, ctime)" in r.stderr


def test_no_daemon_falls_through(daemon, fake, tmp_path):
    f = tmp_path / "m.safetensors"
    write(f, {"x": np.arange(2, dtype=np.int64)})
    r = run(daemon, ["-c", f"import safetensors.numpy as n; print(n.load_file({str(f)!r})['x'].tolist())"], [fake],
            env={"GPUSHM_SOCKET": str(tmp_path / "nobody.sock")})
    assert r.stdout.strip() == "[0, 1]" and r.stderr == "", r.stderr


def test_programs_without_safetensors_import_nothing(daemon, tmp_path):
    # A sitecustomize already on the path runs too.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['EARLIER_SITECUSTOMIZE'] = 'ran'\n")
    code = ("import sys, os, json; print(json.dumps([sorted(m for m in sys.modules if 'gpushm' in m), "
            "type(sys.meta_path[0]).__name__, os.environ.get('EARLIER_SITECUSTOMIZE')]))")
    r = run(daemon, ["-c", code], [site])
    assert json.loads(r.stdout) == [["_gpushm_hook"], "_Finder", "ran"]
    # A program on PATH gets the environment (GPUSHM_SAFETENSORS, PYTHONPATH).
    r = run(daemon, ["--cpu-tensors=gpu", "sh", "-c", 'echo "$GPUSHM_SAFETENSORS $GPUSHM_CPU_TENSORS ${PYTHONPATH%%:*}"'])
    assert r.stdout.split() == ["1", "gpu", os.path.join(str(PYDIR), "gpushm", "_site")]
    assert run(daemon, ["--cpu-tensors=cpu", "true"], check=False).returncode == 2


def test_environment_variable_alone(daemon, fake, tmp_path):
    """What the wheel's .pth does for containers: GPUSHM_SAFETENSORS set,
    _gpushm_hook on the path, no gpushm.run."""
    code = "import sys, safetensors; print(type(sys.meta_path[0]).__name__, hasattr(safetensors.safe_open, '_gpushm_real'))"
    pth = tmp_path / "pth"
    pth.mkdir()
    e = dict(env_for(daemon.socket), PYTHONPATH=os.pathsep.join([str(fake), str(PYDIR)]), GPUSHM_SAFETENSORS="1")
    line = (PYDIR.parent / "python" / "gpushm-safetensors.pth").read_text()
    r = subprocess.run([sys.executable, "-c", line + "\n" + code], env=e, capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["_Finder", "True"], r.stderr
    e["GPUSHM_SAFETENSORS"] = "0"
    r = subprocess.run([sys.executable, "-c", line + "\n" + code], env=e, capture_output=True, text=True, timeout=60)
    assert r.stdout.split()[1] == "False", r.stderr


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help(daemon, flag):
    """-h and --help say what the options do, with an example, and run
    nothing."""
    r = run(daemon, [flag])
    out = r.stdout
    assert out.startswith("usage: python -m gpushm.run ")
    for want in ("--cpu-tensors=auto", "--cpu-tensors=gpu", "--cpu-tensors=copy", "--copy", "gpushm put llama",
                 "python -m gpushm.run python serve.py"):
        assert want in out, (want, out)
    r = run(daemon, [], check=False)
    assert r.returncode == 2 and "-h says more" in r.stderr

