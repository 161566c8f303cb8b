"""Real gpushm daemons for tests and benchmarks, and a check that a run
left nothing behind. python/tests/conftest.py and the programs in
python/bench share it, so that every one of them starts, waits for and
stops a daemon the same way.

    from gpushm.testing import Daemon
    d = Daemon("host")                # $GPUSHM_BIN on a socket of its own
    c = gpushm.connect(d.socket)
    ...
    d.stop()

A Daemon runs `gpushm daemon` (the supervisor, which starts the serving
process) on a socket in a private temporary directory, and waits until a
client can connect. The directory is searchable by everyone, so that a
test may run children as another user.

safetensors_standin writes a stand-in for the safetensors library, for a
test or a benchmark's smoke run where the library is not installed, or
where what the library itself read is the point.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time

from ._client import connect


def env_binary() -> str:
    """The gpushm binary that tests and benchmarks run: $GPUSHM_BIN."""
    b = os.environ.get("GPUSHM_BIN")
    if not b or not os.access(b, os.X_OK):
        raise RuntimeError("GPUSHM_BIN must name a built gpushm binary "
                           "(go build -o .build/gpushm ./cmd/gpushm, and GPUSHM_BIN=.build/gpushm)")
    return b


class Daemon:
    """A gpushm daemon on a socket of its own: Daemon(backend, *flags).

    binary defaults to $GPUSHM_BIN; log names the file its output goes to
    (default: daemon.log in its directory, read back by logs()); timeout is
    how long to wait for it to serve; new_session starts it in a session of
    its own, so that a signal to the caller's process group (^C) leaves it
    to stop()."""

    def __init__(self, backend: str = "host", *args: str, binary: str | None = None, log: str | None = None,
                 timeout: float = 30.0, new_session: bool = False):
        gbin = binary or env_binary()
        # A short path: sun_path holds 108 bytes.
        self.dir = tempfile.mkdtemp(prefix="gpushm-py-")
        os.chmod(self.dir, 0o755)
        self.socket = os.path.join(self.dir, "s.sock")
        self.log = open(log or os.path.join(self.dir, "daemon.log"), "w+")
        self.backend = backend
        self.proc = subprocess.Popen([gbin, "daemon", "--socket", self.socket, "--backend", backend, *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=new_session)
        deadline = time.monotonic() + timeout
        while True:
            try:
                connect(self.socket).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    logs = self.logs()  # stop removes the log's directory
                    self.stop()
                    raise RuntimeError(f"gpushm daemon --backend {backend} did not start:\n{logs}")
                time.sleep(0.02)

    def logs(self) -> str:
        try:
            with open(self.log.name) as f:
                return f.read()
        except OSError:
            return ""

    def pids(self) -> list:
        """The daemon's processes: the one started here, and the supervisor
        and serving process it reports (one of them is the same)."""
        pids = {self.proc.pid}
        try:
            with connect(self.socket, timeout=5, reconnect=0) as c:
                info = c.info()
            pids.update(p for p in (info.get("pid"), info.get("supervisor_pid")) if p)
        except OSError:
            pass
        return sorted(pids)

    def crash(self):
        """Ends every process of the daemon as a crash of the machine would
        (a reboot, as far as memory goes): each process whose command line
        names the socket is stopped first, so that none starts another when
        it sees another die, then SIGKILLed, until none is left; then
        stop() cleans up."""
        for _ in range(1000):
            pids = processes_naming(self.socket)
            if not pids:
                break
            for sig in (signal.SIGSTOP, signal.SIGKILL):
                for pid in pids:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            time.sleep(0.01)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self.stop()

    def stop(self, timeout: float = 10.0):
        """SIGTERM, then SIGKILL after timeout seconds; removes its
        directory."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def processes_naming(path: str) -> list:
    """The live processes whose command line holds path (a daemon's
    socket): its supervisors and serving processes, whoever started them."""
    pids = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if path.encode() in cmd and start_time(int(p)) is not None:
            pids.append(int(p))
    return pids


