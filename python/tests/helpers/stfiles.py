"""Safetensors files for the tests of gpushm.safetensors and gpushm.run,
written here as the library lays them out (8-byte length, JSON header,
data), and bundles made of them with the meta 'gpushm put' writes, origin
included (docs/protocol.md, "A checkpoint directory's bundle"), through
the client alone, so that these tests do not depend on the binary's put.
"""

import json
import os
import struct
from pathlib import Path

import numpy as np

from gpushm._tensors import bundle_meta

# Every dtype of the format that has a whole number of bytes an element:
# numpy's own, and the rest as raw bits (a uint of the same size).
DTYPES = {
    "BOOL": np.dtype(bool), "U8": np.dtype("u1"), "I8": np.dtype("i1"), "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"), "I32": np.dtype("<i4"), "U32": np.dtype("<u4"), "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
    "C64": np.dtype("<c8"),
}
RAW = {"BF16": np.dtype("<u2"), "F8_E4M3": np.dtype("u1"), "F8_E4M3FNUZ": np.dtype("u1"), "F8_E5M2": np.dtype("u1"),
       "F8_E5M2FNUZ": np.dtype("u1"), "F8_E8M0": np.dtype("u1")}


def every_dtype():
    """{name: (safetensors dtype, array)}: one tensor of each dtype, of
    shapes 0-d to 3-d, raw bits for bf16 and fp8."""
    rng = np.random.default_rng(7)
    out = {}
    for i, (st, dt) in enumerate(sorted({**DTYPES, **RAW}.items())):
        shape = [(), (5,), (3, 4), (2, 3, 4)][i % 4]
        if dt == np.dtype(bool):
            a = rng.integers(0, 2, shape).astype(bool)
        elif dt.kind in "iu":
            info = np.iinfo(dt)
            a = rng.integers(info.min, info.max, shape, dtype=dt, endpoint=True)
        elif dt.kind == "c":
            a = (rng.standard_normal(shape) + 1j * rng.standard_normal(shape)).astype(dt)
        else:
            a = rng.standard_normal(shape).astype(dt)
        out[f"t.{st.lower()}"] = (st, np.asarray(a))
    out["empty"] = ("F32", np.zeros((0, 3), np.float32))
    return out


def write(path, tensors, metadata=None):
    """Writes {name: (dtype, array)} or {name: array} as a safetensors file,
    in the order given, as safetensors lays data out (no gaps)."""
    header, chunks, off = {}, [], 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, t in tensors.items():
        st, a = t if isinstance(t, tuple) else (next(k for k, v in DTYPES.items() if v == t.dtype), t)
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": st, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        chunks.append(b)
        off += len(b)
    js = json.dumps(header).encode()
    js += b" " * (-len(js) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(js)) + js + b"".join(chunks))


def parse(path):
    """(metadata, {name: (dtype, shape, raw bytes)} in header order): what
    the file holds, read directly."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", None)
    out = {}
    for k, e in header.items():
        b, end = e["data_offsets"]
        out[k] = (e["dtype"], tuple(e["shape"]), data[8 + n + b:8 + n + end])
    return meta, out


def record(path, with_name=True):
    """What put records of a file: name, size, times, device, inode, and a
    content hash (its value is not checked on the open path)."""
    st = os.stat(path)
    r = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "dev": st.st_dev,
         "ino": st.st_ino, "crc32c": "00000000"}
    if with_name:
        r = {"name": os.path.basename(path), **r}
    return r


def _segment(client, name, data, meta, mode, fills=()):
    """The bundle: data written by this process (bytes, or a size to leave
    to the fills), then each (path, offset, at, n) of fills copied by the
    daemon, as 'gpushm put' has it copy the files; the daemon records what
    it copied (stat's sources), which is what loaders trust."""
    size = data if isinstance(data, int) else len(data)
    seg = client._create(name, size, meta, None, mode, False, uncommitted=True)
    if not isinstance(data, int):
        seg.write(data, 0)
    for path, off, at, n in fills:
        with open(path, "rb") as f:
            assert seg.fill(f, off, at, n) == n
    seg.commit()
    return seg


def put_file(client, name, path, mode=0o600, origin=True):
    """A bundle of one safetensors file, as 'gpushm put NAME FILE' makes
    it: the segment is the file, copied by the daemon. origin=False writes
    it from this process instead, as a client that claims to hold the file
    would: the daemon then records nothing of it."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack_from("<Q", data)
    meta = bundle_meta(n, len(json.loads(data[8:8 + n])) - (b'"__metadata__"' in data[8:8 + n]))
    if not origin:
        return _segment(client, name, data, meta, mode)
    meta["origin"] = {"dir": os.path.realpath(os.path.dirname(os.path.abspath(path))), "files": [record(path)]}
    return _segment(client, name, len(data), meta, mode, [(path, 0, 0, len(data))])


def _align(n):
    return -(-n // 64) * 64


def put_dir(client, name, paths, mode=0o600):
    """A bundle of a checkpoint directory's shards (paths, in that order),
    as 'gpushm put NAME DIR' lays it out: one header of every tensor, the
    shards' data regions, their own headers and the shard table."""
    shards, combined, metadata, data_at = [], {}, None, 0
    for p in paths:
        raw = Path(p).read_bytes()
        (n,) = struct.unpack_from("<Q", raw)
        h = json.loads(raw[8:8 + n])
        m = h.pop("__metadata__", None)
        metadata = metadata if metadata is not None else m
        for k, e in h.items():
            b, end = e["data_offsets"]
            combined[k] = {**e, "data_offsets": [data_at + b, data_at + end]}
        shards.append((p, raw[:8 + n], raw[8 + n:], data_at))
        data_at = _align(data_at + len(raw) - 8 - n)
    if metadata is not None:
        combined = {"__metadata__": metadata, **combined}
    js = json.dumps(combined).encode()
    js += b" " * (-(8 + len(js)) % 64)
    start = 8 + len(js)
    at = _align(start + data_at)
    table = []
    body = bytearray(struct.pack("<Q", len(js)) + js) + bytearray(data_at)
    for p, head, data, base in shards:
        body[start + base:start + base + len(data)] = data
    for p, head, data, base in shards:
        body += b"\0" * (at - len(body))
        table.append({"name": os.path.basename(p), "header": [at, len(head)], "data": [start + base, len(data)],
                      "origin": record(p, with_name=False)})
        body += head
        at = _align(len(body))
    body += b"\0" * (at - len(body))
    tab = json.dumps({"version": 1, "shards": table}).encode()
    body += tab
    meta = bundle_meta(len(js), sum(1 for k in combined if k != "__metadata__"))
    meta.update(source="dir", shards={"offset": at, "size": len(tab)},
                origin={"dir": os.path.realpath(os.path.dirname(os.path.abspath(paths[0])))})
    fills = [(p, len(head), start + base, len(data)) for p, head, data, base in shards]
    return _segment(client, name, bytes(body), meta, mode, fills)
