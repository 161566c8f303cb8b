"""Installing gpushm as Python users do, each time into a fresh virtual
environment and offline: the platform wheel that scripts/build-wheel makes
(client and binary), and the source tree (`pip install ./python`, client
only, with no index and, as root, no network: its build backend needs
nothing but the standard library). Needs Debian's python3-venv;
scripts/test installs it."""

import glob
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import _binary

ROOT = Path(__file__).resolve().parents[3]
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's: venv and the wheels it needs come from apt
DEBIAN_WHEELS = "/usr/share/python-wheels"


def _env(venv):
    # Nothing from the caller's pip configuration or PYTHONPATH (which
    # points at the source tree): the venv must stand on its own.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INDEX="1",
               PATH=f"{venv}/bin:/usr/bin:/bin", GPUSHM_SOCKET=os.devnull)
    return env


def _run(args, env, **kw):
    r = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300, **kw)
    if r.returncode != 0:
        pytest.fail(f"{' '.join(map(str, args))}: exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def _venv(tmp_path):
    if not glob.glob(f"{DEBIAN_WHEELS}/pip-*.whl"):
        pytest.skip("needs python3-venv (Debian's pip wheel for ensurepip)")
    venv = tmp_path / "venv"
    _run([SYSTEM_PYTHON, "-m", "venv", str(venv)], _env(venv))
    return venv


def test_platform_wheel(tmp_path):
    out = _run([SYSTEM_PYTHON, str(ROOT / "scripts" / "build-wheel"), "--binary", _binary(),
                "--out", str(tmp_path / "dist")], os.environ)
    wheel = Path(out.strip().splitlines()[-1])
    assert wheel.name.startswith("gpushm-0.1.0-py3-none-manylinux_2_") and wheel.suffix == ".whl", wheel
    venv = _venv(tmp_path)
    env = _env(venv)
    _run([venv / "bin" / "pip", "install", "--no-deps", str(wheel)], env)

    gpushm_bin = venv / "bin" / "gpushm"
    assert os.access(gpushm_bin, os.X_OK), "the wheel did not install an executable gpushm"
    # The wheel's .pth installs the safetensors hook when the environment
    # asks (containers), and imports none of gpushm for it.
    probe = "import sys; print(type(sys.meta_path[0]).__name__, 'gpushm' in sys.modules)"
    assert _run([venv / "bin" / "python", "-c", probe], dict(env, GPUSHM_SAFETENSORS="1")).split() == ["_Finder", "False"]
    assert _run([venv / "bin" / "python", "-c", probe], env).split()[0] != "_Finder"
    # The whole path, from the installed binary alone: it starts its own
    # daemon (itself) and a second process (itself).
    demo = _run([gpushm_bin, "demo", "--backend", "host", "--size", "8MiB"], env, cwd=tmp_path)
    assert "verified: both processes saw every byte" in demo, demo

    # The installed client finds the installed binary and talks to it.
    sock = tmp_path / "s.sock"
    daemon = subprocess.Popen([gpushm_bin, "daemon", "--socket", sock, "--backend", "host", "--nvml", "off"], env=env,
                              stderr=subprocess.PIPE, text=True)
    try:
        script = f"""
import gpushm, os, time
assert gpushm.__file__.startswith({str(venv)!r}), gpushm.__file__
assert gpushm.binary() == {str(gpushm_bin)!r}, gpushm.binary()
for _ in range(500):
    try:
        c = gpushm.connect({str(sock)!r})
        break
    except OSError:
        time.sleep(0.01)
c.create("from-the-wheel", 4096)
info = c.info()
assert info["usage"]["named"] == 1, info
assert info["gpu"]["source"] == "none", info["gpu"]
print("ok")
"""
        assert _run([venv / "bin" / "python", "-c", script], env, cwd=tmp_path).strip() == "ok"
        ls = _run([venv / "bin" / "python", "-m", "gpushm", "--socket", sock, "ls"], env, cwd=tmp_path)
        assert "from-the-wheel" in ls, ls
    finally:
        daemon.terminate()
        _, err = daemon.communicate(timeout=10)
    assert daemon.returncode == 0, err


def _offline(args):
    """args run with no network at all where this process may make a
    network namespace (root, as in CI), else as they are: PIP_NO_INDEX
    keeps pip off the index either way."""
    if os.geteuid() == 0 and shutil.which("unshare") and subprocess.run(
            ["unshare", "-n", "true"], capture_output=True).returncode == 0:
        return ["unshare", "-n", *map(str, args)]
    return args


def _source(tmp_path):
    src = tmp_path / "python"
    shutil.copytree(ROOT / "python", src, ignore=shutil.ignore_patterns("__pycache__", "build", "dist", "*.egg-info"))
    return src


def test_source_install(tmp_path):
    # The README's command as it is: pip builds ./python in an isolated
    # environment, which the backend (python/_build) leaves empty, so no
    # index and no network are needed.
    src = _source(tmp_path)
    venv = _venv(tmp_path)
    env = _env(venv)
    _run(_offline([venv / "bin" / "pip", "install", str(src)]), env)
    script = f"""
import gpushm, _gpushm_hook, gpushm._site
assert gpushm.__file__.startswith({str(venv)!r}), gpushm.__file__
try:
    gpushm.binary()
except FileNotFoundError as e:
    print("client only:", e)
"""
    out = _run([venv / "bin" / "python", "-c", script], env, cwd=tmp_path)
    assert out.startswith("client only: no gpushm binary"), out
    assert not (venv / "bin" / "gpushm").exists()
    site = next((venv / "lib").glob("python3*/site-packages"))
    assert (site / "gpushm-safetensors.pth").exists(), "the safetensors hook's .pth was not installed"
    assert "Requires-Python: >=3.9" in next(site.glob("gpushm-*.dist-info/METADATA")).read_text()


def test_editable_and_sdist_install(tmp_path):
    src = _source(tmp_path)
    venv = _venv(tmp_path)
    env = _env(venv)
    _run(_offline([venv / "bin" / "pip", "install", "-e", str(src)]), env)
    where = _run([venv / "bin" / "python", "-c", "import gpushm; print(gpushm.__file__)"], env, cwd=tmp_path).strip()
    assert where == str(src / "gpushm" / "__init__.py"), where
    _run([venv / "bin" / "pip", "uninstall", "-y", "gpushm"], env)
    # The sdist the backend makes installs offline too.
    dist = tmp_path / "dist"
    name = _run([SYSTEM_PYTHON, "-c", f"import sys; sys.path.insert(0, {str(src / '_build')!r}); "
                 f"import gpushm_build; print(gpushm_build.build_sdist({str(dist)!r}))"], env).strip()
    _run(_offline([venv / "bin" / "pip", "install", str(dist / name)]), env)
    where = _run([venv / "bin" / "python", "-c", "import gpushm; print(gpushm.__file__)"], env, cwd=tmp_path).strip()
    assert where.startswith(str(venv)), where


def test_backend_reads_pyproject_without_tomllib():
    import sys

    sys.path.insert(0, str(ROOT / "python" / "_build"))
    try:
        import gpushm_build
    finally:
        sys.path.pop(0)
    text = (ROOT / "python" / "pyproject.toml").read_text()
    try:
        import tomllib
    except ImportError:
        pytest.skip("needs Python 3.11's tomllib to compare with")
    assert gpushm_build._small_toml(text) == tomllib.loads(text)
