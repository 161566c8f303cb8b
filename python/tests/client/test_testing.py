"""gpushm.testing, the daemon fixture the tests and the benchmarks share,
and its check that a run left no process behind."""

import os
import subprocess
import sys

import pytest

import gpushm
from gpushm import testing

from conftest import Daemon


def test_daemon_pids_and_stop_leave_nothing():
    d = Daemon("host")
    pids = d.pids()
    with gpushm.connect(d.socket) as c:
        info = c.info()
    assert {d.proc.pid, info["pid"], info["supervisor_pid"]} <= set(pids)
    assert len(pids) >= 2, pids  # the supervisor and the serving process
    started = {pid: testing.start_time(pid) for pid in pids}
    assert all(started.values()), started
    # Alive: reported (without waiting for them to go), by pid and by the
    # socket named on their command line.
    alive = testing.still_alive(started, naming=d.socket, wait=0)
    assert set(pids) <= {int(a.split()[0]) for a in alive}, alive
    assert any(d.socket in a for a in alive), alive
    d.stop()
    assert testing.still_alive(started, naming=d.socket, wait=30) == []
    assert not os.path.exists(d.dir)


def test_still_alive_sees_a_process_and_its_end():
    p = subprocess.Popen([sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()",
                          "gpushm-testing-marker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"  # exec'd: its command line is its own
        started = {p.pid: testing.start_time(p.pid)}
        alive = testing.still_alive(started, wait=0)
        assert len(alive) == 1 and alive[0].startswith(f"{p.pid} ") and "gpushm-testing-marker" in alive[0], alive
        # A pid whose start time differs is another process (the pid was
        # reused): not one this run started.
        assert testing.still_alive({p.pid: started[p.pid] + 1}, wait=0) == []
    finally:
        p.stdin.close()
        p.wait(30)
    # Exited and reaped; a zombie would count as gone too.
    assert testing.still_alive(started, wait=5) == []
    assert testing.start_time(p.pid) is None or testing.start_time(p.pid) != started[p.pid]


def test_daemon_that_cannot_start_says_why(tmp_path):
    with pytest.raises(RuntimeError, match="did not start"):
        testing.Daemon("no-such-backend", binary=os.environ["GPUSHM_BIN"], timeout=20)
    bad = tmp_path / "not-gpushm"
    bad.write_text("#!/bin/sh\nexit 3\n")
    bad.chmod(0o755)
    with pytest.raises(RuntimeError, match="did not start"):
        testing.Daemon("host", binary=str(bad), timeout=20)


def test_env_binary_names_the_variable(monkeypatch):
    monkeypatch.delenv("GPUSHM_BIN", raising=False)
    with pytest.raises(RuntimeError, match="GPUSHM_BIN"):
        testing.env_binary()
