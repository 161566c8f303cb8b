"""Dtypes, tensor layouts, and the two metadata schemas a segment can carry.

A segment's ``meta`` (docs/python.md has the exact schemas) says how to see
its bytes:

- ``{"kind": "tensor", ...}``: one tensor, with dtype, shape, strides and
  byte offset, so that ``open(name)`` gives back the tensor that was stored.
- ``{"kind": "bundle", "format": "safetensors", ...}``: many tensors in the
  safetensors layout, the manifest being the segment's first bytes. The
  segment is then a valid safetensors file byte for byte, which is why
  ``gpushm put NAME model.safetensors`` can upload a file as it is.
"""

from __future__ import annotations

import json
import math
import struct
from typing import NamedTuple

# Safetensors refuses headers over 100 MB; so do we, before allocating.
MAX_HEADER = 100_000_000

# Bundles put tensor data at a multiple of this from the segment's base (a
# 2 MiB-aligned address), which is what vectorized kernels want.
BUNDLE_ALIGN = 64


class DType(NamedTuple):
    name: str  # the name in tensor meta: numpy's, or torch's for types numpy lacks
    code: int  # DLPack DLDataTypeCode
    bits: int
    typestr: str | None  # numpy array-interface type string, None if numpy has none
    safetensors: str | None  # safetensors dtype, None if it has none

    @property
    def itemsize(self) -> int:
        return self.bits // 8


_DTYPES = [
    DType("bool", 6, 8, "|b1", "BOOL"),
    DType("uint8", 1, 8, "|u1", "U8"),
    DType("int8", 0, 8, "|i1", "I8"),
    DType("int16", 0, 16, "<i2", "I16"),
    DType("uint16", 1, 16, "<u2", "U16"),
    DType("int32", 0, 32, "<i4", "I32"),
    DType("uint32", 1, 32, "<u4", "U32"),
    DType("int64", 0, 64, "<i8", "I64"),
    DType("uint64", 1, 64, "<u8", "U64"),
    DType("float16", 2, 16, "<f2", "F16"),
    DType("bfloat16", 4, 16, None, "BF16"),
    DType("float32", 2, 32, "<f4", "F32"),
    DType("float64", 2, 64, "<f8", "F64"),
    DType("complex64", 5, 64, "<c8", "C64"),
    DType("complex128", 5, 128, "<c16", None),
    # DLPack 1.1 codes; safetensors' F8_E4M3 is torch's float8_e4m3fn.
    DType("float8_e4m3fn", 10, 8, None, "F8_E4M3"),
    DType("float8_e4m3fnuz", 11, 8, None, "F8_E4M3FNUZ"),
    DType("float8_e5m2", 12, 8, None, "F8_E5M2"),
    DType("float8_e5m2fnuz", 13, 8, None, "F8_E5M2FNUZ"),
    DType("float8_e8m0fnu", 14, 8, None, "F8_E8M0"),
]

_BY_NAME = {d.name: d for d in _DTYPES}
_BY_DLPACK = {(d.code, d.bits): d for d in _DTYPES}
_BY_SAFETENSORS = {d.safetensors: d for d in _DTYPES if d.safetensors}
# torch and numpy spellings that differ from the canonical names.
_ALIASES = {
    "bool_": "bool", "half": "float16", "float": "float32", "double": "float64",
    "cfloat": "complex64", "cdouble": "complex128",
}
# Safetensors types packed below a byte: a tensor of these has no element
# address, so no DLPack or array-interface view can describe it.
_SUBBYTE = {"F4", "F6_E2M3", "F6_E3M2"}


