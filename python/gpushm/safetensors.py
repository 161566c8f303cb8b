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
only while the file is the one the daemon filled the bundle from (same
device, inode, size, mtime and ctime as the daemon saw them), in a bundle
of root's or the caller's that nobody else may write (on a GPU, nor read:
a reader there can write); the tensors are laid out by the file's own
header (docs/python.md, "Any loader"; docs/security.md, "Files served from
bundles").

Devices (the rule docs/python.md explains): a request for the bundle's own
device gets views of the segment, read-only unless readonly=False (numpy
arrays with writeable=False; torch tensors over a read-only mapping, which
shared() recognizes). A request for another device gets a private copy
there, as the safetensors library would give. A CPU request on a GPU
bundle depends on cpu_tensors: "copy", a copy on the CPU; "gpu", GPU views
(for engines that copy every tensor into a GPU parameter anyway); "auto"
(the default), what the loader that asks does next allows (next_step):
GPU views for vLLM's and SGLang's loaders, a private copy on the device
transformers' from_pretrained loads onto (one CUDA device), and
otherwise, under the hook, the file read from disk by the library, as
without gpushm (a copy on the CPU when called directly).
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

from ._client import connect
from ._core import default_socket
from ._errors import Error, NotFoundError, error
from ._tensors import MAX_HEADER, Layout, decode_bundle, index_layout, is_bundle
from ._view import View

__all__ = ["SafetensorError", "safe_open", "load_file", "load", "held", "shared", "written_after_load"]

_FRAMEWORKS = {"pt": "pt", "torch": "pt", "pytorch": "pt", "np": "numpy", "numpy": "numpy"}
_CPU_TENSORS = ("auto", "copy", "gpu")


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


# ---- what gpushm holds: the files the daemon filled bundles from -----------

class _Held:
    """A file a bundle holds: the segment (name and id), and the ranges the
    daemon filled from the file as it is now (Sources, by file offset);
    gpu: the bundle is GPU memory."""

    __slots__ = ("name", "id", "sources", "gpu")

    def __init__(self, name, id, sources, gpu=False):
        self.name, self.id, self.sources, self.gpu = name, id, sources, gpu


_UNSEEN = object()
_FIELDS = (("size", "st_size", "size"), ("mtime_ns", "st_mtime_ns", "mtime"), ("ctime_ns", "st_ctime_ns", "ctime"))


def _differs(src, st) -> list:
    """What differs between the daemon's record of a file and its stat now."""
    if src.dev != st.st_dev or src.ino != st.st_ino:
        return ["another file"]
    return [what for key, attr, what in _FIELDS if getattr(src, key) != getattr(st, attr)]


def _trusted(info, me) -> bool:
    """Whether a bundle's bytes are trusted to be what the daemon filled:
    owned by root or by this process's own user (as the daemon knows it),
    and writable by nobody else. Whoever else may write it could change
    the bytes after the daemon filled them, through a mapping the daemon
    cannot see (docs/security.md, "Files served from bundles"). On a GPU
    whoever may read it may write it: a read-only open's descriptor is a
    CUDA export, which its holder may map read-write."""
    others = 0o066 if info.handle_type == "cuda_fd" else 0o022
    return (info.uid == 0 or info.uid == me) and not info.mode & others


class _Holdings:
    """The files one daemon's bundles hold, by (device, inode), from the
    sources the daemon recorded as it filled them (stat's sources): never
    from what a bundle's writer put in its meta. One list of segments, a
    stat of each segment not seen before; a lookup that finds nothing lists
    again (a put may have come since), and a find is confirmed with a
    fresh stat of the segment it found."""

    def __init__(self, client):
        self.client = client
        self.segs = {}  # id -> (name, uid, mode, (Source, ...)), or None for a segment with none
        self.by_file = {}  # (dev, ino) -> [id], newest first
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
                known = (st.name, st.uid, st.mode, st.sources) if st.sources and is_bundle(st.meta) else None
            if known is not None:
                # The owner and mode as listed now; the sources are
                # confirmed by the stat of a find.
                known = (info.name, info.uid, info.mode, known[3])
            segs[info.id] = known
        self.segs = segs
        by_file = {}
        for id in sorted(segs, reverse=True):
            if segs[id] is not None:
                for f in {(src.dev, src.ino) for src in segs[id][3]}:
                    by_file.setdefault(f, []).append(id)
        self.by_file = by_file
        self.listed = True

    def find(self, st, me):
        """(_Held or None, [(segment name, what differs)])."""
        changed = []
        for id in self.by_file.get((st.st_dev, st.st_ino), ()):
            name, uid, mode, sources = self.segs[id]
            mine = [src for src in sources if src.dev == st.st_dev and src.ino == st.st_ino]
            now = [src for src in mine if not _differs(src, st)]
            if not now:
                changed.append((name, _differs(mine[0], st)))
                continue
            try:
                info = self.client.stat(name)
            except Error:
                continue
            if info.id != id or not _trusted(info, me):
                continue
            now = [src for src in info.sources if not _differs(src, st)]
            if now:
                return _Held(name, id, tuple(sorted(now, key=lambda src: src.offset)), info.handle_type == "cuda_fd"), []
        return None, changed


_holdings = {}  # socket -> _Holdings
_noticed = set()


def _notice(key, text):
    if key not in _noticed:
        _noticed.add(key)
        print(f"gpushm: {text}", file=sys.stderr, flush=True)


def held(path, client=None, quiet=False):
    """The bundle that holds the file at path, as _Held, or None. A file
    is held when the daemon filled a bundle from it, itself, as the file is
    now (the same device, inode, size, mtime and ctime, as the daemon saw
    them through the descriptor it read), and the caller may read it. Only
    bundles owned by root or by the caller, and writable by nobody else
    (on a GPU, readable by nobody else), count: anyone else could change
    the bytes after the fill. A file that changed since it was put is read
    from disk, and a line on standard error says why (once per file and
    bundle)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    if not os.access(path, os.R_OK):
        return None
    c = _client(client, quiet=quiet)
    if c is None:
        return None
    me = c.peer_uid if c.peer_uid is not None else 0

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
            found, changed = h.find(st, me)
            if found is None and not fresh:
                h.refresh()
                found, changed = h.find(st, me)
        except (Error, OSError):
            return None
    if found is None and changed:
        name, diff = changed[0]
        base = os.path.basename(path)
        _notice((os.path.abspath(path), name, tuple(diff)), f"reading {base} from disk: changed since it was put in {name!r} ({', '.join(diff)})")
    return found


# ---- opening ----------------------------------------------------------------

def _open(name, client, readonly):
    """(Views by name in header order, __metadata__) of bundle name."""
    b = client.tensors(name, readonly=readonly)
    return dict(b), b.metadata


def _placed(sources, off, n):
    """Where in the segment the daemon put the file's bytes [off, off+n),
    or None where it filled no one range that holds them."""
    for src in sources:
        if src.offset <= off and off + n <= src.offset + src.len:
            return src.at + off - src.offset
    return None


def _open_held(path, h, client, readonly):
    """(Views by name in header order, __metadata__) of the file at path,
    in bundle h: the tensors, dtypes, shapes and offsets are the file's own
    header's, read from the file, and the daemon's sources say where its
    bytes are in the segment. Nothing the bundle's writer said (its meta,
    its header, its shard table) is taken: a bundle that holds other bytes
    than the file's for a tensor cannot be made to serve them."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"gpushm: {path}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise ValueError(f"gpushm: {path}: a header of {n} bytes")
        prefix = head + f.read(n)
        st = os.fstat(f.fileno())
    if any(_differs(src, st) for src in h.sources):
        raise ValueError(f"gpushm: {path} changed while it was opened")
    metadata, entries = decode_bundle(prefix, st.st_size)
    seg = client.open(h.name, readonly)
    if seg.id != h.id:
        raise error("ENOENT", f"bundle {h.name!r} was replaced while it was being opened")
    m, views = seg._mapping(), {}
    for name, lay in entries:
        at = _placed(h.sources, lay.offset, lay.nbytes)
        if at is None:
            raise ValueError(f"gpushm: bundle {h.name!r} holds no range the daemon filled with tensor {name!r} of {path}")
        views[name] = View(m, Layout.c_order(lay.dtype, lay.shape, at))
    return views, metadata


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
    cpu = os.environ.get("GPUSHM_CPU_TENSORS", "auto") or "auto"
    if cpu not in _CPU_TENSORS:
        _notice(("GPUSHM_CPU_TENSORS", cpu), f"GPUSHM_CPU_TENSORS={cpu!r} is not one of {', '.join(_CPU_TENSORS)}; using 'auto'")
        cpu = "auto"
    return cpu, os.environ.get("GPUSHM_SAFETENSORS", "") == "copy"


