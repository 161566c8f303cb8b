"""The safetensors API over gpushm bundles: safe_open, load_file and load,
for torch and numpy, with tensors that are views of the segment.

    from gpushm.safetensors import safe_open, load_file
    with safe_open("llama", framework="pt", device="cuda:0") as f:    # a bundle by name
        w = f.get_tensor("model.embed_tokens.weight")                 # a view, no copy
        part = f.get_slice("lm_head.weight")[:, 1024:2048]            # a view of the slice
    sd = load_file("/models/llama/model-00001-of-00004.safetensors")  # a file that was put

A bundle is named directly, or by the path of a file 'gpushm put' copied
into it: the bundle then serves exactly that file's tensors and metadata
(one shard of a checkpoint directory's bundle is that shard alone), and
only while the file is the one that was put (same device, inode, size,
mtime and ctime as put recorded; docs/python.md, "Any loader").

Devices (the rule docs/python.md explains): a request for the bundle's own
device gets views of the segment, read-only unless readonly=False (numpy
arrays with writeable=False; torch tensors over a read-only mapping, which
shared() recognizes). A request for another device gets a
private copy there, as the safetensors library would give, except that
cpu_tensors="gpu" answers a CPU request on a GPU bundle with GPU views
(for engines that copy every tensor into a GPU parameter anyway).
copy=True makes every tensor a private copy. Tensors that models write
after loading (BatchNorm's running statistics, quantization scales: see
written_after_load) are always private copies. A write to a shared
read-only view that torch does not refuse ends the process (docs/python.md,
"Shared weights that a model writes", says which torch refuses).

python -m gpushm.run serves a program's own safetensors calls from here
(_gpushm_hook installs the wrappers; _hook_open is their entry).
"""

from __future__ import annotations

import os
import struct
import sys
import threading
import time

from ._client import connect, default_socket
from ._errors import Error, NotFoundError, error
from ._tensors import (MAX_HEADER, Layout, decode_shard_table, dtype_of, index_layout, is_bundle, json_header,
                       shard_table_region)
from ._view import View

__all__ = ["SafetensorError", "safe_open", "load_file", "load", "held", "shared", "written_after_load"]

_FRAMEWORKS = {"pt": "pt", "torch": "pt", "pytorch": "pt", "np": "numpy", "numpy": "numpy"}
_CPU_TENSORS = ("copy", "gpu")


class SafetensorError(Exception):
    """What safetensors raises for a missing tensor or a closed file. When
    the safetensors library is loaded, the error raised is also an instance
    of its own class, so that a program's except clauses catch it either
    way."""


_both = {}  # the library's SafetensorError -> a class deriving from it and ours


def _error_class():
    real = getattr(sys.modules.get("safetensors"), "SafetensorError", None)
    if not isinstance(real, type) or issubclass(SafetensorError, real):
        return SafetensorError
    if issubclass(real, SafetensorError):
        return real
    cls = _both.get(real)
    if cls is None:
        try:
            cls = type("SafetensorError", (real, SafetensorError), {"__module__": real.__module__})
        except TypeError:  # a class that cannot be derived from: the library's, as it raises
            cls = real
        _both[real] = cls
    return cls


# ---- connections -------------------------------------------------------

_lock = threading.Lock()
_clients = {}  # socket -> Client, one per process
_unreachable = {}  # socket -> when connecting last failed (monotonic)
_RETRY_UNREACHABLE = 10.0


def _client(c=None, quiet=False):
    """c, or this process's connection to the default daemon. quiet (the
    hook): None when no daemon answers, asked again at most every 10 s."""
    if c is not None:
        return c
    sock = default_socket()
    with _lock:
        got = _clients.get(sock)
        if got is not None and not got._closed and not got._broken and got._pid == os.getpid():
            return got
        if quiet and time.monotonic() - _unreachable.get(sock, -1e9) < _RETRY_UNREACHABLE:
            return None
        try:
            got = _clients[sock] = connect(sock)
        except OSError:
            if not quiet:
                raise
            _unreachable[sock] = time.monotonic()
            return None
        _holdings.pop(sock, None)
        return got


