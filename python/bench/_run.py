"""What the benchmark programs share besides their report: a run's daemon,
the processes it starts (fresh interpreters running the program's own
'worker' subcommand, and the gpushm binary), where their logs go, and
small helpers."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import gpushm
from gpushm import testing

REPO = Path(__file__).resolve().parents[2]


def have(*modules):
    """The modules of those not importable here, with the reason."""
    missing = []
    for m in modules:
        try:
            __import__(m)
        except Exception as e:
            missing.append(f"{m} ({type(e).__name__}: {e})")
    return missing


def count_hook_opens(counts):
    """Counts, in counts["opens"] and counts["served"], the safetensors
    opens the hook of python -m gpushm.run sees in this process and those
    it serves from a bundle (it calls gpushm.safetensors._hook_open by
    attribute at every open). Imports gpushm.safetensors, as the hook's
    first open would."""
    import gpushm.safetensors as gst

    counts.setdefault("opens", 0)
    counts.setdefault("served", 0)
    real = gst._hook_open

    def counting(*args, **kw):
        f = real(*args, **kw)
        counts["opens"] += 1
        counts["served"] += f is not None
        return f

    gst._hook_open = counting


def fmt_s(x):
    return "-" if x is None else (f"{x * 1000:.1f} ms" if x < 1 else f"{x:.2f} s")


class Run:
    """One benchmark run: program is the script its workers run, prefix
    names its logs in out (PREFIX-daemon.log, PREFIX-LABEL.log), and
    started records every process it started, for the leftover check."""

    def __init__(self, a, program, prefix):
        self.a, self.program, self.prefix = a, str(program), prefix
        self.out, self.work = Path(a.out), Path(a.work)
        self.started = {}
        self.daemon = self.client = self.env = None

    def start_daemon(self, *args):
        self.daemon = testing.Daemon(self.a.backend, *args, binary=self.a.gpushm,
                                     log=str(self.out / f"{self.prefix}-daemon.log"), new_session=True)
        for pid in self.daemon.pids():
            self.started[pid] = testing.start_time(pid)
        self.env = dict(os.environ, GPUSHM_SOCKET=self.daemon.socket, PYTHONPATH=str(REPO / "python"))
        self.env.pop("PYTHONSTARTUP", None)
        self.client = gpushm.connect(self.daemon.socket, timeout=600)

    def gpushm(self, *argv, timeout=600):
        """Runs the gpushm binary; returns its status, output and seconds."""
        t = time.perf_counter()
        p = subprocess.Popen([self.a.gpushm, *argv], env=self.env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        self.started[p.pid] = testing.start_time(p.pid)
        out, _ = p.communicate(timeout=timeout)
        return p.returncode, out, time.perf_counter() - t

    def spawn(self, label, *argv):
        """Starts a worker in a fresh interpreter; its stderr goes to
        OUT/PREFIX-LABEL.log."""
        with open(self.out / f"{self.prefix}-{label}.log", "w") as log:
            p = subprocess.Popen([sys.executable, "-u", self.program, "worker", *argv], env=self.env,
                                 stdout=subprocess.PIPE, stderr=log, text=True)
        self.started[p.pid] = testing.start_time(p.pid)
        return p

    def collect(self, p, label, timeout=600):
        """A worker's JSON report (its last line starting with "{"), or
        {"error": ...}."""
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            return {"error": f"{label}: timed out after {timeout}s (log: {self.prefix}-{label}.log)"}
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not lines:
            return {"error": f"{label}: exit status {p.returncode} (log: {self.prefix}-{label}.log)"}
        return json.loads(lines[-1])

    def worker(self, label, *argv, timeout=600):
        return self.collect(self.spawn(label, *argv), label, timeout)

    def per_size(self, sizes, compare):
        """Calls compare(label) for each size label in turn and returns what
        the calls returned, in order; a call that raises is a failed check
        of its label (its traceback printed) and the next label still runs.
        After each label, its checkpoint directory (WORK/ckpt-LABEL) and its
        bundle (PREFIX-LABEL) are removed."""
        import shutil
        import traceback

        from _report import check

        out = []
        for label in sizes:
            print(f"\n=== {time.strftime('%H:%M:%S')} {label}", flush=True)
            try:
                out.append(compare(label))
            except Exception as e:
                traceback.print_exc()
                check(False, label, f"{type(e).__name__}: {e}")
            finally:
                shutil.rmtree(self.work / f"ckpt-{label}", ignore_errors=True)
                try:
                    self.client.unlink(f"{self.prefix}-{label}")
                except OSError:
                    pass
        return out

    def finish(self, used0, used_now, remove_work):
        """Ends the run, also after a failure or SIGTERM: closes the client,
        stops the daemon, checks what is left behind (_report.leftovers),
        removes the work directory if the run made it, prints the summary,
        and returns the exit status (1 if anything failed)."""
        import shutil

        from _report import leftovers, verdicts

        if self.client is not None:
            self.client.close()
        if self.daemon is not None:
            self.daemon.stop()
        leftovers(self.started, self.daemon.socket if self.daemon else None, self.a.backend, used0, used_now)
        if remove_work:
            shutil.rmtree(self.work, ignore_errors=True)
        print("\n=== summary")
        for v in verdicts:
            print(v)
        return 1 if any(v.startswith("FAIL") for v in verdicts) else 0


def logits_equal(a, b):
    """Whether two saved logits tensors (torch.save) are equal: True, or
    why not (a file missing, or the largest difference)."""
    if not (a.exists() and b.exists()):
        return f"missing {a.name if not a.exists() else b.name}"
    import torch

    x, y = torch.load(a), torch.load(b)
    return True if torch.equal(x, y) else f"False, max |diff| {(x.float() - y.float()).abs().max().item()}"


def parser(doc):
    """The arguments every benchmark program takes: --gpushm, --backend,
    --out, --work."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpushm", default=os.environ.get("GPUSHM_BIN", str(REPO / ".gpu" / "gpushm")),
                    help="the gpushm binary (default $GPUSHM_BIN, else .gpu/gpushm)")
    ap.add_argument("--backend", default="cuda", choices=["cuda", "host"])
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-out"), help="logs go here")
    ap.add_argument("--work", default=None, help="where checkpoints are written (default: a new directory)")
    return ap


def sized_args(ap, known):
    """Parses the arguments of a program that compares loaders over model
    sizes (ap also takes --sizes, --reps, --smoke): --smoke stands for
    --backend host --sizes tiny --reps 1; the sizes must be of known, at
    least one, --reps at least 1, and --gpushm a program. Makes --out.
    Returns (arguments, the sizes in order)."""
    a = ap.parse_args()
    if a.smoke:
        a.backend, a.sizes, a.reps = "host", "tiny", 1
    sizes = [s.strip() for s in a.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in known]
    if bad or not sizes:
        ap.error(f"--sizes {a.sizes}: want some of {', '.join(known)}")
    if a.reps < 1:
        ap.error(f"--reps {a.reps}: want at least 1")
    if not (os.path.isfile(a.gpushm) and os.access(a.gpushm, os.X_OK)):
        ap.error(f"no gpushm binary at {a.gpushm} (go build -o .build/gpushm ./cmd/gpushm; --gpushm or $GPUSHM_BIN)")
    os.makedirs(a.out, exist_ok=True)
    return a, sizes


def fixed_prompt_logits(torch, model):
    """model's logits for a fixed prompt of 16 tokens (for logits_equal)."""
    ids = (torch.arange(16, dtype=torch.long) * 7919 % model.config.vocab_size).reshape(1, 16).to(model.device)
    with torch.no_grad():
        return model(ids).logits