def dtype_of(x) -> DType:
    """The DType for a name ("float32"), a numpy or torch dtype, or a numpy
    scalar type."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str):
        name = x
    else:
        name = getattr(x, "name", None)  # numpy and ml_dtypes dtypes
        if not isinstance(name, str):
            s = str(x)
            name = s[len("torch."):] if s.startswith("torch.") else getattr(x, "__name__", s)
    name = _ALIASES.get(name, name)
    dt = _BY_NAME.get(name)
    if dt is None:
        try:  # numpy spellings such as "<f4", "f8", np.float32
            import numpy

            n = numpy.dtype(x).name
            dt = _BY_NAME.get(_ALIASES.get(n, n))
        except Exception:
            dt = None
    if dt is None:
        raise TypeError(f"gpushm: dtype {x!r} is not supported; use one of: {', '.join(_BY_NAME)}")
    return dt


def dtype_from_dlpack(code: int, bits: int, lanes: int) -> DType:
    dt = _BY_DLPACK.get((code, bits))
    if dt is None or lanes != 1:
        raise TypeError(f"gpushm: DLPack dtype (code {code}, bits {bits}, lanes {lanes}) is not supported")
    return dt


def c_strides(shape) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


class Layout:
    """How a tensor lies in a segment: dtype, shape, strides in elements (None
    for C-contiguous), and the byte offset of element [0, ..., 0]. lo and hi
    bound the bytes it touches, relative to offset."""

    __slots__ = ("dtype", "shape", "strides", "offset", "numel", "lo", "hi", "contiguous", "_c")

    def __init__(self, dtype, shape, strides=None, offset=0):
        self.dtype = dtype_of(dtype)
        self.shape = tuple(_index(n, "shape") for n in shape)
        if any(n < 0 for n in self.shape):
            raise ValueError(f"gpushm: negative dimension in shape {self.shape}")
        self.offset = _index(offset, "offset")
        self.numel = math.prod(self.shape)
        cs = c_strides(self.shape)
        if strides is not None:
            strides = tuple(_index(s, "strides") for s in strides)
            if len(strides) != len(self.shape):
                raise ValueError(f"gpushm: strides {strides} do not match shape {self.shape}")
        # Dimensions of extent 1 never move the address, so their strides
        # cannot make a layout non-contiguous; nor can any of an empty one.
        self.contiguous = strides is None or self.numel == 0 or all(
            s == c for n, s, c in zip(self.shape, strides, cs) if n > 1)
        self.strides = None if self.contiguous else strides
        size = self.dtype.itemsize
        if self.numel == 0:
            self.lo = self.hi = 0
        else:
            es = self.strides or cs
            self.lo = sum((n - 1) * s * size for n, s in zip(self.shape, es) if s < 0)
            self.hi = sum((n - 1) * s * size for n, s in zip(self.shape, es) if s > 0) + size
        self._c = None

    @classmethod
    def c_order(cls, dtype: DType, shape: tuple, offset: int) -> Layout:
        """The C-contiguous layout of dtype and shape, a tuple of
        non-negative ints the caller has checked: what __init__ makes of
        them, without its checks (a bundle's header lists hundreds)."""
        lay = cls.__new__(cls)
        lay.dtype, lay.shape, lay.strides, lay.offset = dtype, shape, None, offset
        lay.numel = n = math.prod(shape)
        lay.lo, lay.hi = 0, n * dtype.itemsize
        lay.contiguous, lay._c = True, None
        return lay

    def fits(self, size: int) -> bool:
        """Whether every element lies inside a segment of size bytes."""
        return self.offset + self.lo >= 0 and self.offset + self.hi <= size

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def dense(self) -> bool:
        """True when the elements fill their extent without gaps (contiguous,
        or a permutation of contiguous such as a transpose)."""
        return self.hi - self.lo == self.nbytes

    def element_strides(self) -> tuple:
        return self.strides if self.strides is not None else c_strides(self.shape)

    def dlpack_arrays(self):
        """int64 arrays of shape and strides for DLPack, built once."""
        if self._c is None:
            import ctypes

            n = len(self.shape)
            self._c = ((ctypes.c_int64 * n)(*self.shape), (ctypes.c_int64 * n)(*self.element_strides()))
        return self._c

    def meta(self) -> dict:
        return {"kind": "tensor", "dtype": self.dtype.name, "shape": list(self.shape),
                "strides": None if self.strides is None else list(self.strides), "offset": self.offset}

    def __eq__(self, other):
        return isinstance(other, Layout) and (self.dtype, self.shape, self.strides, self.offset) == (
            other.dtype, other.shape, other.strides, other.offset)

    def __repr__(self):
        return f"Layout({self.dtype.name}, {self.shape}, strides={self.strides}, offset={self.offset})"


def _index(v, what) -> int:
    if isinstance(v, bool) or not hasattr(v, "__index__"):
        raise TypeError(f"gpushm: {what} must be integers, got {v!r}")
    return v.__index__()


_layouts: dict = {}


def layout_from_meta(meta, size: int) -> Layout:
    """The layout a segment's meta describes; raw bytes (uint8[size]) for
    segments that are not single tensors. Layouts are immutable and shared:
    a pipeline handing off tensors of one shape parses the meta once."""
    tensor = isinstance(meta, dict) and meta.get("kind") == "tensor"
    try:
        key = (meta["dtype"], tuple(meta["shape"]), meta.get("strides") and tuple(meta["strides"]),
               meta.get("offset", 0), size) if tensor else size
        lay = _layouts.get(key)
    except (KeyError, TypeError):  # malformed: parsed below, to say why
        key = lay = None
    if lay is not None:
        return lay
    if not tensor:
        lay = Layout("uint8", (size,))
    else:
        try:
            lay = Layout(meta["dtype"], meta["shape"], meta.get("strides"), meta.get("offset", 0))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"gpushm: the segment's tensor meta {json.dumps(meta)} is invalid: {e}") from None
        if not lay.fits(size):
            raise ValueError(f"gpushm: the segment's tensor meta {json.dumps(meta)} reaches outside its {size} bytes")
    if key is not None:
        if len(_layouts) >= 1024:
            _layouts.clear()
        _layouts[key] = lay
    return lay