# ---- cpu_tensors="auto": what the loader does next with a CPU tensor -----------

# Loaders that copy every tensor they read into a parameter of their own
# with copy_ and keep nothing they were given: vLLM's and SGLang's weight
# iterators and weight_loader methods (python/bench/_engine_loops.py cites
# the code). A GPU view is read once by that copy, device to device.
_COPYING_LOADERS = ("vllm.model_executor.model_loader", "sglang.srt.model_loader")
_TRANSFORMERS = "transformers.modeling_utils"
_DEPTH = 64


def _target(where):
    """The one CUDA device a device_map (or a value of one) puts everything
    on: "cuda:N", or "cuda" for the current one; None where it names
    another device, none, or more than one."""
    if hasattr(where, "values") and hasattr(where, "items"):
        found = {_target(v) for v in where.values()}
        return found.pop() if len(found) == 1 else None
    if isinstance(where, bool):
        return None
    if isinstance(where, int):
        return f"cuda:{where}" if where >= 0 else None
    if isinstance(where, str):
        return where if where == "cuda" or (where.startswith("cuda:") and where[5:].isdigit()) else None
    if getattr(where, "type", None) == "cuda":  # a torch.device
        index = getattr(where, "index", None)
        return "cuda" if index is None else f"cuda:{index}" if isinstance(index, int) else None
    return None


