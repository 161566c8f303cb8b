"""Tensor bundles: many named tensors in one segment, in the safetensors
layout (docs/python.md, "API"). Bundle is a bundle's tensors as Views
by name; Bundles gives Client put_tensors, tensors and files. The bundle
format itself (header, meta, files) is _tensors'."""

from __future__ import annotations

import json

from . import _dlpack
from ._tensors import Layout, bundle_files, bundle_meta, decode_bundle, encode_bundle, is_bundle
from ._view import View


class Bundles:
    """Client's bundle methods, over the core's _create, open, stat and
    _abandon (gpushm._client composes them into Client)."""

    def put_tensors(self, name: str, tensors: dict, *, metadata: dict | None = None, device: int | None = None,
                    mode: int | None = None, next_version: bool = False, commit: bool = True,
                    persist: bool = False):
        """Stores many named tensors in one segment, in the safetensors
        layout, so that a model's weights cost one name and one mapping.
        metadata is safetensors' __metadata__ (str to str); mode as
        create's. next_version makes the bundle the name's next version
        (create's), current once every tensor is in it. commit=False returns it filled and not yet
        committed: its commit() names it (or makes the version current).
        persist=True makes it durable, as create's: on disk once committed.
        Returns the bundle's Segment."""
        if not tensors:
            raise ValueError("gpushm: put_tensors needs at least one tensor")
        borrowed = []
        try:
            entries = []
            for key, t in tensors.items():
                b = _dlpack.borrow(t)
                borrowed.append(b)
                lay = Layout(b.dtype, b.shape, b.strides)
                if not lay.contiguous:
                    raise ValueError(f"gpushm: put_tensors {name!r}: tensor {key!r} is not C-contiguous; call .contiguous() (torch) or numpy.ascontiguousarray first")
                entries.append((key, lay))
                if device is None and b.on_gpu and self.backend == "cuda":
                    device = self._daemon_device(b.device_id)
            prefix, begins, total = encode_bundle(entries, metadata)
            seg = self._create(name, total, bundle_meta(len(prefix) - 8, len(entries)), device, mode, False,
                               uncommitted=True, next_version=next_version, persist=persist)
            try:
                m = seg._m
                seg.write(prefix, 0)
                for (key, lay), b in zip(entries, borrowed):
                    _dlpack.copy_in(m, begins[key], b, b.ptr, lay.nbytes)
                if commit:
                    seg.commit()
            except BaseException:
                self._abandon(seg)
                raise
        finally:
            for b in borrowed:
                b.release()
        return seg

    def tensors(self, name: str, readonly: bool | None = None) -> Bundle:
        """The tensors of a bundle segment (put_tensors, or 'gpushm put' of a
        .safetensors file or a checkpoint directory), as Views by name, in
        header order. .metadata is the header's __metadata__. readonly=None
        maps read-only if the bundle was put with --readonly-default (which
        costs a stat), read-write otherwise."""
        if readonly is None:
            readonly = self._readonly_default(name)
        return bundle_of(self.open(name, readonly))

    def _readonly_default(self, name: str) -> bool:
        meta = self.stat(name).meta
        return bool(is_bundle(meta) and meta.get("readonly") is True)

    def files(self, name: str, only=None) -> dict:
        """The small files a bundle keeps beside its tensors ('gpushm put' of
        a checkpoint directory: config.json, the tokenizer's, ...), as bytes
        by name; {} for a bundle without any. Reading them copies out of the
        segment (device to host on a GPU); nothing is read from disk. only,
        a function of a file's name, says which to read (default: all)."""
        seg = self.open(name, True)
        try:
            return bundle_files_of(seg, only)
        finally:
            seg.close()


def bundle_of(seg) -> Bundle:
    """The Bundle of seg's tensors, its header parsed once per mapping."""
    m = seg._mapping()
    parsed = m.cache.get("bundle")
    if parsed is None:
        meta, name = seg.meta, seg.name
        if not is_bundle(meta):
            raise ValueError(f"gpushm: segment {name!r} is not a tensor bundle (its meta is {json.dumps(meta)})")
        n = meta.get("header_bytes")
        if not isinstance(n, int) or n < 2 or 8 + n > m.size:
            raise ValueError(f"gpushm: bundle {name!r}: meta header_bytes {n!r} does not fit the segment's {m.size} bytes")
        # One small copy of the header; on a GPU, device to host.
        parsed = decode_bundle(m.read(0, 8 + n), m.size)
        m.cache["bundle"] = parsed
    metadata, entries = parsed
    b = Bundle((k, View(m, lay)) for k, lay in entries)
    b.metadata, b.segment = metadata, seg
    return b


class Bundle(dict):
    """Views by tensor name; .metadata is safetensors' __metadata__ (or
    None), .segment the open Segment."""

    metadata = None
    segment = None

    def files(self, only=None) -> dict:
        """The bundle's small files as bytes by name, read through the
        bundle's own mapping (Client.files, without another open)."""
        return bundle_files_of(self.segment, only)


def bundle_files_of(seg, only) -> dict:
    """The small files of the bundle segment seg, as bytes by name."""
    meta = seg.meta
    if not is_bundle(meta):
        raise ValueError(f"gpushm: segment {seg.name!r} is not a tensor bundle (its meta is {json.dumps(meta)})")
    return {n: seg.read(size, off) for n, off, size in bundle_files(meta, seg.size) if only is None or only(n)}