# ---- bundles: the safetensors layout inside one segment ----------------------

def bundle_meta(header_bytes: int, count: int) -> dict:
    return {"kind": "bundle", "format": "safetensors", "header_bytes": header_bytes, "tensors": count}


def is_bundle(meta) -> bool:
    return isinstance(meta, dict) and meta.get("kind") == "bundle" and meta.get("format") == "safetensors"


def bundle_files(meta, size: int) -> list:
    """The small files a bundle keeps beside its tensors ('gpushm put' of a
    checkpoint directory): [(name, offset, size)], checked to lie inside the
    segment and to be plain file names."""
    out = []
    for f in meta.get("files") or []:
        try:
            name, off, n = f["name"], f["offset"], f["size"]
        except (KeyError, TypeError):
            raise ValueError(f"gpushm: bundle meta lists a file as {f!r}") from None
        if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\0" in name:
            raise ValueError(f"gpushm: bundle meta lists a file named {name!r}, which is not a plain file name")
        if not (isinstance(off, int) and isinstance(n, int) and 0 <= off and 0 <= n and off + n <= size):
            raise ValueError(f"gpushm: bundle file {name!r} [{off}, +{n}) lies outside the segment's {size} bytes")
        out.append((name, off, n))
    return out


def encode_bundle(entries, metadata=None):
    """Lays out tensors as a safetensors file. entries: (name, Layout) in the
    caller's order. Returns (prefix, {name: data begin relative to the
    segment}, total size): prefix is the 8-byte length and the header.

    Safetensors readers demand that the tensors tile the data with no gap, so
    alignment comes from ordering, not padding: tensors whose size is a
    multiple of 64 go first (each then starts 64-aligned), the rest follow by
    decreasing element size (each then starts aligned to its element). The
    header is padded with spaces so the data starts 64-aligned."""
    header = {}
    if metadata is not None:
        if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("gpushm: bundle metadata must be a dict of str to str (safetensors' __metadata__)")
        header["__metadata__"] = dict(metadata)
    for name, lay in entries:
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"gpushm: tensor name {name!r} cannot be used in a bundle")
        if lay.dtype.safetensors is None:
            raise TypeError(f"gpushm: tensor {name!r}: safetensors has no {lay.dtype.name} type")
    aligned = [e for e in entries if e[1].nbytes % BUNDLE_ALIGN == 0]
    rest = sorted((e for e in entries if e[1].nbytes % BUNDLE_ALIGN), key=lambda e: -e[1].dtype.itemsize)
    begins, off = {}, 0
    for name, lay in aligned + rest:
        begins[name] = off
        off += lay.nbytes
    for name, lay in entries:
        header[name] = {"dtype": lay.dtype.safetensors, "shape": list(lay.shape),
                        "data_offsets": [begins[name], begins[name] + lay.nbytes]}
    js = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    js += b" " * (-(8 + len(js)) % BUNDLE_ALIGN)
    start = 8 + len(js)
    return struct.pack("<Q", len(js)) + js, {k: start + b for k, b in begins.items()}, start + off


