"""The sitecustomize that python -m gpushm.run puts first on PYTHONPATH.

It runs the sitecustomize it hides (the next one on sys.path, if any), then
installs gpushm's safetensors hook (_gpushm_hook) when $GPUSHM_SAFETENSORS
asks for it. Neither imports gpushm: that waits for the program's first
import of safetensors.
"""

import os
import sys


def _chain():
    """Imports the next sitecustomize on sys.path, with the usual import
    machinery (so it is cached as compiled code), while this directory is
    off the path; it then stands in sys.modules as sitecustomize."""
    here = os.path.dirname(os.path.abspath(__file__))
    saved, me = sys.path[:], sys.modules.pop("sitecustomize", None)
    sys.path[:] = [d for d in saved if os.path.abspath(d or ".") != here]
    try:
        __import__("sitecustomize")
    except ImportError as e:
        if e.name != "sitecustomize":
            raise
        if me is not None:
            sys.modules["sitecustomize"] = me
    finally:
        sys.path[:] = saved


def _hook():
    if os.environ.get("GPUSHM_SAFETENSORS", "") in ("", "0"):
        return
    # _gpushm_hook sits beside the gpushm package, two directories up.
    top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, top)
    try:
        import _gpushm_hook
    finally:
        sys.path.remove(top)
    _gpushm_hook.install()


try:
    _chain()
finally:
    _hook()