# ---- what gpushm holds: the files put recorded -----------------------------

class _Held:
    """A file a bundle holds: the segment (name and id), and the shard of a
    checkpoint directory's bundle (None for a whole-file bundle)."""

    __slots__ = ("name", "id", "shard")

    def __init__(self, name, id, shard):
        self.name, self.id, self.shard = name, id, shard


_UNSEEN = object()
_FIELDS = (("size", "st_size", "size"), ("mtime_ns", "st_mtime_ns", "mtime"), ("ctime_ns", "st_ctime_ns", "ctime"))


def _differs(rec, st) -> list:
    """What differs between put's record of a file and its stat now."""
    if rec.get("dev") != st.st_dev or rec.get("ino") != st.st_ino:
        return ["another file"]
    return [what for key, attr, what in _FIELDS if rec.get(key) != getattr(st, attr)]


class _Holdings:
    """The bundles of one daemon by the directory their files came from:
    one list of segments, a stat of each segment not seen before (meta
    never changes for a segment id), and the shard table of a directory's
    bundle read when a lookup first needs it. A lookup that finds nothing
    lists again (a put may have come since); nothing else is asked."""

    def __init__(self, client):
        self.client = client
        self.segs = {}  # id -> (name, uid, origin dir or None, [records] or None for a directory's bundle)
        self.by_dir = {}  # origin dir -> [id], newest first
        self.tables = {}  # id -> [shard]
        self.listed = False

    def refresh(self):
        c, segs = self.client, {}
        for info in c.list():
            if info.uncommitted or info.handle_type not in ("memfd", "cuda_fd"):
                continue
            known = self.segs.get(info.id, _UNSEEN)
            if known is _UNSEEN:
                try:
                    st = c.stat(info.name)
                except Error:
                    continue
                if st.id != info.id:
                    continue  # renamed or replaced meanwhile: the next refresh sees it
                known = _origin_of(st.meta)
            if known is not None:
                segs[info.id] = (info.name, info.uid) + known[2:]
            else:
                segs[info.id] = None
        self.segs = segs
        by_dir = {}
        for id in sorted(segs, reverse=True):
            if segs[id] is not None:
                by_dir.setdefault(segs[id][2], []).append(id)
        self.by_dir = by_dir
        self.tables = {k: v for k, v in self.tables.items() if k in segs}
        self.listed = True

    def records(self, id):
        """[(record, shard or None)] of segment id."""
        name, _, _, files = self.segs[id]
        if files is not None:
            return [(r, None) for r in files]
        table = self.tables.get(id)
        if table is None:
            try:
                seg = self.client.open(name, True)
            except Error:
                return []
            try:
                if seg.id != id:
                    return []
                region = shard_table_region(seg.meta, seg.size)
                table = decode_shard_table(seg.read(region[1], region[0]), seg.size) if region else []
            except ValueError:
                table = []
            finally:
                seg.close()
            self.tables[id] = table
        return [(s["origin"], s) for s in table if s["origin"] is not None]

    def find(self, d, base, st, owner_ok):
        """(_Held or None, [(segment name, what differs)])."""
        changed = []
        for id in self.by_dir.get(d, ()):
            name, uid = self.segs[id][:2]
            if not owner_ok(uid):
                continue
            for rec, shard in self.records(id):
                if not isinstance(rec, dict) or rec.get("name", shard and shard["name"]) != base:
                    continue
                diff = _differs(rec, st)
                if not diff:
                    return _Held(name, id, shard), []
                changed.append((name, diff))
        return None, changed


