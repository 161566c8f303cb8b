"""What the daemon says about a segment (docs/protocol.md, "Segment
object"). It imports nothing of gpushm's, so every module can use it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SegmentInfo:
    """A segment as the daemon describes it (docs/protocol.md, "Segment
    object"). meta is None in list() results."""

    id: int
    name: str
    size: int
    alloc_size: int
    device: int
    handle_type: str
    uid: int
    gid: int
    mode: int
    opens: int
    created: int  # Unix nanoseconds
    meta: object = None
    # The GPU of a cuda segment by UUID: the daemon's device number may not
    # be this process's (a container, CUDA_VISIBLE_DEVICES).
    uuid: str = None
    uncommitted: bool = False  # still being written: not openable until committed
    # Where the bytes are: "gpu" (on its device) or "host" (evicted; an open
    # brings it back). last_open: Unix nanoseconds. pinned: never evicted.
    tier: str = "gpu"
    last_open: int = 0
    pinned: bool = False
    # Versions (docs/python.md, "Release, reacquire and versions"): which
    # version of its name this segment is (1 for the first; each commit of
    # a next version adds one); versions, in stat replies only, the name's
    # earlier versions that someone still holds, oldest first.
    version: int = 1
    versions: tuple = ()
    # Durable segments (docs/disk.md): persist says it is one; synced is
    # when its copy on disk was written (Unix nanoseconds, 0: none yet),
    # stale that it was opened to be written since.
    persist: bool = False
    synced: int = 0
    stale: bool = False
    # offer: offered to the daemon's peers on other nodes (docs/peers.md).
    offer: bool = False
    # sources, in stat replies only: the ranges the daemon itself filled
    # from files, as Source (docs/protocol.md, "Sources").
    sources: tuple = ()

    @classmethod
    def from_wire(cls, d: dict) -> SegmentInfo:
        info = cls(*[d.get(k, dflt) for k, dflt in _INFO_FIELDS])
        held = d.get("versions")
        if held is not None:
            object.__setattr__(info, "versions", tuple(HeldVersion.from_wire(v) for v in held))
        srcs = d.get("sources")
        object.__setattr__(info, "sources", tuple(Source.from_wire(s) for s in srcs if isinstance(s, dict))
                           if isinstance(srcs, list) else ())
        return info


@dataclasses.dataclass(frozen=True)
class Source:
    """A range of a segment the daemon filled from a file (stat's sources):
    the file's device, inode, size, mtime and ctime as the daemon saw them
    through the descriptor it read, where the range starts in the file
    (offset) and in the segment (at), its length and its CRC-32C."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    offset: int
    at: int
    len: int
    crc32c: str = ""

    @classmethod
    def from_wire(cls, d: dict) -> Source:
        return cls(*[d.get(f.name, 0 if f.type != "str" else "") for f in dataclasses.fields(cls)])


@dataclasses.dataclass(frozen=True)
class HeldVersion:
    """An earlier version of a name that readers still hold (stat's
    versions): its segment id, version, opens, and the processes holding
    it that the daemon could name."""

    id: int
    version: int
    opens: int
    pids: tuple = ()

    @classmethod
    def from_wire(cls, d: dict) -> HeldVersion:
        return cls(d.get("id", 0), max(d.get("version", 1), 1), d.get("opens", 0), tuple(d.get("pids") or ()))


_INFO_FIELDS = [(f.name, f.default if f.default is not dataclasses.MISSING else 0) for f in dataclasses.fields(SegmentInfo)]
