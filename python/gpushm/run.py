"""python -m gpushm.run [--cpu-tensors=auto|copy|gpu] [--copy] CMD ARGS...

Runs CMD with every safetensors open (safe_open, safetensors.torch.load_file,
safetensors.numpy.load_file) of a file that gpushm holds served from the
bundle it was put in, and every other file read from disk by the
safetensors library as usual (docs/python.md, "Any loader"). Put the files
first, once per node: a file is served only while it is the one that was
put (same device, inode, size and times).

    gpushm put llama /models/llama
    python -m gpushm.run python serve.py /models/llama
    python -m gpushm.run vllm serve /models/llama

Options:
  --cpu-tensors=auto  (the default) a CPU request, what most loaders make,
                      for a file held on a GPU gets what the loader's next
                      step allows: GPU views for vLLM's and SGLang's
                      loaders (they copy each tensor into a parameter of
                      their own), private copies on the device transformers'
                      from_pretrained loads onto (one CUDA device), and for
                      anything else the file from disk, as without gpushm.
  --cpu-tensors=gpu   GPU views for every CPU request: the parameters share
                      the bundle's memory, for programs that only copy or
                      read what they load; one that keeps CPU tensors as
                      CPU tensors fails loudly.
  --cpu-tensors=copy  a copy on the CPU for every CPU request (slower than
                      reading the file; the earlier default).
  --copy              every tensor a private copy, as the library gives:
                      for programs that write into what they load (training).
  -h, --help          this text.

It sets GPUSHM_SAFETENSORS (1, or "copy" with --copy) and, with
--cpu-tensors, GPUSHM_CPU_TENSORS, and puts a directory first on
PYTHONPATH whose sitecustomize installs the hook in every Python process
CMD starts (after running the sitecustomize it hides, if any); then it
execs CMD. CMD may be a program on PATH, a .py file, or "-m MODULE", the
last two run by this interpreter.
"""

from __future__ import annotations

import os
import sys

USAGE = "usage: python -m gpushm.run [--cpu-tensors=auto|copy|gpu] [--copy] CMD ARGS...\n"


def site_dir() -> str:
    """The directory whose sitecustomize installs the hook."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")


def environment(env, cpu_tensors=None, copy=False) -> dict:
    """env with what the hook needs: GPUSHM_SAFETENSORS,
    GPUSHM_CPU_TENSORS, and site_dir() first on PYTHONPATH."""
    env = dict(env)
    env["GPUSHM_SAFETENSORS"] = "copy" if copy else "1"
    if cpu_tensors is not None:
        env["GPUSHM_CPU_TENSORS"] = cpu_tensors
    site = site_dir()
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != site]
    env["PYTHONPATH"] = os.pathsep.join([site] + rest)
    return env


def command(args) -> list:
    """argv to exec for CMD ARGS."""
    if args[0] in ("-m", "-c") or args[0].endswith(".py"):
        return [sys.executable] + list(args)
    return list(args)


def main(argv=None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    cpu, copy = None, False
    while args and (args[0].startswith("--") or args[0] == "-h"):
        a = args.pop(0)
        if a == "--":
            break
        if a in ("-h", "--help"):
            sys.stdout.write(USAGE + "\n" + __doc__.split("\n\n", 1)[1])
            return 0
        if a == "--copy":
            copy = True
        elif a.startswith("--cpu-tensors="):
            cpu = a.split("=", 1)[1]
            if cpu not in ("auto", "copy", "gpu"):
                sys.stderr.write(f"gpushm.run: --cpu-tensors={cpu}: want auto, copy or gpu\n")
                return 2
        elif a == "--cpu-tensors" and args:
            args.insert(0, "--cpu-tensors=" + args.pop(0))
        else:
            sys.stderr.write(f"gpushm.run: unknown option {a}\n" + USAGE)
            return 2
    if not args:
        sys.stderr.write(USAGE + "(python -m gpushm.run -h says more)\n")
        return 2
    argv = command(args)
    env = environment(os.environ, cpu, copy)
    try:
        os.execvpe(argv[0], argv, env)
    except OSError as e:
        sys.stderr.write(f"gpushm.run: cannot run {argv[0]}: {e.strerror}\n")
        return 127


if __name__ == "__main__":
    sys.exit(main())