def json_header(raw: bytes, what: str) -> dict:
    """A safetensors header's JSON (raw, without its 8-byte length) as a
    dict; what names it in the ValueError that says why it is not one."""
    try:
        header = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"gpushm: {what} is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"gpushm: {what} is not a JSON object")
    return header


def decode_bundle(prefix: bytes, size: int):
    """Parses the safetensors prefix (8-byte length + header) of a segment of
    size bytes. Returns (__metadata__ or None, [(name, Layout)]) in header
    order, each Layout's offset relative to the segment."""
    (n,) = struct.unpack_from("<Q", prefix)
    if n > MAX_HEADER or 8 + n > size or len(prefix) < 8 + n:
        raise ValueError(f"gpushm: bundle header of {n} bytes does not fit the segment's {size} bytes")
    header = json_header(prefix[8:8 + n], "bundle header")
    start, data = 8 + n, size - 8 - n
    metadata, out = header.pop("__metadata__", None), []
    for name, ent in header.items():
        try:
            st, shape, (b, e) = ent["dtype"], ent["shape"], ent["data_offsets"]
            if st in _SUBBYTE:
                raise ValueError(f"dtype {st} packs elements below a byte, which no DLPack view can describe")
            dt = _BY_SAFETENSORS.get(st)
            if dt is None:
                raise ValueError(f"unknown dtype {st!r}")
            if type(shape) is list and type(b) is int and all(type(n) is int and n >= 0 for n in shape):
                lay = Layout.c_order(dt, tuple(shape), start + b)
            else:  # what is wrong with it, said by the checks
                lay = Layout(dt, shape, None, start + _index(b, "data_offsets"))
            if not 0 <= b <= e <= data or e - b != lay.nbytes:
                raise ValueError(f"data_offsets [{b}, {e}] do not hold {lay.nbytes} bytes inside the {data} data bytes")
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"gpushm: bundle tensor {name!r}: {err}") from None
        out.append((name, lay))
    return metadata, out


