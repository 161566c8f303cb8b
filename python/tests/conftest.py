"""Fixtures: real daemons ($GPUSHM_BIN) on sockets in a temporary directory,
started by gpushm.testing, which the benchmarks share, and helpers that run
Python snippets in separate processes, as the clients of a real deployment
are."""

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

PYDIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PYDIR))

import gpushm  # noqa: E402
from gpushm import testing  # noqa: E402


def _binary():
    try:
        return testing.env_binary()
    except RuntimeError as e:
        pytest.fail(str(e))


class Daemon(testing.Daemon):
    """gpushm.testing.Daemon, failing the test with a clear message when
    GPUSHM_BIN is not set."""

    def __init__(self, backend="host", *args, **kw):
        super().__init__(backend, *args, binary=kw.pop("binary", None) or _binary(), **kw)


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
