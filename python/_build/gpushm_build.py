"""The build backend of the gpushm Python package (PEP 517 and PEP 660),
written with the standard library alone, so that `pip install ./python`
works on a machine with no package index: pip builds in an isolated
environment with what a backend requires, and this one requires nothing.

It builds a pure wheel (py3-none-any) of the client: the gpushm package,
the safetensors hook beside it and the .pth line that installs the hook
when $GPUSHM_SAFETENSORS asks; an sdist of the same; and an editable
wheel, a .pth naming this directory. scripts/build-wheel builds the
platform wheel, the client with the gpushm binary, with the same code.

The metadata comes from pyproject.toml's [project] table, read with
tomllib where Python has it (3.11) and otherwise with a reader of the
little TOML that table uses (strings and arrays of strings).
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import tarfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # python/


# ---- metadata ---------------------------------------------------------------

def _read_toml(text: str) -> dict:
    try:
        import tomllib
    except ImportError:
        return _small_toml(text)
    return tomllib.loads(text)


def _small_toml(text: str) -> dict:
    """Tables, and keys whose values are strings or arrays of strings (on
    one line or several): what pyproject.toml's [project] uses."""
    doc: dict = {}
    table = doc
    pending = None  # (key, collected text) of an array spanning lines
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip() if '"' not in raw else raw.strip()
        if pending is not None:
            pending[1].append(line)
            if "]" in line:
                table[pending[0]] = re.findall(r'"((?:[^"\\]|\\.)*)"', " ".join(pending[1]))
                pending = None
            continue
        if not line or line.startswith("#"):
            continue
        m = re.fullmatch(r"\[([A-Za-z0-9_.\-]+)\]", line)
        if m:
            table = doc
            for part in m[1].split("."):
                table = table.setdefault(part, {})
            continue
        m = re.fullmatch(r'([A-Za-z0-9_\-]+)\s*=\s*(.*)', line)
        if not m:
            continue
        key, value = m[1], m[2].strip()
        if value.startswith('"'):
            table[key] = re.match(r'"((?:[^"\\]|\\.)*)"', value)[1]
        elif value.startswith("["):
            if "]" in value:
                table[key] = re.findall(r'"((?:[^"\\]|\\.)*)"', value)
            else:
                pending = (key, [value])
    return doc


def project() -> dict:
    return _read_toml((ROOT / "pyproject.toml").read_text())["project"]


def metadata(p: dict) -> str:
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {p['name']}",
        f"Version: {p['version']}",
        f"Summary: {p['description']}",
        f"Requires-Python: {p['requires-python']}",
    ]
    lines += [f"Requires-Dist: {dep}" for dep in p.get("dependencies", [])]
    for extra, deps in p.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        lines += [f'Requires-Dist: {dep}; extra == "{extra}"' for dep in deps]
    return "\n".join(lines) + "\n"


# ---- writing wheels -----------------------------------------------------------

def client_files() -> list:
    """(archive name, bytes, executable) of the client: the package, and the
    safetensors hook with its .pth beside it."""
    files = []
    # py.typed: the package is typed (PEP 561).
    for src in sorted([*(ROOT / "gpushm").rglob("*.py"), ROOT / "gpushm" / "py.typed"]):
        files.append((f"gpushm/{src.relative_to(ROOT / 'gpushm').as_posix()}", src.read_bytes(), False))
    for top in ("_gpushm_hook.py", "gpushm-safetensors.pth"):
        files.append((top, (ROOT / top).read_bytes(), False))
    return files


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"sha256={digest}"


def _stamp():
    # Reproducible: SOURCE_DATE_EPOCH, else 1980 (zip's first date).
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "315532800"))
    return time.gmtime(max(epoch, 315532800))[:6]


def write_wheel(directory, p: dict, tag: str, files: list, purelib: bool) -> str:
    """Writes the wheel of project p with files (and its dist-info) into
    directory; returns its file name."""
    name, version = p["name"], p["version"]
    dist_info = f"{name}-{version}.dist-info"
    files = list(files)
    files.append((f"{dist_info}/METADATA", metadata(p).encode(), False))
    wheel = (f"Wheel-Version: 1.0\nGenerator: gpushm python/_build\nRoot-Is-Purelib: {str(purelib).lower()}\n"
             f"Tag: {tag}\n")
    files.append((f"{dist_info}/WHEEL", wheel.encode(), False))
    record = io.StringIO()
    for arcname, data, _ in files:
        record.write(f"{arcname},{_record_hash(data)},{len(data)}\n")
    record.write(f"{dist_info}/RECORD,,\n")
    files.append((f"{dist_info}/RECORD", record.getvalue().encode(), False))
    filename = f"{name}-{version}-{tag}.whl"
    Path(directory).mkdir(parents=True, exist_ok=True)
    stamp = _stamp()
    with zipfile.ZipFile(Path(directory) / filename, "w", zipfile.ZIP_DEFLATED) as z:
        for arcname, data, executable in files:
            info = zipfile.ZipInfo(arcname, date_time=stamp)
            info.external_attr = (0o100755 if executable else 0o100644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
    return filename


# ---- PEP 517 and PEP 660 hooks ---------------------------------------------------

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return write_wheel(wheel_directory, project(), "py3-none-any", client_files(), purelib=True)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    # A .pth line puts this directory on sys.path: the package, the hook
    # and edits to them are used where they are. The safetensors .pth is
    # installed as in a wheel, since site only reads .pth files in
    # site-packages itself.
    files = [("__editable__.gpushm.pth", (str(ROOT) + "\n").encode(), False),
             ("gpushm-safetensors.pth", (ROOT / "gpushm-safetensors.pth").read_bytes(), False)]
    return write_wheel(wheel_directory, project(), "py3-none-any", files, purelib=True)


def build_sdist(sdist_directory, config_settings=None):
    p = project()
    base = f"{p['name']}-{p['version']}"
    members = [("PKG-INFO", metadata(p).encode()), ("pyproject.toml", (ROOT / "pyproject.toml").read_bytes()),
               ("_build/gpushm_build.py", Path(__file__).read_bytes())]
    members += [(arc, data) for arc, data, _ in client_files()]
    filename = f"{base}.tar.gz"
    Path(sdist_directory).mkdir(parents=True, exist_ok=True)
    mtime = time.mktime(time.struct_time(_stamp() + (0, 0, 0)))
    with tarfile.open(Path(sdist_directory) / filename, "w:gz", format=tarfile.PAX_FORMAT) as t:
        for arc, data in members:
            info = tarfile.TarInfo(f"{base}/{arc}")
            info.size, info.mode, info.mtime = len(data), 0o644, mtime
            t.addfile(info, io.BytesIO(data))
    return filename
