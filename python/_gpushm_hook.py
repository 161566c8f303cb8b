"""Serves a program's safetensors opens of files gpushm holds from GPU
memory ($GPUSHM_SAFETENSORS, python -m gpushm.run; docs/python.md, "Any
loader").

It imports nothing but sys and os until the program imports safetensors:
install() puts a finder first on sys.meta_path whose only work, for every
other import, is one membership test. When safetensors, safetensors.torch
or safetensors.numpy is imported, the finder lets the usual finder load it
and, right after the module has run and before any importer can take a
name from it, replaces safe_open and load_file with wrappers. A wrapper
asks gpushm.safetensors (imported then, not before) whether gpushm holds
the file; if not, or for anything it does not serve (another framework,
device or argument), it calls the library's own function, which reads the
file as it always did. safetensors.torch.load(bytes) is left alone: it is
given bytes, not a file.

This is a top-level module, not part of the gpushm package, so that
installing it imports none of gpushm.
"""

import os
import sys

_TARGETS = frozenset(("safetensors", "safetensors.torch", "safetensors.numpy"))
_installed = False


def enabled() -> bool:
    return os.environ.get("GPUSHM_SAFETENSORS", "") not in ("", "0")


def install() -> None:
    """Installs the finder (once), and wraps the safetensors modules that
    are loaded already."""
    global _installed
    if _installed:
        return
    _installed = True
    sys.meta_path.insert(0, _Finder())
    for name in _TARGETS:
        if name in sys.modules:
            _patch(sys.modules[name])


class _Finder:
    """A meta path finder that finds nothing itself: for the modules it
    wraps, it asks the finders after it and wraps the loader they give."""

    _busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _TARGETS or self._busy:
            return None
        self._busy = True
        try:
            spec = None
            for f in sys.meta_path:
                if f is self or not hasattr(f, "find_spec"):
                    continue
                spec = f.find_spec(fullname, path, target)
                if spec is not None:
                    break
        finally:
            self._busy = False
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        try:
            loader.exec_module = exec_module
        except AttributeError:
            return spec
        return spec


def _gpushm():
    """gpushm.safetensors, imported at the first open. A program run by
    another interpreter than the one gpushm is installed for may not find
    gpushm on its path: the directory this file is in has it."""
    try:
        from gpushm import safetensors
    except ImportError:
        here = os.path.dirname(os.path.abspath(__file__))
        if here in sys.path:
            raise
        sys.path.append(here)
        from gpushm import safetensors
    return safetensors


def _wrap_safe_open(real):
    if getattr(real, "_gpushm_real", None) is not None:
        return real

    def safe_open(filename, framework, device="cpu", *args, **kwargs):
        if not args and set(kwargs) <= {"backend"}:
            f = _gpushm()._hook_open(filename, framework, device)
            if f is not None:
                return f
        return real(filename, framework, device, *args, **kwargs)

    safe_open._gpushm_real = real
    safe_open.__doc__ = getattr(real, "__doc__", None)
    return safe_open


def _wrap_load_file(real, framework):
    if getattr(real, "_gpushm_real", None) is not None:
        return real

    if framework == "pt":
        def load_file(filename, device="cpu", *args, **kwargs):
            if not args and set(kwargs) <= {"backend"}:
                f = _gpushm()._hook_open(filename, "pt", device)
                if f is not None:
                    return f.get_tensors()
            return real(filename, device, *args, **kwargs)
    else:
        def load_file(filename, *args, **kwargs):
            if not args and set(kwargs) <= {"backend"}:
                f = _gpushm()._hook_open(filename, "numpy", "cpu")
                if f is not None:
                    return f.get_tensors()
            return real(filename, *args, **kwargs)

    load_file._gpushm_real = real
    load_file.__doc__ = getattr(real, "__doc__", None)
    load_file.__name__ = getattr(real, "__name__", "load_file")
    return load_file


def _patch(module):
    real = getattr(module, "safe_open", None)
    if real is not None:
        module.safe_open = _wrap_safe_open(real)
    if module.__name__ in ("safetensors.torch", "safetensors.numpy"):
        real = getattr(module, "load_file", None)
        if real is not None:
            module.load_file = _wrap_load_file(real, "pt" if module.__name__ == "safetensors.torch" else "numpy")