def _local(f, name):
    """A frame's local variable, or None; f_locals only for a frame whose
    code has it (on Python 3.12 and before, f_locals keeps a snapshot of
    every local alive on the frame)."""
    code = f.f_code
    if name not in code.co_varnames and name not in code.co_cellvars:
        return None
    return f.f_locals.get(name)


def next_step(frame=None):
    """What cpu_tensors="auto" gives a CPU request on a GPU bundle, from
    the loader that made it (found on the call stack, from frame up):
    "gpu" (views of the bundle) for a loader that copies every tensor into
    parameters of its own (vLLM, SGLang); "cuda:N" or "cuda" (a private
    copy on that device, which the loader may keep and write, as it would
    the tensor it asked for after moving it there) for transformers'
    from_pretrained with a device_map that puts every module on that one
    CUDA device, and no quantizer; None for anything else: such a program
    gets what it asked for, the file's bytes on the CPU (docs/python.md,
    "CPU tensors from a GPU bundle")."""
    f = frame if frame is not None else sys._getframe(1)
    quantized = False
    for _ in range(_DEPTH):
        if f is None:
            return None
        mod = f.f_globals.get("__name__", "")
        if isinstance(mod, str):
            if any(mod == p or mod.startswith(p + ".") for p in _COPYING_LOADERS):
                return "gpu"
            if mod == _TRANSFORMERS:
                # from_pretrained holds device_map; _load_pretrained_model,
                # nearer the open, the quantizer (transformers 5.17).
                quantized = quantized or _local(f, "hf_quantizer") is not None
                if "device_map" in f.f_code.co_varnames:
                    return None if quantized else _target(_local(f, "device_map"))
        f = f.f_back
    return None


def _auto(frame, fw, dev, copy, on_gpu):
    """(cpu_tensors, device, copy) for cpu_tensors="auto", or None where
    the request is better served by the file itself (next_step)."""
    if dev[0] != "cpu" or not on_gpu:
        return "gpu", dev, copy
    step = next_step(frame)
    if step is None or (step != "gpu" and fw != "pt"):
        return None
    if step == "gpu":
        return "gpu", dev, copy
    return "gpu", _device("pt", step), True  # a private copy where the loader moves it next


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
    reach every process that maps the bundle). cpu_tensors ("auto", "copy"
    or "gpu") and copy default to $GPUSHM_CPU_TENSORS and
    $GPUSHM_SAFETENSORS=copy; the module's docstring says what they do.
    backend is accepted for the library's signature and changes nothing."""
    fw = _framework(framework)
    dev = _device(fw, device)
    env_cpu, env_copy = _env_options()
    cpu_tensors = env_cpu if cpu_tensors is None else cpu_tensors
    if cpu_tensors not in _CPU_TENSORS:
        raise ValueError(f"gpushm: cpu_tensors={cpu_tensors!r}: want one of {', '.join(_CPU_TENSORS)}")
    frame = sys._getframe(1)
    copy = env_copy if copy is None else bool(copy)
    c = _client(client)

    def opened(what, views, metadata):
        cpu, d, cp = cpu_tensors, dev, copy
        if cpu == "auto":
            on_gpu = any(v.device is not None for v in views.values())
            cpu, d, cp = _auto(frame, fw, dev, copy, on_gpu) or ("copy", dev, copy)
        return _Open(what, views, metadata, fw, d, cpu, cp)

    if not _is_path(name_or_path):
        try:
            views, metadata = _open(name_or_path, c, readonly)
            return opened(f"bundle {name_or_path!r}", views, metadata)
        except NotFoundError:
            if not os.path.isfile(name_or_path):
                raise
    path = os.fsdecode(name_or_path)
    h = held(path, c)
    if h is None:
        raise error("ENOENT", f"{path} is not held by gpushm: no bundle records it as it is now "
                    "('gpushm put NAME FILE' copies it in)")
    views, metadata = _open_held(path, h, c, readonly)
    return opened(f"{path!r} in bundle {h.name!r}", views, metadata)


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
    if cpu == "auto":
        # A CPU request on a GPU bundle: as fast as the loader's next step
        # allows, else the file's own bytes from the page cache, as the
        # library reads them (never a copy out of the GPU and back).
        got = _auto(sys._getframe(1), fw, dev, copy, h.gpu)
        if got is None:
            return None
        cpu, dev, copy = got
    try:
        views, metadata = _open_held(path, h, _client(quiet=True), True)
    except (Error, OSError, ValueError, AttributeError) as e:
        if not isinstance(e, Error) or e.code not in ("EACCES", "EPERM", "ENOENT"):
            _notice((path, h.name, "open"), f"reading {os.path.basename(path)} from disk: bundle {h.name!r}: {e}")
        return None
    return _Open(f"{path!r} in bundle {h.name!r}", views, metadata, fw, dev, cpu, copy)