def layout_of(shape, dtype, nbytes, what: str) -> Layout:
    """The Layout that shape and dtype ask for (what: "create", "a channel",
    for the errors): an int shape is one dimension; no shape takes
    nbytes / itemsize elements."""
    if dtype is None:
        raise TypeError(f"gpushm: {what} with a shape needs a dtype")
    dt = dtype_of(dtype)
    if shape is None:
        if nbytes is None or nbytes % dt.itemsize:
            raise ValueError(f"gpushm: {what} of {dt.name} without a shape needs nbytes, a multiple of {dt.itemsize}")
        shape = (nbytes // dt.itemsize,)
    if isinstance(shape, int):
        shape = (shape,)
    return Layout(dt, shape)


def shard_table_region(meta, size: int):
    """Where a checkpoint directory's bundle keeps its shard table
    (offset, length), checked to lie inside the segment; None for a bundle
    without one (a single file, put_tensors)."""
    r = meta.get("shards") if isinstance(meta, dict) else None
    if r is None:
        return None
    try:
        off, n = r["offset"], r["size"]
    except (KeyError, TypeError):
        raise ValueError(f"gpushm: bundle meta names its shard table as {r!r}") from None
    if not (type(off) is int and type(n) is int and 0 <= off and 0 < n and off + n <= size):
        raise ValueError(f"gpushm: bundle shard table [{off!r}, +{n!r}) lies outside the segment's {size} bytes")
    return off, n


def decode_shard_table(raw: bytes, size: int) -> list:
    """The shards of a checkpoint directory's bundle from its table's bytes:
    dicts with "name", "header" and "data" ((offset, length) inside the
    segment, checked) and "origin" (what put recorded of the file, or
    None)."""
    try:
        table = json.loads(raw.decode())
        shards = table["shards"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"gpushm: bundle shard table is not valid: {e}") from None
    out = []
    for s in shards if isinstance(shards, list) else [None]:
        try:
            name, header, data = s["name"], tuple(s["header"]), tuple(s["data"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"gpushm: bundle shard table lists a shard as {s!r}") from None
        if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
            raise ValueError(f"gpushm: bundle shard table lists a shard named {name!r}, which is not a plain file name")
        for what, (off, n) in (("header", header), ("data", data)):
            if not (type(off) is int and type(n) is int and 0 <= off and 0 <= n and off + n <= size):
                raise ValueError(f"gpushm: bundle shard {name!r}: {what} [{off!r}, +{n!r}) lies outside the segment's {size} bytes")
        origin = s.get("origin")
        out.append({"name": name, "header": header, "data": data, "origin": origin if isinstance(origin, dict) else None})
    return out


def index_layout(lay: Layout, key) -> Layout:
    """The layout of lay[key] for numpy's basic indexing: ints (negative
    from the end), slices with a positive step, and one Ellipsis, in a
    tuple or alone. What it gives is a view of the same bytes."""
    if isinstance(key, list):
        if key:
            raise TypeError("gpushm: indexing with a non-empty list is not supported (safetensors' slices take ints and slices)")
        key = ()
    if not isinstance(key, tuple):
        key = (key,)
    if sum(k is Ellipsis for k in key) > 1:
        raise IndexError("gpushm: an index can only have a single ellipsis ('...')")
    nd = len(lay.shape)
    given = len(key) - (Ellipsis in key)
    if given > nd:
        raise IndexError(f"gpushm: too many indices: the tensor has {nd} dimensions, {given} were indexed")
    if Ellipsis in key:
        i = key.index(Ellipsis)
        key = key[:i] + (slice(None),) * (nd - given) + key[i + 1:]
    else:
        key = key + (slice(None),) * (nd - given)
    size = lay.dtype.itemsize
    offset, shape, strides = lay.offset, [], []
    for dim, (k, n, s) in enumerate(zip(key, lay.shape, lay.element_strides())):
        if isinstance(k, slice):
            start, stop, step = k.indices(n)
            if step <= 0:
                raise ValueError(f"gpushm: slice step {k.step} in dimension {dim}: only positive steps are supported")
            count = max(0, (stop - start + step - 1) // step)
            if count:
                offset += start * s * size
            shape.append(count)
            strides.append(s * step)
        elif hasattr(k, "__index__") and not isinstance(k, bool):
            i = k.__index__()
            if not -n <= i < n:
                raise IndexError(f"gpushm: index {i} is out of bounds for dimension {dim} of size {n}")
            offset += (i % n) * s * size
        else:
            raise TypeError(f"gpushm: cannot index a tensor with {k!r}: use ints, slices and '...'")
    return Layout(lay.dtype, tuple(shape), tuple(strides), offset)
