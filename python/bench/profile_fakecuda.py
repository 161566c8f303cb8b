#!/usr/bin/env python3
"""The Python cost of a channel's GPU hand-off, on a machine without a GPU:
the client's CUDA path against the stand-in driver
(python/tests/device/fakecuda.c, built here with cc), whose stream
operations are a store each, so that what is timed is the channel's own
code and ctypes.

    PYTHONPATH=python python3 python/bench/profile_fakecuda.py --bin .build/gpushm
    PYTHONPATH=python python3 python/bench/profile_fakecuda.py --bin .build/gpushm --smoke   # CI

It starts a host daemon of its own, builds the stand-in libcuda.so.1 into
a temporary directory, and runs itself again with that on
LD_LIBRARY_PATH: one thread holds both ends of a 32-slot channel (two
clients), with the channel's context current as a framework leaves it,
and hands each message over at once, --count times after a round to warm
up. It prints each call's mean, and a message's in with blocks with no
clock read inside. Exits 1 if the stand-in cannot be built, or a call
failed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[1]))
sys.path.insert(0, str(HERE.parent))

from profile_channel import handoffs  # noqa: E402

now = time.perf_counter_ns


def measure(sock, count, slots):
    import ctypes

    import gpushm
    import gpushm._info as info

    # The host daemon's memfds, taken for cuda_fd handles: the stand-in
    # maps them where the driver would map device memory.
    wire = info.SegmentInfo.from_wire
    info.SegmentInfo.from_wire = classmethod(
        lambda cls, d: wire(dict(d, handle_type="cuda_fd") if d.get("handle_type") == "memfd" else d))
    fake = ctypes.CDLL("libcuda.so.1")
    c1, c2 = gpushm.connect(sock), gpushm.connect(sock)
    try:
        tx = c1.channel("profile-fakecuda", shape=(1024,), dtype="float32", slots=slots, framework=None)
        rx = c2.channel("profile-fakecuda", framework=None)
        fake.cuCtxPushCurrent_v2(tx._dev.ctx)  # current, as torch leaves it
        per = handoffs(tx, rx, count)
        t0 = now()
        for _ in range(count):
            with tx.send():
                pass
            with rx.recv():
                pass
        per["a message in with blocks, both ends"] = (now() - t0) / count
        tx.close()
        rx.close()
        c1.unlink("profile-fakecuda")
    finally:
        c1.close()
        c2.close()
    print(f"a channel's GPU hand-off through the stand-in driver, {slots} slots, {count} messages, one thread\n")
    print("| call | us |\n| --- | ---: |")
    for k, v in per.items():
        print(f"| {k} | {v / 1e3:.3f} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bin", default=os.environ.get("GPUSHM_BIN") or ".build/gpushm")
    p.add_argument("--count", type=int, help="messages (default 30000; smoke 300)")
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--smoke", action="store_true", help="300 messages unless --count says")
    p.add_argument("--socket", help=argparse.SUPPRESS)  # the run under the stand-in
    a = p.parse_args(argv)
    count = a.count or (300 if a.smoke else 30000)
    if a.socket:
        measure(a.socket, count, a.slots)
        return 0
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        print("profile_fakecuda: no C compiler to build the stand-in libcuda.so.1", file=sys.stderr)
        return 1
    from gpushm import testing

    with tempfile.TemporaryDirectory(prefix="gpushm-fakecuda-") as lib:
        src = HERE.parents[1] / "tests" / "device" / "fakecuda.c"
        subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", os.path.join(lib, "libcuda.so.1"), str(src)], check=True)
        d = testing.Daemon("host", binary=a.bin)
        try:
            env = dict(os.environ, LD_LIBRARY_PATH=lib + ":" + os.environ.get("LD_LIBRARY_PATH", ""),
                       PYTHONPATH=str(HERE.parents[1]) + ":" + os.environ.get("PYTHONPATH", ""))
            return subprocess.run([sys.executable, str(HERE), "--socket", d.socket, "--count", str(count),
                                   "--slots", str(a.slots)], env=env).returncode
        finally:
            d.stop()


if __name__ == "__main__":
    sys.exit(main())