def _origin_of(meta):
    """(None, None, dir, [records] or None) for a bundle whose meta says
    where it came from; None for any other segment."""
    if not is_bundle(meta):
        return None
    o = meta.get("origin")
    if not isinstance(o, dict) or not isinstance(o.get("dir"), str):
        return None
    if meta.get("source") == "dir":
        return None, None, o["dir"], None
    files = o.get("files")
    if not isinstance(files, list):
        return None
    return None, None, o["dir"], [f for f in files if isinstance(f, dict)]


_holdings = {}  # socket -> _Holdings
_noticed = set()


def _notice(key, text):
    if key not in _noticed:
        _noticed.add(key)
        print(f"gpushm: {text}", file=sys.stderr, flush=True)


def held(path, client=None, quiet=False):
    """The bundle that holds the file at path, as _Held, or None. A file
    is held when a bundle's origin names its directory (symbolic links
    resolved) and its name, with the device, inode, size, mtime and ctime
    it has now, and the caller may read it. Only bundles owned by the
    caller, by root or by the file's owner count: anyone else could claim
    any file. A file that changed since it was put is read from disk, and
    a line on standard error says why (once per file and bundle)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    if not os.access(path, os.R_OK):
        return None
    c = _client(client, quiet=quiet)
    if c is None:
        return None
    path = os.path.abspath(path)
    d, base = os.path.realpath(os.path.dirname(path)), os.path.basename(path)
    me = os.geteuid()

    def owner_ok(uid):
        return uid in (0, me, st.st_uid)

    with _lock:
        h = _holdings.get(c.socket) if client is None else None
        if h is None or h.client is not c:
            h = _Holdings(c)
            if client is None:
                _holdings[c.socket] = h
        try:
            fresh = not h.listed
            if fresh:
                h.refresh()
            found, changed = h.find(d, base, st, owner_ok)
            if found is None and not fresh:
                h.refresh()
                found, changed = h.find(d, base, st, owner_ok)
        except (Error, OSError):
            return None
    if found is None and changed:
        name, diff = changed[0]
        _notice((path, name, tuple(diff)), f"reading {base} from disk: changed since it was put in {name!r} ({', '.join(diff)})")
    return found


# ---- opening ----------------------------------------------------------------

def _shard_header(seg, shard):
    """The tensor names (in header order) and __metadata__ of a shard's own
    header, kept in the segment as the file had it."""
    off, n = shard["header"]
    raw = seg.read(n, off)
    if n < 8:
        raise ValueError(f"gpushm: shard {shard['name']!r}: its header is {n} bytes")
    (hn,) = struct.unpack_from("<Q", raw)
    if hn > MAX_HEADER or 8 + hn > n:
        raise ValueError(f"gpushm: shard {shard['name']!r}: a header of {hn} bytes does not fit its {n}")
    header = json_header(raw[8:8 + hn], f"shard {shard['name']!r}: header")
    metadata = header.pop("__metadata__", None)
    return list(header), metadata


def _open(name, client, readonly, shard=None, id=None):
    """(Views by name in header order, __metadata__) of bundle name, or of
    one shard of it."""
    b = client.tensors(name, readonly=readonly)
    if id is not None and b.segment.id != id:
        raise error("ENOENT", f"bundle {name!r} was replaced while it was being opened")
    if shard is None:
        return dict(b), b.metadata
    names, metadata = _shard_header(b.segment, shard)
    try:
        return {k: b[k] for k in names}, metadata
    except KeyError as e:
        raise ValueError(f"gpushm: bundle {name!r}: shard {shard['name']!r} names tensor {e.args[0]!r}, which the bundle lacks") from None


def _framework(framework):
    fw = _FRAMEWORKS.get(str(framework).lower()) if isinstance(framework, str) else None
    if fw is None:
        raise ValueError(f"gpushm: framework {framework!r} is not served; use 'pt' or 'numpy'")
    return fw


def _device(fw, device):
    """("cpu", None) or ("cuda", ordinal or None for the current device)."""
    if fw == "numpy":
        if device not in (None, "cpu"):
            raise ValueError(f"gpushm: numpy tensors live on the CPU, not {device!r}")
        return "cpu", None
    if device is None:
        return "cpu", None
    if isinstance(device, int) and not isinstance(device, bool):
        return "cuda", device
    s = str(device)
    if s == "cpu":
        return "cpu", None
    if s == "cuda":
        return "cuda", None
    if s.startswith("cuda:") and s[5:].isdigit():
        return "cuda", int(s[5:])
    raise ValueError(f"gpushm: device {device!r} is not served; use 'cpu', 'cuda', 'cuda:N' or N")


def _env_options():
    cpu = os.environ.get("GPUSHM_CPU_TENSORS", "copy") or "copy"
    if cpu not in _CPU_TENSORS:
        _notice(("GPUSHM_CPU_TENSORS", cpu), f"GPUSHM_CPU_TENSORS={cpu!r} is not one of {', '.join(_CPU_TENSORS)}; using 'copy'")
        cpu = "copy"
    return cpu, os.environ.get("GPUSHM_SAFETENSORS", "") == "copy"


class _Open:
    """What safe_open returns: the methods of safetensors' safe_open over
    Views of a bundle."""

    def __init__(self, what, views, metadata, fw, device, cpu_tensors, copy):
        self._what, self._views, self._metadata = what, views, metadata
        self._fw, self._device, self._cpu, self._copy = fw, device, cpu_tensors, copy

    def _get(self):
        if self._views is None:
            raise _error_class()("File is closed")
        return self._views

    def _view(self, name) -> View:
        v = self._get().get(name)
        if v is None:
            raise _error_class()(f"File does not contain tensor {name}")
        return v

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._views = None

    def __repr__(self):
        return f"<gpushm.safetensors.safe_open {self._what} framework={self._fw!r}>"

    def keys(self) -> list:
        return sorted(self._get())

    def offset_keys(self) -> list:
        return sorted(self._get(), key=lambda k: (self._views[k].offset, k))

    def metadata(self):
        self._get()
        return None if self._metadata is None else dict(self._metadata)

    def get_tensor(self, name):
        return _make(self._view(name), self._fw, self._device, self._cpu, self._copy, name)

    def get_tensors(self) -> dict:
        return {k: self.get_tensor(k) for k in self.offset_keys()}

    def get_slice(self, name):
        return _Slice(self, self._view(name), name)


class _Slice:
    """safetensors' PySafeSlice: get_shape(), get_dtype(), and indexing
    that gives only the slice (a view of it; a copy of only its elements
    where a copy is due)."""

    __slots__ = ("_f", "_v", "_name")

    def __init__(self, f, v, name):
        self._f, self._v, self._name = f, v, name

    def get_shape(self) -> list:
        return list(self._v.shape)

    def get_dtype(self) -> str:
        return self._v._layout.dtype.safetensors

    def __len__(self):
        if not self._v.shape:
            raise TypeError("len() of a 0-d tensor")
        return self._v.shape[0]

    def __getitem__(self, key):
        f, v = self._f, self._v
        part = View(v._mapping(), index_layout(v._layout, key))
        return _make(part, f._fw, f._device, f._cpu, f._copy, self._name)


# ---- tensors ----------------------------------------------------------------

_UINT = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


def _numpy_dtype(dt):
    """numpy's dtype for dt; bfloat16 and the float8 types through ml_dtypes
    (as the safetensors library does), else TypeError."""
    import numpy

    if dt.typestr is not None:
        return numpy.dtype(dt.typestr)
    try:
        import ml_dtypes
    except ImportError:
        raise TypeError(f"gpushm: numpy has no {dt.name} (safetensors {dt.safetensors}); install ml_dtypes, or use framework='pt'") from None
    t = getattr(ml_dtypes, dt.name, None)
    if t is None:
        raise TypeError(f"gpushm: ml_dtypes has no {dt.name} (safetensors {dt.safetensors})")
    return numpy.dtype(t)


def _numpy(v: View, copy: bool):
    import numpy

    lay, m = v._layout, v._mapping()
    want = _numpy_dtype(lay.dtype)
    if m.dev is None:
        raw = Layout(_UINT[lay.dtype.itemsize], lay.shape, lay.strides, lay.offset)
        a = numpy.asarray(View(m, raw))  # its base holds the mapping
        if a.dtype != want:
            a = a.view(want)
        return a.copy() if copy else a
    # GPU memory: one device-to-host copy of the bytes the view spans.
    span = lay.hi - lay.lo
    buf = numpy.frombuffer(m.read(lay.offset + lay.lo, span), dtype=numpy.uint8) if span else numpy.zeros(0, numpy.uint8)
    size = lay.dtype.itemsize
    strides = tuple(s * size for s in lay.element_strides())
    a = numpy.ndarray(lay.shape, dtype=want, buffer=buf, offset=-lay.lo, strides=strides) if lay.numel else numpy.zeros(lay.shape, want)
    return numpy.array(a)  # C-contiguous and writable, like the library's


def _torch_view(v: View):
    # A plain tensor, not an inference tensor: torch checks an in-place
    # write to an inference tensor only after the kernel ran (torch 2.11:
    # the write lands, then it raises), so being one protects nothing,
    # while nn.Parameter refuses one with requires_grad, which loaders ask
    # for. A Parameter made of a view keeps requires_grad as its program
    # asks; with grad mode on, torch refuses an in-place write to it before
    # any kernel runs ("a leaf Variable that requires grad is being used in
    # an in-place operation"). docs/python.md lists what nothing catches.
    import torch

    m = v._mapping()
    _mapped[m.ptr] = m.size
    return torch.from_dlpack(v.__dlpack__())


_mapped = {}  # base address -> size of every bundle mapping a tensor came from


def shared(t) -> bool:
    """Whether torch tensor t lies in the memory of a bundle this process
    mapped (a view of shared weights) rather than in memory of its own.
    While the bundle stays mapped, which its views ensure."""
    p = t.data_ptr()
    return any(base <= p < base + size for base, size in _mapped.items())


def _make(v: View, fw, device, cpu_tensors, copy, name=None):
    if name is not None and not copy and written_after_load(name):
        copy = True  # a private copy: the model writes it (docs/python.md, "Shared weights that a model writes")
    if fw == "numpy":
        return _numpy(v, copy)
    import torch

    kind, index = device
    here = v.device  # None: host memory
    t = _torch_view(v)
    if kind == "cpu":
        if here is None or cpu_tensors == "gpu":
            return t.clone() if copy else t
        return t.to("cpu")  # only the view's elements cross
    if index is None:
        index = torch.cuda.current_device()
    if here == index:
        return t.clone() if copy else t
    return t.to(torch.device("cuda", index))


# Tensors that models and loaders write after loading, found by the name
# the checkpoint gives them: BatchNorm's running statistics (updated by
# every forward in train mode) and quantization scales (fp8 and int8
# loaders rescale or fuse them in place after loading). They get a
# private copy, made once for each request, so that no process writes the
# memory the others read (NVIDIA's memory service saw Xid 31 faults from
# exactly these).
_WRITTEN_SUFFIXES = ("running_mean", "running_var", "num_batches_tracked", "_scale", "_scale_inv", "_amax")


def written_after_load(name: str) -> bool:
    """Whether a tensor of this checkpoint name is one that models and
    loaders write after loading, and so is served as a private copy."""
    return name.endswith(_WRITTEN_SUFFIXES)




# ---- the API ------------------------------------------------------------

def _is_path(x) -> bool:
    return isinstance(x, os.PathLike) or (isinstance(x, (str, bytes)) and (os.sep in str(x) if isinstance(x, str) else b"/" in x))


def safe_open(name_or_path, framework, device="cpu", *, client=None, readonly: bool = True, cpu_tensors: str | None = None,
              copy: bool | None = None, backend=None):
    """safetensors.safe_open over a bundle named name_or_path, or over the
    bundle that holds the file at that path (a path: it has a '/' or is an
    os.PathLike; a bare name that no segment has is tried as a file in the
    working directory). framework: "pt" (torch) or "numpy" ("np"); device:
    "cpu", "cuda", "cuda:N" or N. readonly=False maps read-write (writes
    reach every process that maps the bundle). cpu_tensors ("copy" or
    "gpu") and copy default to $GPUSHM_CPU_TENSORS and
    $GPUSHM_SAFETENSORS=copy; the module's docstring says what they do.
    backend is accepted for the library's signature and changes nothing."""
    fw = _framework(framework)
    dev = _device(fw, device)
    env_cpu, env_copy = _env_options()
    cpu_tensors = env_cpu if cpu_tensors is None else cpu_tensors
    if cpu_tensors not in _CPU_TENSORS:
        raise ValueError(f"gpushm: cpu_tensors={cpu_tensors!r}: want one of {', '.join(_CPU_TENSORS)}")
    copy = env_copy if copy is None else bool(copy)
    c = _client(client)
    if not _is_path(name_or_path):
        try:
            views, metadata = _open(name_or_path, c, readonly)
            return _Open(f"bundle {name_or_path!r}", views, metadata, fw, dev, cpu_tensors, copy)
        except NotFoundError:
            if not os.path.isfile(name_or_path):
                raise
    path = os.fsdecode(name_or_path)
    h = held(path, c)
    if h is None:
        raise error("ENOENT", f"{path} is not held by gpushm: no bundle records it as it is now "
                    "('gpushm put NAME FILE' copies it in)")
    views, metadata = _open(h.name, c, readonly, h.shard, h.id)
    return _Open(f"{path!r} in bundle {h.name!r}", views, metadata, fw, dev, cpu_tensors, copy)


