"""Every shell block of the README and of docs/*.md runs as written, on the
host backend, so that a page cannot drift from the binary.

A block is a fenced ```sh (or shell, bash) block. It runs line by line in
a directory of its own, as a user would type it, with what it names made
there first: `model.bin` (a file of 1 MiB), checkpoint directories under
`/models/` or `./` (a small safetensors checkpoint), `gpushm` on the PATH
(and `./gpushm`), `python` as the Python that runs the tests, with the
client importable. Absolute paths that a user would own (`/models`,
`/mnt/gpushm`) are moved into that directory. A line ending in `&` runs in
the background (a daemon: given `--backend host` and a socket of its own
unless it names them); every other line must exit 0. Lines that are not
commands (output shown in the block) must appear in the output of the
command before them, word for word, as far as their first line's words go.

A block that cannot run on a machine without a GPU, a cluster or the
programs it names says so in an HTML comment on the line before it:
`<!-- doc-test: skip (why) -->`. The test fails on a block it cannot run
that does not say why.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import PYDIR, _binary

ROOT = PYDIR.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMANDS = {"gpushm", "./gpushm", "go", "cp", "ls", "rm", "cmp", "getfattr", "python", "python3", "cat", "echo"}
# Programs a page may show that cannot run here: a block that uses one must
# say why it is not run.
ELSEWHERE = {"sudo", "podman", "docker", "kubectl", "vllm", "scripts/build-image", "nvidia-smi"}
FENCE = re.compile(r"^```(sh|shell|bash)\s*$")


def blocks():
    """(file, line number, skip reason or None, lines) of every shell block."""
    out = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            if FENCE.match(lines[i]):
                m = re.match(r"<!-- doc-test: skip \((.+)\) -->", lines[i - 1].strip()) if i > 0 else None
                start, body = i + 1, []
                i += 1
                while i < len(lines) and lines[i].strip() != "```":
                    body.append(lines[i])
                    i += 1
                out.append((path, start, m[1] if m else None, body))
            i += 1
    return out


def _commands(body):
    """Joins continued lines and pairs each command with the output lines
    shown after it."""
    cmds, joined = [], ""
    for line in body:
        if joined:
            line = joined + " " + line.strip()
            joined = ""
        if line.rstrip().endswith("\\"):
            joined = line.rstrip()[:-1]
            continue
        word = line.split()[0] if line.split() else ""
        if word in ELSEWHERE or re.search(r"gpushm\.run (vllm|python -m sglang)", line):
            raise CannotRun(f"{line.strip()!r} needs what is not here")
        if word in COMMANDS:
            cmds.append([line, []])
        elif line.strip() and not line.lstrip().startswith("#") and cmds:
            cmds[-1][1].append(line)
    return cmds


class CannotRun(Exception):
    pass


def _checkpoint(d: Path):
    from stfiles import write

    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(1)
    write(d / "model.safetensors", {"embed.weight": ("F32", rng.standard_normal((64, 16)).astype("<f4")),
                                    "lm_head.weight": ("F32", rng.standard_normal((64, 16)).astype("<f4"))})
    (d / "config.json").write_text('{"model_type": "test"}\n')


def _setup(work: Path, text: str):
    bin_dir = work / "bin"
    bin_dir.mkdir()
    os.symlink(_binary(), bin_dir / "gpushm")
    os.symlink(_binary(), work / "gpushm")
    for exe in ("python", "python3"):
        # A script, not a link: a virtual environment's interpreter run
        # through a link elsewhere finds no pyvenv.cfg beside it and
        # loses the environment's packages (numpy, on the GPU machine).
        (bin_dir / exe).write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        (bin_dir / exe).chmod(0o755)
    (work / "model.bin").write_bytes(np.random.default_rng(2).bytes(1 << 20))
    # "your program": one that reads every shard of the checkpoint it is
    # given with safetensors (here a stand-in of the library, numpy only).
    (work / "serve.py").write_text(
        "import glob, sys\n"
        "from safetensors import safe_open\n"
        "n = 0\n"
        "for f in glob.glob(sys.argv[1] + '/*.safetensors'):\n"
        "    with safe_open(f, framework='numpy') as g:\n"
        "        n += sum(g.get_tensor(k).size for k in g.keys())\n"
        "assert n > 0, 'no tensors read'\n")
    for m in set(re.findall(r"(?:/models/|\./)([A-Za-z][\w.\-]*)", text)):
        if m not in ("gpushm", "python", "cmd") and not m.endswith((".bin", ".py", ".sh")):
            _checkpoint(work / "models" / m)
            if not (work / m).exists():
                os.symlink(work / "models" / m, work / m)


def _rewrite(line, work: Path, sock: str):
    line = line.replace("/models/", f"{work}/models/").replace("/mnt/gpushm", f"{work}/mnt")
    # `go build` of the binary the test already has: it is linked in place.
    if line.startswith("go build -o gpushm ./cmd/gpushm"):
        return "true"
    m = re.match(r"^(\S*gpushm) daemon(.*)&\s*(#.*)?$", line)
    if m:
        args = m[2]
        if "--socket" not in args:
            args += f" --socket {sock}"
        if "--backend" not in args:
            args += " --backend host"
        return f"{m[1]} daemon{args} --nvml off"
    return line


def _run_block(path, start, body, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    _setup(work, "\n".join(body))
    (work / "mnt").mkdir()
    sock = str(tmp_path / "s.sock")
    env = {k: v for k, v in os.environ.items() if k != "GPUSHM_SOCKET"}
    from gpushm import testing

    site = testing.safetensors_standin(str(tmp_path / "site"))
    env.update(PATH=f"{work / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}", GPUSHM_SOCKET=sock,
               PYTHONPATH=f"{PYDIR}:{site}")
    background = []
    if not any(re.search(r"gpushm daemon.*&", line) for line in body):
        # The page takes the node's daemon as running.
        body = ["gpushm daemon &"] + list(body)
    try:
        for line, shown in _commands(body):
            cmd = _rewrite(line, work, sock)
            where = f"{path.relative_to(ROOT)}:{start}: {line.strip()}"
            missing = [m for m in ("torch", "cupy", "jax") if re.search(rf"import .*\b{m}\b", line) and not _importable(m)]
            if missing:
                print(f"{where}: not run: {', '.join(missing)} is not installed")
                continue
            if line.rstrip().split("#")[0].rstrip().endswith("&"):
                p = subprocess.Popen(["bash", "-c", cmd], cwd=work, env=env, start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                background.append(p)
                for _ in range(1000):
                    if os.path.exists(sock) or p.poll() is not None:
                        break
                    time.sleep(0.01)
                assert p.poll() is None, f"{where}: exited {p.returncode}: {p.stderr.read()}"
                # The mount, when the block asks for one, comes after the socket.
                if "--mount" in cmd:
                    for _ in range(1000):
                        if os.path.ismount(work / "mnt"):
                            break
                        time.sleep(0.01)
                continue
            r = subprocess.run(["bash", "-c", cmd], cwd=work, env=env, capture_output=True, text=True, timeout=120)
            assert r.returncode == 0, f"{where}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
            if shown:
                words = shown[0].split()
                assert all(w in r.stdout for w in words), f"{where}: output lacks {shown[0]!r}:\n{r.stdout}"
    finally:
        for p in background:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(p.pid, signal.SIGKILL)
        if os.path.ismount(work / "mnt"):
            subprocess.run(["fusermount3", "-u", str(work / "mnt")], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def _importable(module):
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode == 0


ALL = blocks()


def test_every_block_is_tested_or_says_why():
    assert ALL, "no shell blocks found"
    for path, start, skip, body in ALL:
        where = f"{path.relative_to(ROOT)}:{start}"
        if skip is not None:
            assert len(skip) > 10, f"{where}: say why the block cannot run here"
            continue
        try:
            cmds = _commands(body)
        except CannotRun as e:
            pytest.fail(f"{where}: {e}: mark the block <!-- doc-test: skip (why) --> or make it run here")
        assert cmds, f"{where}: no command this test knows how to run"


@pytest.mark.parametrize("path,start,skip,body", ALL, ids=[f"{p.relative_to(ROOT)}:{s}" for p, s, _, _ in ALL])
def test_block(path, start, skip, body, tmp_path):
    if skip is not None:
        pytest.skip(f"the page says: {skip}")
    try:
        _commands(body)
    except CannotRun as e:
        pytest.fail(f"{e}: mark the block <!-- doc-test: skip (why) --> or make it run here")
    if any("--mount" in line for line in body) and (os.geteuid() != 0 or not os.path.exists("/dev/fuse")
                                                    or not shutil.which("fusermount3")):
        pytest.skip("the FUSE view needs root, /dev/fuse and fusermount3")
    _run_block(path, start, body, tmp_path)
