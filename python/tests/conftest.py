"""Fixtures: real daemons ($GPUSHM_BIN) on sockets in a temporary directory,
and helpers that run Python snippets in separate processes, as the clients of
a real deployment are."""

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

PYDIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PYDIR))

import gpushm  # noqa: E402


def _binary():
    b = os.environ.get("GPUSHM_BIN")
    if not b or not os.access(b, os.X_OK):
        pytest.fail("GPUSHM_BIN must name a built gpushm binary (scripts/test builds one: go build -o .build/gpushm ./cmd/gpushm)")
    return b


class Daemon:
    def __init__(self, backend, *args):
        # A short path: sun_path holds 108 bytes. World-searchable, so that
        # tests running children as another user can reach the socket.
        self.dir = tempfile.mkdtemp(prefix="gpushm-py-")
        os.chmod(self.dir, 0o755)
        self.socket = os.path.join(self.dir, "s.sock")
        self.log = open(os.path.join(self.dir, "daemon.log"), "w+")
        self.proc = subprocess.Popen([_binary(), "daemon", "--socket", self.socket, "--backend", backend, *args],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                gpushm.connect(self.socket).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"gpushm daemon --backend {backend} did not start:\n{self.logs()}")
                time.sleep(0.02)

    def logs(self):
        self.log.seek(0)
        return self.log.read()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def daemon():
    d = Daemon("host")
    yield d
    d.stop()


@pytest.fixture
def client(daemon):
    c = gpushm.connect(daemon.socket)
    yield c
    c.close()


@pytest.fixture
def name():
    """A segment name no other test uses."""
    return "t-" + uuid.uuid4().hex[:12]


def env_for(sock):
    env = dict(os.environ, GPUSHM_SOCKET=sock, PYTHONPATH=str(PYDIR))
    env.pop("PYTHONSTARTUP", None)
    return env


def child(sock, code, *args, timeout=120, env=None, **kw):
    """Runs code in a fresh interpreter (never a fork: CUDA cannot survive
    one) and returns its stdout; fails the test with its stderr if it fails.
    env adds to the environment."""
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], env=dict(env_for(sock), **(env or {})),
                       capture_output=True, text=True, timeout=timeout, **kw)
    if r.returncode != 0:
        pytest.fail(f"child process failed ({r.returncode}):\n{r.stderr}\nstdout:\n{r.stdout}")
    return r.stdout


class Peer:
    """A child interpreter driven line by line: send() a line, expect() one."""

    def __init__(self, sock, code, *args):
        self.p = subprocess.Popen([sys.executable, "-u", "-c", textwrap.dedent(code), *map(str, args)],
                                  env=env_for(sock), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)

    def send(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def expect(self, want=None):
        line = self.p.stdout.readline().strip()
        if not line or (want is not None and line != want):
            self.p.kill()
            _, err = self.p.communicate()
            pytest.fail(f"peer said {line!r}, want {want!r}; its stderr:\n{err}")
        return line

    def close(self):
        self.p.stdin.close()
        rc = self.p.wait(60)
        err = self.p.stderr.read()
        assert rc == 0, f"peer exited {rc}:\n{err}"