def start_time(pid: int):
    """A process's start time (clock ticks since boot, /proc/PID/stat), or
    None when it is gone or a zombie: with the pid it names one process,
    whatever reuses the pid later."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def still_alive(started: dict, *, naming: str | None = None, wait: float = 10.0) -> list:
    """Which of the processes a run started are still alive, waiting up to
    wait seconds for them to go: started maps pid to start_time(pid) as
    recorded when it ran. naming adds any process whose command line
    contains that text (a daemon's socket path catches a serving process
    restarted behind the run's back). Returns ["PID COMMAND LINE", ...]."""
    deadline = time.monotonic() + wait
    while True:
        alive = {pid for pid, t in started.items() if t is not None and start_time(pid) == t}
        if naming:
            alive |= _naming(naming)
        if not alive or time.monotonic() > deadline:
            return [f"{pid} {_cmdline(pid)}" for pid in sorted(alive)]
        time.sleep(0.1)


def _naming(text: str) -> set:
    me, found = os.getpid(), set()
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != me and text in _cmdline(int(d)) and start_time(int(d)) is not None:
            found.add(int(d))
    return found


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def gpu_memory_used():
    """MiB of memory in use on each GPU (nvidia-smi), or None where it
    cannot be asked."""
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=60)
        return [int(x) for x in r.stdout.split()] if r.returncode == 0 and r.stdout.strip() else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


# The stand-in's files: a package named safetensors, numpy only, that reads
# a whole file from disk and records the path of every file it opens in
# safetensors.READS.
_STANDIN = {
    "__init__.py": '''
        import json, struct
        import numpy as np
        READS = []
        _NP = {"F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "U8": "u1"}

        class SafetensorError(Exception):
            pass

        class safe_open:
            def __init__(self, filename, framework, device="cpu", *, backend="mmap"):
                if framework not in ("np", "numpy") or device != "cpu":
                    raise SafetensorError(f"stand-in: numpy on the CPU only, not {framework!r} on {device!r}")
                READS.append(str(filename))
                with open(filename, "rb") as f:
                    data = f.read()
                (n,) = struct.unpack_from("<Q", data)
                self._h = json.loads(data[8:8 + n])
                self._meta = self._h.pop("__metadata__", None)
                self._data = data[8 + n:]

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                pass

            def keys(self):
                return sorted(self._h)

            def metadata(self):
                return self._meta

            def get_tensor(self, k):
                e = self._h[k]
                b, end = e["data_offsets"]
                return np.frombuffer(self._data[b:end], _NP[e["dtype"]]).reshape(e["shape"]).copy()

            def get_tensors(self):
                return {k: self.get_tensor(k) for k in self.keys()}
    ''',
    "numpy.py": '''
        from safetensors import safe_open

        def load_file(filename, *, backend="mmap"):
            with safe_open(filename, framework="np", backend=backend) as f:
                return f.get_tensors()
    ''',
    "torch.py": '''
        from safetensors import safe_open

        def load_file(filename, device="cpu", *, backend="mmap"):
            with safe_open(filename, framework="pt", device=device, backend=backend) as f:
                return f.get_tensors()

        def load(data):
            raise NotImplementedError("load of bytes")
    ''',
}


def safetensors_standin(directory):
    """Writes a stand-in for the safetensors library into directory (made
    if absent) and returns directory's path, for PYTHONPATH: a package of
    that name, numpy on the CPU only (another framework or device raises
    its SafetensorError), with safe_open, safetensors.numpy.load_file and
    safetensors.torch's load_file and load (wrapped by gpushm.run's hook,
    but not served by the stand-in), which reads whole files from disk and
    appends the path of each file it opens to safetensors.READS."""
    pkg = os.path.join(directory, "safetensors")
    os.makedirs(pkg, exist_ok=True)
    for name, src in _STANDIN.items():
        with open(os.path.join(pkg, name), "w") as f:
            f.write(textwrap.dedent(src))
    return directory