def load_file(name_or_path, device="cpu", *, framework="pt", client=None, readonly: bool = True,
              cpu_tensors: str | None = None, copy: bool | None = None, backend=None) -> dict:
    """safetensors.torch.load_file (framework="pt") or
    safetensors.numpy.load_file (framework="numpy"): every tensor, by name,
    in the order of their data."""
    with safe_open(name_or_path, framework, device, client=client, readonly=readonly, cpu_tensors=cpu_tensors,
                   copy=copy) as f:
        return f.get_tensors()


def load(name_or_path, *, framework="pt", **kw) -> dict:
    """load_file on the CPU (safetensors' load takes a file's bytes; these
    are in the bundle already)."""
    return load_file(name_or_path, "cpu", framework=framework, **kw)


# ---- the hook's entry ----------------------------------------------------------

def _hook_open(filename, framework, device):
    """An _Open for a file gpushm holds, or None: the caller then reads the
    file with the safetensors library. Never raises for a file it does not
    serve; a failure to open a held bundle is a one-line notice and a read
    from disk."""
    fw = _FRAMEWORKS.get(framework) if isinstance(framework, str) else None
    if fw is None or not isinstance(filename, (str, bytes, os.PathLike)):
        return None
    try:
        dev = _device(fw, device)
    except ValueError:
        return None
    try:
        path = os.fsdecode(filename)
    except TypeError:
        return None
    h = held(path, quiet=True)
    if h is None:
        return None
    cpu, copy = _env_options()
    try:
        views, metadata = _open(h.name, _client(quiet=True), True, h.shard, h.id)
    except (Error, OSError, ValueError, AttributeError) as e:
        if not isinstance(e, Error) or e.code not in ("EACCES", "EPERM", "ENOENT"):
            _notice((path, h.name, "open"), f"reading {os.path.basename(path)} from disk: bundle {h.name!r}: {e}")
        return None
    return _Open(f"{path!r} in bundle {h.name!r}", views, metadata, fw, dev, cpu, copy)
