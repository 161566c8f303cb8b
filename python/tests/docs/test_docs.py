"""Every shell block of the README and of docs/*.md runs as written, on the
host backend, so that a page cannot drift from the binary.

A block is a fenced ```sh (or shell, bash) block. It runs as one bash
script (set -e), as a user who pastes it would run it, in a directory of
its own, with what it names made there first: `model.bin` (a file of
1 MiB), checkpoint directories under `/models/` or `./` (a small
safetensors checkpoint), `gpushm` on the PATH (and `./gpushm`), `python` as
the Python that runs the tests, with the client importable. Absolute
paths that a user would own (`/models`, `/mnt/gpushm`) are moved into that
directory. A daemon the block starts is given `--backend host` and a
socket of its own unless it names them, and must be started as a script
must start it: `gpushm daemon --detach`, which returns once it answers
(`gpushm daemon &` returns before it does, and the next line fails). A
block that starts none gets one, as the node's daemon would be running.

Every line is a command or a comment: what a command prints is shown in a
```text block right after, whose first line's words must all be in what
the block printed. A line that is neither fails the test (pasted, it would
run as a command).

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


TEXT = re.compile(r"^```(text|console)?\s*$")


def blocks():
    """(file, line number, skip reason or None, lines, output shown) of
    every shell block; the output shown is the first line of a ```text
    block right after it, or None."""
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
                j = i + 1
                while j < len(lines) and not lines[j].strip():
                    j += 1
                shown = None
                if j < len(lines) and TEXT.match(lines[j]) and lines[j].strip() != "```":
                    shown = lines[j + 1] if j + 1 < len(lines) else None
                out.append((path, start, m[1] if m else None, body, shown))
            i += 1
    return out


def _commands(body):
    """The block's commands, continued lines joined; raises CannotRun for a
    line that is neither a command this test knows nor a comment (output
    goes in a ```text block after), or names a program not here."""
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
            cmds.append(line)
        elif line.strip() and not line.lstrip().startswith("#"):
            raise NotACommand(f"{line.strip()!r} is not a command: pasted, it would run as one (show output in a "
                              "```text block after the commands)")
    return cmds


class NotACommand(Exception):
    pass


class CannotRun(Exception):
    pass


def _checkpoint(d: Path):
    from helpers.stfiles import write

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
    m = re.match(r"^(\S*gpushm) daemon(.*?)(#.*)?$", line)
    if m:
        args = m[2].rstrip()
        if args.endswith("&"):
            raise NotACommand(f"{line.strip()!r}: a script's next line would find no daemon yet; "
                              "'gpushm daemon --detach' returns once it answers")
        if "--socket" not in args:
            args += f" --socket {sock}"
        if "--backend" not in args:
            args += " --backend host"
        if "--detach" in args and "--log-file" not in args:
            args += f" --log-file {work}/daemon.log"
        return f"{m[1]} daemon{args} --nvml off"
    return line


def _run_block(path, start, body, shown, tmp_path):
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
    where = f"{path.relative_to(ROOT)}:{start}"
    script = ["set -e"]
    for line in _commands(body):
        missing = [m for m in ("torch", "cupy", "jax") if re.search(rf"import .*\b{m}\b", line) and not _importable(m)]
        if missing:
            print(f"{where}: {line.strip()!r} not run: {', '.join(missing)} is not installed")
            continue
        script.append(_rewrite(line, work, sock))
    node = None
    if not any(re.search(r"gpushm daemon", line) for line in body):
        # The page takes the node's daemon as running.
        node = subprocess.Popen(["gpushm", "daemon", "--socket", sock, "--backend", "host", "--nvml", "off"], cwd=work,
                                env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True)
        for _ in range(1000):
            if os.path.exists(sock) or node.poll() is not None:
                break
            time.sleep(0.01)
        assert node.poll() is None, f"{where}: the test's daemon exited {node.returncode}: {node.stderr.read()}"
    r = None
    try:
        r = subprocess.run(["bash", "-c", "\n".join(script)], cwd=work, env=env, capture_output=True, text=True,
                           timeout=180)
        assert r.returncode == 0, f"{where}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"
        if shown:
            words = shown.split()
            assert all(w in r.stdout for w in words), f"{where}: output lacks {shown!r}:\n{r.stdout}"
    finally:
        pids = [int(p) for p in re.findall(r"daemon serving on \S+ \(pid (\d+)\)", r.stderr if r else "")]
        for pid in pids:  # what the block started with --detach
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            for _ in range(1000):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.01)
        if node is not None:
            try:
                os.killpg(node.pid, signal.SIGTERM)
                node.wait(timeout=10)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(node.pid, signal.SIGKILL)
        if os.path.ismount(work / "mnt"):
            subprocess.run(["fusermount3", "-u", str(work / "mnt")], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def _importable(module):
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode == 0


ALL = blocks()


def test_every_block_is_tested_or_says_why():
    assert ALL, "no shell blocks found"
    for path, start, skip, body, _ in ALL:
        where = f"{path.relative_to(ROOT)}:{start}"
        if skip is not None:
            assert len(skip) > 10, f"{where}: say why the block cannot run here"
            continue
        try:
            cmds = _commands(body)
        except CannotRun as e:
            pytest.fail(f"{where}: {e}: mark the block <!-- doc-test: skip (why) --> or make it run here")
        except NotACommand as e:
            pytest.fail(f"{where}: {e}")
        assert cmds, f"{where}: no command this test knows how to run"


def test_a_pasted_block_would_fail_so():
    """What the strict runner refuses: output shown among the commands, and
    a daemon started in the background with '&', which the README's block
    did (the next line failed in 5 of 5 runs)."""
    with pytest.raises(NotACommand, match="not a command"):
        _commands(["gpushm ls", "NAME  SIZE", "gpushm rm x"])
    with pytest.raises(NotACommand, match="--detach"):
        _rewrite("./gpushm daemon &                 # the socket", Path("/w"), "/s")
    assert "--detach --socket /s --backend host" in _rewrite("./gpushm daemon --detach  # x", Path("/w"), "/s")


@pytest.mark.parametrize("path,start,skip,body,shown", ALL, ids=[f"{p.relative_to(ROOT)}:{s}" for p, s, *_ in ALL])
def test_block(path, start, skip, body, shown, tmp_path):
    if skip is not None:
        pytest.skip(f"the page says: {skip}")
    try:
        _commands(body)
    except CannotRun as e:
        pytest.fail(f"{e}: mark the block <!-- doc-test: skip (why) --> or make it run here")
    if any("--mount" in line for line in body) and (os.geteuid() != 0 or not os.path.exists("/dev/fuse")
                                                    or not shutil.which("fusermount3")):
        pytest.skip("the FUSE view needs root, /dev/fuse and fusermount3")
    _run_block(path, start, body, shown, tmp_path)
