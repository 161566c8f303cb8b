"""Finding the gpushm binary that a platform wheel installs next to the
interpreter (its scripts directory), so that Python users can start the
daemon without a Go toolchain: ``gpushm.binary()``, ``python -m gpushm``."""

import os
import shutil
import sys
import sysconfig
from pathlib import Path

_NAME = "gpushm"


def _candidates():
    yield Path(sysconfig.get_path("scripts")) / _NAME
    user_scheme = sysconfig.get_preferred_scheme("user") if hasattr(sysconfig, "get_preferred_scheme") else f"{os.name}_user"
    try:
        yield Path(sysconfig.get_path("scripts", scheme=user_scheme)) / _NAME
    except KeyError:
        pass
    # pip install --target DIR puts the package in DIR and the binary in DIR/bin.
    pkg = Path(__file__).resolve().parent
    for parent in list(pkg.parents)[:4]:
        yield parent / "bin" / _NAME
    yield Path(sys.prefix) / "bin" / _NAME


def binary() -> str:
    """The path of the gpushm binary installed with this package (the
    platform wheel's), else the one on PATH. Raises FileNotFoundError when
    there is none: the source install (``pip install ./python``) brings the
    client only."""
    for p in _candidates():
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    found = shutil.which(_NAME)
    if found:
        return found
    raise FileNotFoundError(
        "no gpushm binary: install the platform wheel (built by scripts/build-wheel), or put gpushm on PATH")
