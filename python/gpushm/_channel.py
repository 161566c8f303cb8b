"""Channels: a stream of same-shaped tensors from one process to another,
through slots both map once (docs/protocol.md, "Channels", is the protocol
this follows to the letter; docs/python.md, "Channels", the API).

A hand-off touches only shared memory: the producer publishes message k by
storing head = k + 1 in the control block and bumping the consumer's event
word, and wakes the consumer's futex only if it said that it may be asleep;
on a GPU its stream first writes filled[k % slots] = k + 1 after the work
that fills the slot (cuStreamWriteValue64), and the consumer's stream waits
for that value (cuStreamWaitValue64) before the work that reads it. So no
CPU ever waits for a GPU, and the daemon takes no part.

Memory ordering: the block's words are read and written with aligned 4- and
8-byte loads and stores. On x86-64 those are atomic, and the machine keeps
stores in order and loads in order (TSO), which is the release and acquire
ordering the protocol asks of head and tail; calls into ctypes keep the
compiler from reordering across them. Elsewhere (arm64) the words go
through libatomic's sequentially consistent loads and stores.

An event word is bumped with a plain load and store, not an atomic add: two
bumps that race (the producer's and the daemon's) may count once, but each
is followed by a wake (or the check whether one is needed), and a waiter
checks its condition after it reads the word, so no wake is lost.

The sleeping words (version 2 of the block): a waiter about to sleep sets
its end's word, then reads its event word and its condition again, and
sleeps only while the event word holds what it read; a waker stores its
counter, bumps the event word, then reads the sleeping word, and wakes
only if it is set. Each side's store must be seen before its next load, or
both could miss the other (a lost wake): x86 keeps stores in order but may
let a load pass an earlier store, so both sides put a full barrier between
(_fence: a locked instruction); libatomic's sequentially consistent loads
and stores need none. A waiter also sleeps at most _TICK at a time, so that
a peer that died between its store and its wake, or one that clears the
sleeping word, delays it but cannot hang it.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
import sys
import threading
import time
import warnings
import weakref

from . import _cuda, _mapping
from ._errors import Error, InvalidError, NotFoundError, error
from ._tensors import Layout, dtype_of, layout_of
from ._info import SegmentInfo
from ._view import View

# The control block (docs/protocol.md).
BLOCK_BYTES = 4096
MAX_SLOTS = 64
_MAGIC = b"GPUSHMC1"
# The block's layout version: an end of another one must not share the
# channel (one of version 1 would sleep unwoken).
_VERSION = 2
_OFF_VERSION, _OFF_SLOTS, _OFF_SLOT_BYTES, _OFF_STRIDE = 8, 12, 16, 24
_OFF_HEAD, _OFF_TAKEN, _OFF_TAIL = 64, 128, 192
_OFF_TX, _OFF_RX = 256, 272  # u32 state, u32 pid, u64 start
_OFF_BROKEN, _OFF_REMOVED, _OFF_BROKEN_END, _OFF_BREAKS = 320, 328, 336, 344
_OFF_RX_EVENT, _OFF_TX_EVENT = 384, 448
_OFF_RX_SLEEP, _OFF_TX_SLEEP = 388, 452  # an end's "I may be asleep" (version 2)
_OFF_FILLED, _OFF_DRAINED = 1024, 1536
_ATTACHED, _GONE = 1, 2
# The mark of a filled flag the daemon wrote for a message its dead
# producer never finished (docs/protocol.md, "Channels").
_CUT = 1 << 62
_U64 = (1 << 64) - 1
_HALF = 1 << 63


def _reached(v, want):
    """Whether a flag holding v meets a stream's wait for want: the cyclic
    greater-or-equal of CU_STREAM_WAIT_VALUE_GEQ."""
    return (v - want) & _U64 < _HALF

TX, RX = "tx", "rx"
_ROLES = {"tx": TX, "producer": TX, "rx": RX, "consumer": RX}
_WHO = {TX: "producer", RX: "consumer"}

# A sleeping waiter looks again at least this often (ns).
_TICK = 100_000_000
# A cuda consumer gives slots back in groups of up to slots // _GROUP
# messages, each group with one driver call (Channel._release); fewer than
# 2 * _GROUP slots, one at a time.
_GROUP = 8
# A stream wait queued for a message the other end's GPU has not finished
# covers at most this many messages (Channel._cover).
_AHEAD = 8
_OP_WAIT, _OP_WRITE = _cuda.CU_STREAM_MEM_OP_WAIT_VALUE_64, _cuda.CU_STREAM_MEM_OP_WRITE_VALUE_64
# _End.wait_stream when waits were queued on more than one stream.
_MIXED = object()
# How long close() waits for this end's last GPU write to land (s).
_CLOSE_WAIT = 10.0


# ---- errors -------------------------------------------------------------

class ChannelRemovedError(Error):
    """The channel was removed ('gpushm rm', Client.unlink): both ends stop."""

    code = "EIDRM"


class BrokenMessageError(Error):
    """The producer died before it finished writing message .seq: that
    message and every one it sent after it were cut off (their contents are
    undefined, and so are the results of work queued on them). Raised once
    per break; recv then skips the messages cut off."""

    code = "EBADMSG"
    seq = None


class NoConsumerError(Error, BrokenPipeError):
    """send() found no consumer attached, on a channel opened with
    wait_for_consumer=False."""

    code = "EPIPE"


def _err(cls, msg):
    e = cls(getattr(errno, cls.code), f"gpushm: {msg}")
    e.code = cls.code
    return e


# ---- shared words and futexes ---------------------------------------------

_X86 = platform.machine().lower() in ("x86_64", "amd64")
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine().lower())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
                     ctypes.c_uint]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex_wait(addr, seen, ns):
    """Sleeps while the u32 at addr is seen, at most ns (not a private
    futex: the other end is another process)."""
    ts = _Timespec(ns // 1_000_000_000, ns % 1_000_000_000)
    _syscall(_SYS_FUTEX, addr, _FUTEX_WAIT, seen, ctypes.byref(ts), None, 0)


def _futex_wake(addr):
    _syscall(_SYS_FUTEX, addr, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)


def _notify(ev, sleep, addr):
    """Bumps the event word ev (at addr) and wakes its end if it says that
    it may be asleep: a hand-off to an end that polls makes no system call."""
    ev.value = (ev.value + 1) & 0xFFFFFFFF
    _fence()
    if sleep.value:
        _futex_wake(addr)


def _notify_always(ev, sleep, addr):
    ev.value = (ev.value + 1) & 0xFFFFFFFF
    _futex_wake(addr)


if _X86:
    def _u64(addr):
        return ctypes.c_uint64.from_address(addr)

    def _u32(addr):
        return ctypes.c_uint32.from_address(addr)

    def _u64s(addr, n):
        return (ctypes.c_uint64 * n).from_address(addr)

    # A full barrier: a locked instruction, which glibc's and musl's
    # pthread_spin_trylock is (an exchange or a compare-and-exchange)
    # whatever it finds. The lock is never unlocked; its instruction is
    # what is wanted, at the cost of one ctypes call (0.1 us, against the
    # 1 to 3 us of the wake it saves).
    try:
        _trylock = _libc.pthread_spin_trylock
        _trylock.restype = ctypes.c_int
        _spinlock = ctypes.c_int(0)
        _fence = functools.partial(_trylock, ctypes.byref(_spinlock))
    except AttributeError:
        # No barrier to be had: every hand-off wakes, as in version 1.
        _fence = None
else:
    _atomic = None
    try:
        _atomic = ctypes.CDLL("libatomic.so.1")
        for _n, _r, _a in (("__atomic_load_8", ctypes.c_uint64, [ctypes.c_void_p, ctypes.c_int]),
                           ("__atomic_store_8", None, [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int]),
                           ("__atomic_load_4", ctypes.c_uint32, [ctypes.c_void_p, ctypes.c_int]),
                           ("__atomic_store_4", None, [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int])):
            getattr(_atomic, _n).restype, getattr(_atomic, _n).argtypes = _r, _a
    except OSError:
        _atomic = None
    _SEQ_CST = 5

    class _Word:
        __slots__ = ("_p", "_load", "_store")

        def __init__(self, addr, bits):
            if _atomic is None:
                raise OSError(errno.ENOSYS, f"gpushm: channels on {platform.machine()} need libatomic.so.1 (the libatomic1 package)")
            self._p = addr
            self._load = getattr(_atomic, f"__atomic_load_{bits // 8}")
            self._store = getattr(_atomic, f"__atomic_store_{bits // 8}")

        @property
        def value(self):
            return self._load(self._p, _SEQ_CST)

        @value.setter
        def value(self, v):
            self._store(self._p, v, _SEQ_CST)

    class _Words:
        __slots__ = ("_w",)

        def __init__(self, addr, n):
            self._w = [_Word(addr + 8 * i, 64) for i in range(n)]

        def __getitem__(self, i):
            return self._w[i].value

        def __setitem__(self, i, v):
            self._w[i].value = v

    def _u64(addr):
        return _Word(addr, 64)

    def _u32(addr):
        return _Word(addr, 32)

    def _u64s(addr, n):
        return _Words(addr, n)

    def _fence():
        """Sequentially consistent loads and stores order themselves."""


# Without a barrier, every hand-off wakes, as in version 1.
_WAKE_ALWAYS = _fence is None
if _WAKE_ALWAYS:
    _notify, _fence = _notify_always, lambda: None


def _release_block(dev, ptr, registered, sync=True):
    """Unpins (once the GPU is done with it: sync) and unmaps a control
    block."""
    try:
        if registered:
            if sync:
                dev.synchronize()
            dev.unregister_host(ptr)
        _mapping.munmap(ptr, BLOCK_BYTES)
    except Exception as e:
        warnings.warn(f"gpushm: releasing a channel's control block failed, it stays mapped: {e}", RuntimeWarning)


# ---- frameworks -----------------------------------------------------------

def _import(name):
    mod = sys.modules.get(name)
    if mod is not None:
        return mod
    import importlib

    return importlib.import_module(name)


def _pick_framework(framework, on_gpu):
    if framework == "auto":
        names = ("torch", "cupy") if on_gpu else ("numpy",)
        for n in names:
            try:
                _import(n)
                return n
            except ImportError:
                continue
        return None
    if framework not in ("torch", "cupy", "numpy", None):
        raise ValueError(f"gpushm: framework {framework!r}: want \"torch\", \"cupy\", \"numpy\", None or \"auto\"")
    if framework == "numpy" and on_gpu:
        raise ValueError("gpushm: framework \"numpy\" needs a channel in host memory; this one is on a GPU (use torch or cupy)")
    return framework


def _wrapper(framework):
    """A function making the framework's tensor of a View, zero-copy."""
    if framework is None:
        return lambda v: v
    if framework == "numpy":
        return lambda v: v.numpy()
    mod = _import(framework)
    return mod.from_dlpack


def _current_stream(framework, device):
    """A function giving the framework's current stream on device, as a
    CUstream (0: the legacy default stream)."""
    if framework == "torch":
        torch = _import("torch")
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return functools.partial(raw, device)  # no Python frame: it is on every hand-off
        return lambda: torch.cuda.current_stream(device).cuda_stream
    if framework == "cupy":
        cupy = _import("cupy")
        try:
            cupy.cuda.get_current_stream(device)
            return lambda: cupy.cuda.get_current_stream(device).ptr
        except TypeError:  # an older CuPy: the current device's
            return lambda: cupy.cuda.get_current_stream().ptr
    return lambda: 0


def stream_handle(stream) -> int:
    """A CUstream from a torch.cuda.Stream, a CuPy stream, an object with
    __cuda_stream__, or an int."""
    if isinstance(stream, int):
        return stream
    h = getattr(stream, "cuda_stream", None)  # torch
    if h is None and hasattr(stream, "__cuda_stream__"):
        h = stream.__cuda_stream__()[1]
    if h is None:
        h = getattr(stream, "ptr", None)  # CuPy
    if not isinstance(h, int):
        raise TypeError(f"gpushm: stream {stream!r}: want a torch.cuda.Stream, a CuPy stream, or a CUstream as an int")
    return h


# ---- opening ----------------------------------------------------------------

# Every channel end of this process, to refuse a second end of one role in
# one process and both ends on one connection (see _check_ends).
_ENDS = weakref.WeakSet()


def _check_ends(client, name, role):
    for ch in list(_ENDS):
        if ch._closed or ch._client.socket != client.socket or ch.name != name or ch._removed.value:
            continue
        if ch._client is client:
            if ch.role == role:
                raise ValueError(f"gpushm: this client already holds the {_WHO[role]} end of channel {name!r}; close it first")
            # The daemon keeps one role per connection and channel.
            raise ValueError(f"gpushm: this client holds the {_WHO[ch.role]} end of channel {name!r}; "
                             f"open the {_WHO[role]} end with another gpushm.connect()")
        if ch.role == role:
            raise ValueError(f"gpushm: this process already holds the {_WHO[role]} end of channel {name!r} "
                             f"(through another client); a channel has one of each")


def _describe(slots, slot_bytes, meta):
    if isinstance(meta, dict) and "dtype" in meta and "shape" in meta:
        what = f"{meta['dtype']}{list(meta['shape'])}"
    else:
        what = f"messages of {slot_bytes} bytes"
    return f"{slots} slots of {what}"


class Channels:
    """Client's channel method (gpushm._client composes it into Client).
    A channel's end holds its role through the client core's hook
    (Core._hold): the core reclaims it after a reconnection and closes it
    with the client."""

    def channel(self, name: str, shape=None, dtype=None, *, nbytes: int | None = None, slots: int | None = None,
                role: str | None = None, device: int | None = None, devices=None, mode: int = 0o600,
                wait_for_consumer: bool = True, framework: str | None = "auto", spin_us: float = 50):
        """One end of the channel name, a stream of same-shaped tensors
        between two processes (docs/python.md, "Channels").

        With shape and dtype (or nbytes, for raw bytes) the channel is made
        if it does not exist, or opened if it exists with that layout, and
        this end is the producer (role "tx"); without them an existing
        channel is opened, as its consumer (role "rx"). role= says which
        end explicitly. slots is the number of messages in flight (default
        4 when making the channel; whatever it has when it exists), device
        the GPU it lives on, devices the GPUs this process touches it from
        (a consumer on another GPU: devices=[1]).

        wait_for_consumer: send() with no consumer attached waits for one
        (True), or raises NoConsumerError (False). framework is what the
        messages are: "torch", "cupy", "numpy", None (gpushm Views), or
        "auto": torch tensors on a GPU when torch imports (else CuPy, else
        Views), numpy arrays in host memory. spin_us is how long a wait
        polls the channel before it sleeps."""
        return open_channel(self, name, shape=shape, dtype=dtype, nbytes=nbytes, slots=slots, role=role,
                            device=device, devices=devices, mode=mode, wait_for_consumer=wait_for_consumer,
                            framework=framework, spin_us=spin_us)


def open_channel(client, name, *, shape, dtype, nbytes, slots, role, device, devices, mode, wait_for_consumer,
                 framework, spin_us) -> Channel:
    if client._closed:
        raise ValueError("gpushm: channel on a closed client")
    making = shape is not None or dtype is not None or nbytes is not None
    if role is None:
        role = TX if making else RX
    if role not in _ROLES:
        raise ValueError(f"gpushm: channel role {role!r}: want \"tx\" (producer) or \"rx\" (consumer)")
    role = _ROLES[role]
    meta, slot_bytes = None, None
    if making:
        if shape is not None or dtype is not None:
            lay = layout_of(shape, dtype, nbytes, "a channel")
            if nbytes is not None and nbytes != lay.nbytes:
                raise ValueError(f"gpushm: nbytes {nbytes} is not the {lay.nbytes} bytes of {lay.dtype.name}{list(lay.shape)}")
            slot_bytes = lay.nbytes
            meta = {"kind": "channel", "dtype": lay.dtype.name, "shape": list(lay.shape)}
        else:
            slot_bytes = nbytes
        if isinstance(slot_bytes, bool) or not isinstance(slot_bytes, int) or slot_bytes <= 0:
            raise ValueError(f"gpushm: channel {name!r}: messages of {slot_bytes!r} bytes; want at least 1")
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS):
            raise ValueError(f"gpushm: channel {name!r}: {slots!r} slots; want 1 to {MAX_SLOTS}")
    elif slots is not None or device is not None:
        raise TypeError("gpushm: slots= and device= make a channel: give its shape and dtype (or nbytes) too")
    if not isinstance(wait_for_consumer, bool):
        raise TypeError(f"gpushm: wait_for_consumer={wait_for_consumer!r}: want True or False")
    if spin_us < 0:
        raise ValueError(f"gpushm: spin_us={spin_us!r}: want 0 or more")
    _check_ends(client, name, role)
    devs = tuple(int(d) for d in devices) if devices else None
    readonly = role == RX

    if making:
        # The layout is compared before a role is taken, so that a mismatch
        # changes nothing (the daemon compares slots and sizes, not meta).
        try:
            old = client._call("stat", name=name)[0]["segment"]
        except NotFoundError:
            old = {}
        lay = old.get("channel")
        if lay:
            o_slots, o_bytes, o_meta = lay["slots"], lay["slot_bytes"], old.get("meta")
            if slots is None:
                slots = o_slots
            if device is None:
                device = old.get("device")  # where it is, not the daemon's default
            if (o_slots, o_bytes, o_meta) != (slots, slot_bytes, meta):
                raise error("EEXIST", f"channel {name!r} exists with {_describe(o_slots, o_bytes, o_meta)}, "
                                      f"not {_describe(slots, slot_bytes, meta)}")
        fields = {"name": name, "mode": int(mode), "open": True, "exist_ok": True, "slots": slots or 4,
                  "slot_bytes": int(slot_bytes), "role": role}
        if meta is not None:
            fields["meta"] = meta
        if device is not None:
            fields["device"] = int(device)
        if readonly:
            fields["readonly"] = True
        op = "create"
    else:
        fields = {"name": name, "role": role}
        if readonly:
            fields["readonly"] = True
        op = "open"
    rep, fd = client._call(op, _keep_control=True, **fields)
    cfd = rep.get("control_fd", -1)
    seg = rep.get("segment") or {}
    try:
        if cfd < 0 or not seg.get("channel"):
            raise error("EPROTO", f"{op} of channel {name!r}: the reply carried no control block")
        if making and not rep.get("created") and seg.get("meta") != meta:
            c = seg["channel"]
            raise error("EEXIST", f"channel {name!r} exists with {_describe(c['slots'], c['slot_bytes'], seg.get('meta'))}, "
                                  f"not {_describe(slots or 4, slot_bytes, meta)}")
        # The channel owns the descriptors from here, whatever happens.
        fds, fd, cfd = (fd, cfd), -1, -1
        ch = Channel(client, name, role, seg, *fds, readonly, devs, framework, wait_for_consumer, spin_us)
    except BaseException:
        for f in (fd, cfd):
            if f >= 0:
                os.close(f)
        try:
            client._call("close", segment=seg.get("id", 0))
        except Exception:
            pass
        raise
    return ch


# ---- a channel end --------------------------------------------------------

class Message:
    """One slot handed out by send() (to fill) or recv() (to read). Use it as
    a context manager, which gives the tensor, or call done(). .seq is the
    message's number in the stream (0 for the first)."""

    __slots__ = ("_ch", "seq", "slot", "tensor", "_stream")

    def __init__(self, ch, seq, slot, tensor, stream):
        self._ch, self.seq, self.slot, self.tensor, self._stream = ch, seq, slot, tensor, stream

    def __repr__(self):
        state = "out" if self._ch is not None else "done"
        return f"<gpushm.Message {self.seq} (slot {self.slot}) {state}>"

    def __enter__(self):
        return self.tensor

    def __exit__(self, exc_type, exc, tb):
        ch = self._ch
        if ch is not None:
            if exc_type is not None and ch.role == TX:
                ch._abandon(self)  # a failed fill sends nothing
            else:
                ch._done(self, self._stream)
        return False

    def done(self, stream=None):
        """Hands the message over: the producer's is sent (on a GPU, its
        stream marks the slot filled once the work queued before is done),
        the consumer's released (its stream marks the slot drained). stream
        defaults to the one send() or recv() used; another must be ordered
        after the work on the message. The consumer's raises
        BrokenMessageError (after the release) if its producer died before
        it finished this message or one before it (see Channel.recv); so
        does leaving the with block."""
        ch = self._ch
        if ch is None:
            raise ValueError(f"gpushm: message {self.seq} was handed over already")
        ch._done(self, self._stream if stream is None else stream_handle(stream))


class _End:
    """What ending a channel end needs: close() and the finalizer of a
    channel dropped without close() share it."""

    __slots__ = ("client", "seg", "role", "dev", "ctl", "slots", "registered", "leased", "last", "pending_wait",
                 "wait_stream")

    def __init__(self, client, seg, role, dev, ctl, slots, registered):
        self.client, self.seg, self.role, self.dev, self.ctl = client, seg, role, dev, ctl
        self.slots, self.registered = slots, registered
        self.leased = False  # this end's lease (and role) is the daemon's to end
        self.last = 0  # this end's last message handed over, + 1
        # A stream wait on the block was queued that no flag write of this
        # end follows yet, on wait_stream (_MIXED: on several).
        self.pending_wait = False
        self.wait_stream = None

    def waited(self, s):
        """Stream waits on the block were queued on s."""
        self.pending_wait = True
        self.wait_stream = s if self.wait_stream in (None, s) else _MIXED

    def wrote(self, s):
        """A flag write was queued on s: once it lands, every wait queued on
        s before it is over."""
        if self.wait_stream == s:
            self.pending_wait, self.wait_stream = False, None


def _landed(st) -> bool:
    """Waits, at most _CLOSE_WAIT, until this end's last flag write, queued
    on a stream, has landed in the block: the consumer needs the producer's,
    and the block must not be unpinned while a stream still writes it."""
    if st.dev is None or st.last == 0:
        return True
    off = (_OFF_FILLED if st.role == TX else _OFF_DRAINED) + 8 * ((st.last - 1) % st.slots)
    w, deadline = _u64(st.ctl + off), time.monotonic() + _CLOSE_WAIT
    while w.value < st.last and time.monotonic() < deadline:
        time.sleep(0.0001)
    return w.value >= st.last


def _dropped(st):
    """A channel went without close(): end it as close() would, without
    raising, and without waiting for the client's lock (the close is queued
    as a mapping's is)."""
    try:
        landed = _landed(st)
        if st.leased:
            st.leased = False
            st.client._release(st.seg, 1)
        if landed:
            _release_block(st.dev, st.ctl, st.registered)
    except Exception:
        pass


class Channel:
    """One end of a channel: the producer's (send) or the consumer's (recv,
    iteration). Made by Client.channel. One message is out at a time; a
    thread may close() the channel while another waits in it."""

    def __init__(self, client, name, role, seg, fd, cfd, readonly, devs, framework, wait_for_consumer, spin_us):
        self._client, self.name, self.role = client, name, role
        self._closed, self._lost, self._out = False, None, None
        self._lock = threading.Lock()
        self._wait_for_consumer = wait_for_consumer
        self._spin_ns = int(spin_us * 1000)
        self.info = SegmentInfo.from_wire(seg)
        lay = seg["channel"]
        self.slots, self.slot_bytes, self._stride = int(lay["slots"]), int(lay["slot_bytes"]), int(lay["slot_stride"])
        try:
            m = _mapping.Mapping(client, self.info, fd, readonly, devs)  # closes fd
        except BaseException:
            os.close(cfd)
            raise
        # The channel ends its lease itself: dropping the mapping (which
        # tensors may outlive the channel) must not end the role.
        m.lease.client = None
        try:
            ctl = _mapping.mmap(cfd, BLOCK_BYTES, True)
        finally:
            os.close(cfd)
        registered = False
        try:
            self._check_block(ctl)
            if m.dev is not None:
                self._ctl_dev = m.dev.register_host(ctl, BLOCK_BYTES)
                registered = True
                self._write_value, self._wait_value, self._batch, self._ops = m.dev.stream_ops()
        except BaseException:
            _release_block(m.dev, ctl, registered)
            raise
        self._st = st = _End(client, self.info.id, role, m.dev, ctl, self.slots, registered)
        self._fin = weakref.finalize(self, _dropped, st)
        self._fin.atexit = False  # exit ends the role anyway (the daemon repairs), and the GPU may still run
        self._m, self._dev, self._ctl = m, m.dev, ctl

        self._head, self._taken, self._tail = _u64(ctl + _OFF_HEAD), _u64(ctl + _OFF_TAKEN), _u64(ctl + _OFF_TAIL)
        self._tx_state, self._rx_state = _u32(ctl + _OFF_TX), _u32(ctl + _OFF_RX)
        self._broken, self._removed = _u64(ctl + _OFF_BROKEN), _u64(ctl + _OFF_REMOVED)
        self._broken_end, self._breaks = _u64(ctl + _OFF_BROKEN_END), _u64(ctl + _OFF_BREAKS)
        self._rx_ev, self._tx_ev = _u32(ctl + _OFF_RX_EVENT), _u32(ctl + _OFF_TX_EVENT)
        self._rx_ev_addr, self._tx_ev_addr = ctl + _OFF_RX_EVENT, ctl + _OFF_TX_EVENT
        self._rx_sleep, self._tx_sleep = _u32(ctl + _OFF_RX_SLEEP), _u32(ctl + _OFF_TX_SLEEP)
        # What a predecessor of this role left there would only cost wakes.
        (self._tx_sleep if role == TX else self._rx_sleep).value = 0
        self._filled, self._drained = _u64s(ctl + _OFF_FILLED, self.slots), _u64s(ctl + _OFF_DRAINED, self.slots)
        # The hand-off's per-slot arguments, made once: the flags' addresses
        # on the GPU.
        self._host = m.dev is None
        if m.dev is not None:
            self._filled_dev = tuple(self._ctl_dev + _OFF_FILLED + 8 * i for i in range(self.slots))
            self._drained_dev = tuple(self._ctl_dev + _OFF_DRAINED + 8 * i for i in range(self.slots))
        # Stream waits queued ahead (_cover): on stream _cover_s, every
        # message below _cover_end is waited for (or had landed); _last_s is
        # the stream of this end's last send or recv.
        self._cover_s, self._cover_end, self._last_s = None, 0, None
        # The consumer's releases not yet given back (_release): their
        # drained writes are the first _npend operations of _ops, on stream
        # _pend_s; _pend_k is the last one's message + 1. A group is given
        # back when it holds _group of them, before recv waits, and at close.
        self._group = max(1, self.slots // _GROUP) if m.dev is not None and role == RX else 1
        self._npend, self._pend_s, self._pend_k = 0, None, 0

        meta = self.info.meta
        if isinstance(meta, dict) and meta.get("kind") == "channel" and "dtype" in meta and "shape" in meta:
            dt, shape = dtype_of(meta["dtype"]), tuple(meta["shape"])
        else:
            dt, shape = dtype_of("uint8"), (self.slot_bytes,)
        if Layout(dt, shape).nbytes > self.slot_bytes:
            raise ValueError(f"gpushm: channel {name!r}: its meta says {dt.name}{list(shape)}, more than its {self.slot_bytes}-byte slots")
        self.dtype, self.shape = dt.name, shape
        self.framework = _pick_framework(framework, m.dev is not None)
        wrap = _wrapper(self.framework)
        self.views = tuple(View(m, Layout(dt, shape, None, i * self._stride)) for i in range(self.slots))
        self._tensors = [wrap(v) for v in self.views]
        self._stream = _current_stream(self.framework, m.dev.ordinal) if m.dev is not None else None
        # The consumer's: the last break it was told of. One whose messages
        # it has still to meet is news to it.
        self._seen = 0
        # The consumer's: the break whose messages it has gone past (-1:
        # none). While the block's break count says this one, recv takes a
        # message ready without looking at the record.
        self._clear = -1
        if role == TX:
            st.last = self._head.value
        else:
            first, end, count = self._break()
            self._seen = count - 1 if count and self._taken.value < end else count
            if self._seen == count:
                self._clear = count
        st.leased = True  # from here on, dropping the channel ends the role
        client._hold(self)  # reclaimed after a reconnection, closed with the client
        _ENDS.add(self)

    def _check_block(self, ctl):
        raw = ctypes.string_at(ctl, 32)
        slots = int.from_bytes(raw[_OFF_SLOTS:_OFF_SLOTS + 4], "little")
        slot_bytes = int.from_bytes(raw[_OFF_SLOT_BYTES:_OFF_SLOT_BYTES + 8], "little")
        stride = int.from_bytes(raw[_OFF_STRIDE:_OFF_STRIDE + 8], "little")
        version = int.from_bytes(raw[_OFF_VERSION:_OFF_VERSION + 4], "little")
        if raw[:8] != _MAGIC:
            raise error("EPROTO", f"channel {self.name!r}: not a gpushm channel control block (bad magic)")
        if version != _VERSION:
            raise error("EPROTO", f"channel {self.name!r}: its control block is version {version}, this client's is "
                                  f"{_VERSION}: the daemon or the channel's other end runs another gpushm version (a "
                                  f"channel made before an upgrade takes the new version once neither end holds it)")
        if (slots, slot_bytes, stride) != (self.slots, self.slot_bytes, self._stride) or \
                self._stride * self.slots > self.info.alloc_size:
            raise error("EPROTO", f"channel {self.name!r}: the control block says {slots} slots of {slot_bytes} bytes "
                                  f"every {stride}, the daemon {self.slots} of {self.slot_bytes} every {self._stride}")

    # ---- description ----------------------------------------------------

    @property
    def device(self):
        """The GPU the tensors are on (this process's view), or None for
        host memory."""
        return None if self._dev is None else self._dev.ordinal

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self):
        where = "host" if self._dev is None else f"cuda:{self._dev.ordinal}"
        state = " closed" if self._closed else ""
        return f"<gpushm.Channel {self.name!r} {_WHO[self.role]}{state} {self.slots} slots of {self.dtype}{list(self.shape)} on {where}>"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- the producer -----------------------------------------------------

    def send(self, stream=None, timeout: float | None = None) -> Message:
        """Waits for a free slot (and for a consumer) and hands it out as the
        next message: fill it, then hand it over by leaving the with block
        (or done()). On a GPU, stream (default: the framework's current
        stream) first waits, on the GPU, until the consumer's reads of the
        slot's last message are done; queue the work that fills the slot on
        it. Leaving the block with an exception sends nothing. timeout, in
        seconds, bounds the wait (None: forever; 0: not at all) and raises
        TimeoutError."""
        if self.role != TX:
            raise ValueError(f"gpushm: channel {self.name!r}: send on the consumer's end")
        with self._lock:
            if self._out is not None or self._closed or self._lost:
                self._usable()
            # A slot free and a consumer there is the common case: the
            # words read once, and the wait's loop only when not.
            slots = self.slots
            k = self._head.value
            if self._removed.value or self._rx_state.value != _ATTACHED or k - self._tail.value >= slots:
                k = self._wait_slot(timeout)
            slot = k % slots
            if self._host:
                s = None
            else:
                s = self._stream() if stream is None else stream_handle(stream)
                # (_reached, inline: this is every message's path)
                if k >= slots and (s != self._cover_s or k >= self._cover_end) \
                        and (self._drained[slot] + slots - 1 - k) & _U64 >= _HALF:
                    self._cover(s, k, self._tail.value + slots, self._drained, self._drained_dev, -slots)
                self._last_s = s
            msg = self._out = Message(self, k, slot, self._tensors[slot], s)
        return msg

    def _cover(self, s, k, limit, flags, addrs, back):
        """Orders stream s after the other end's GPU work on message k's
        slot, whose flag (flags, on the GPU addrs) has not landed: a stream
        wait for it to reach k + back + 1. Where s is the stream of this
        end's last message too, the same driver call also queues the waits
        of the messages after k, below limit and at most _AHEAD in all,
        whose flags have not landed either (the other end has handed them
        over: their writes are queued), so that their sends or receives on
        s queue none. A flag read here that has landed needs no wait: where
        the producer runs ahead (32 slots), most have (docs/benchmarks.md,
        "Channels from Python"). The consumer's releases waiting on the
        same stream go first, in the same call (their tail is stored after
        it)."""
        slots, ops = self.slots, self._ops
        n = 0
        if self._npend:
            if s == self._pend_s:
                n = self._npend
            else:
                self._give_back()
        end = min(limit, k + _AHEAD) if s == self._last_s else k + 1
        MEM = _cuda.MEM_OP_WORDS
        i = n * MEM
        for j in range(k, end):
            sl = j % slots
            if j == k or not _reached(flags[sl], j + back + 1):
                ops[i], ops[i + 1], ops[i + 2] = _OP_WAIT, addrs[sl], j + back + 1
                i += MEM
        self._st.waited(s)
        if i == MEM:
            self._wait_value(s, addrs[k % slots], k + back + 1)
        else:
            self._batch(s, i // MEM)
        self._cover_s, self._cover_end = s, end
        if n:
            self._gave_back(False)  # the waits came after the writes

    def _wait_slot(self, timeout):
        head_w, tail_w, rx_state, removed, ev = self._head, self._tail, self._rx_state, self._removed, self._tx_ev
        slots, spin_until, deadline, asleep = self.slots, None, None, False
        try:
            while True:
                seen = ev.value
                if removed.value:
                    raise _err(ChannelRemovedError, f"channel {self.name!r} was removed")
                head = head_w.value
                if rx_state.value != _ATTACHED:
                    if not self._wait_for_consumer:
                        raise _err(NoConsumerError, f"channel {self.name!r}: no consumer is attached "
                                                    f"(opened with wait_for_consumer=False)")
                    why = "no consumer is attached"
                elif head - tail_w.value < slots:
                    return head
                else:
                    why = "every slot holds a message the consumer has not released"
                if self._closed:
                    raise ValueError(f"gpushm: channel {self.name!r} was closed while send waited ({why})")
                now = time.perf_counter_ns()
                if spin_until is None:
                    spin_until = now + self._spin_ns
                    if timeout is not None:
                        deadline = now + int(timeout * 1e9)
                if deadline is not None and now >= deadline:
                    raise TimeoutError(f"gpushm: channel {self.name!r}: {why} (waited {timeout:g}s)")
                if now < spin_until:
                    continue
                if not asleep:
                    asleep = self._sleeping(self._tx_sleep)
                    continue  # the event word and the words again, after the store
                _futex_wait(self._tx_ev_addr, seen, _TICK if deadline is None else min(_TICK, deadline - now))
        finally:
            if asleep:
                self._tx_sleep.value = 0

    @staticmethod
    def _sleeping(word):
        """Says, in this end's sleeping word, that it may be asleep from
        now on: the other end's hand-offs wake it (see the module's
        docstring)."""
        word.value = 1
        _fence()
        return True

    # ---- the consumer -----------------------------------------------------

    def recv(self, timeout: float | None = None, stream=None) -> Message:
        """Waits for the next message and hands it out: read it, then give
        the slot back by leaving the with block (or done()). On a GPU,
        stream (default: the framework's current stream) waits, on the GPU,
        until the producer's writes of it are done; queue the work that
        reads it on it. Raises EOFError once the producer is gone (closed,
        or died) and every message it sent was received; ChannelRemovedError
        on a removed channel; TimeoutError after timeout seconds (None:
        wait forever; 0: not at all).

        A producer that dies before its writes of a message are done cuts
        that message off, and every one it sent after it: BrokenMessageError
        names the first (.seq), once, raised by recv when it would hand it
        out or when it handed it out before the producer died (on a GPU,
        recv returns before the producer's GPU wrote the message), or by
        the release of a message cut off. Results of work queued on
        messages from that one on are not to be used. Then recv skips the
        messages cut off and goes on with a next producer's, or EOFError."""
        if self.role != RX:
            raise ValueError(f"gpushm: channel {self.name!r}: recv on the producer's end")
        with self._lock:
            if self._out is not None or self._closed or self._lost:
                self._usable()
            slots, host = self.slots, self._host
            while True:
                # A message ready, and no break this end has not gone past
                # (the count read last, as in _wait_message): taken at once.
                k = self._taken.value
                if self._head.value > k and (not host or _reached(self._filled[k % slots], k + 1)) \
                        and self._breaks.value == self._clear:
                    skip = False
                else:
                    if self._npend:
                        self._give_back()  # before this end waits: the producer may wait for them
                    k, skip = self._wait_message(timeout)
                self._taken.value = k + 1
                slot = k % slots
                s = None
                if not host:
                    s = self._stream() if stream is None else stream_handle(stream)
                if skip:
                    self._release(k, slot, s)  # unread, in the order of the slot's other releases
                    continue
                if s is not None:
                    if (s != self._cover_s or k >= self._cover_end) and not _reached(self._filled[slot], k + 1):
                        self._cover(s, k, self._head.value, self._filled, self._filled_dev, 0)
                    self._last_s = s
                msg = self._out = Message(self, k, slot, self._tensors[slot], s)
                return msg

    def _break(self):
        """(first, end, count) of the last break: messages first to end - 1
        were cut off by a dead producer; count numbers the breaks (0:
        none). count is read first: the daemon writes it last."""
        count = self._breaks.value
        b = self._broken.value
        if not count or not b:
            return 0, 0, 0
        return b - 1, self._broken_end.value, count

    def _untold(self, m):
        """Raises BrokenMessageError for the break this consumer was not
        told of, if it cut off message m or one before it."""
        first, end, count = self._break()
        if count and count != self._seen and first <= m:
            self._seen = count
            e = _err(BrokenMessageError, f"channel {self.name!r}: the producer died before it finished message "
                                         f"{first}; results of work on messages from {first} on are not to be used")
            e.seq = first
            raise e
        return first, end, count

    def _wait_message(self, timeout):
        """(k, skip): message k = taken is ready; with skip, it is one cut
        off by a break this consumer was told of."""
        head_w, taken_w, tx_state, removed, ev = self._head, self._taken, self._tx_state, self._removed, self._rx_ev
        host, slots, filled = self._host, self.slots, self._filled
        spin_until, deadline, asleep = None, None, False
        try:
            while True:
                seen = ev.value
                # The producer's end is read before the head: its last
                # message is published before its end is recorded, so a head
                # read after seeing it gone is final (the other order could
                # turn a message sent in between into a spurious EOFError).
                gone = tx_state.value == _GONE
                taken = taken_w.value
                head = head_w.value
                # On host memory the CPU waits for the flag a stream would
                # wait for; it is read before the break (the daemon records a
                # break before it marks the flags).
                ready = head > taken and (not host or _reached(filled[taken % slots], taken + 1))
                first, end, count = self._untold(taken)
                if count == self._seen and taken >= end:
                    self._clear = count  # behind this end: recv need not look again until the next
                if head > taken and count and first <= taken < end:
                    return taken, True
                if ready:
                    return taken, False
                if head <= taken:
                    if removed.value:
                        raise _err(ChannelRemovedError, f"channel {self.name!r} was removed")
                    if gone:
                        raise EOFError(f"gpushm: channel {self.name!r}: the producer is gone and every message it "
                                       f"sent was received")
                if self._closed:
                    raise ValueError(f"gpushm: channel {self.name!r} was closed while recv waited")
                now = time.perf_counter_ns()
                if spin_until is None:
                    spin_until = now + self._spin_ns
                    if timeout is not None:
                        deadline = now + int(timeout * 1e9)
                if deadline is not None and now >= deadline:
                    raise TimeoutError(f"gpushm: channel {self.name!r}: no message within {timeout:g}s")
                if now < spin_until:
                    continue
                if not asleep:
                    asleep = self._sleeping(self._rx_sleep)
                    continue  # the event word and the words again, after the store
                _futex_wait(self._rx_ev_addr, seen, _TICK if deadline is None else min(_TICK, deadline - now))
        finally:
            if asleep:
                self._rx_sleep.value = 0

    def __iter__(self):
        """The messages, until the producer is gone: each tensor is valid
        until the next iteration starts (or the loop ends), when its slot
        goes back to the producer."""
        while True:
            try:
                msg = self.recv()
            except EOFError:
                return
            with msg as t:
                yield t

    # ---- hand-over --------------------------------------------------------

    def _done(self, msg, s):
        with self._lock:
            if self._out is not msg:
                raise ValueError(f"gpushm: channel {self.name!r}: message {msg.seq} is not out")
            msg._ch = self._out = None
            if self.role == RX:
                k = msg.seq
                self._release(k, msg.slot, s)
                if self._breaks.value != self._seen:
                    self._untold(k)
                return
            # The producer's, every message's path: what _notify does,
            # inline.
            k1, st = msg.seq + 1, self._st
            if self._host:
                # Not a stream's write: on host memory the CPU's stores are
                # done here, and the daemon's repair of a dead producer reads
                # filled to tell finished messages from cut ones.
                self._filled[msg.slot] = k1
            else:
                self._write_value(s, self._filled_dev[msg.slot], k1)
                if st.pending_wait:
                    st.wrote(s)
            self._head.value = k1
            st.last = k1
            ev = self._rx_ev
            ev.value = (ev.value + 1) & 0xFFFFFFFF
            _fence()
            if _WAKE_ALWAYS or self._rx_sleep.value:
                _futex_wake(self._rx_ev_addr)

    def _release(self, k, slot, s):
        """Gives message k's slot back to the producer (the consumer; the
        lock is held). On a GPU of 16 slots or more, in groups: the drained
        write of each message, on its stream, waits in _ops until the group
        has slots // 8 of them (or one on another stream comes, or recv is
        about to wait, or close), then they are queued with one driver call
        and tail is stored once for them all. A producer waits only for
        flags below tail, which are always queued: a group not given back
        yet holds its slots a little longer, as if the consumer were
        slower, and one driver call stands for several (docs/protocol.md,
        "Channels")."""
        if self._host:
            self._drained[slot] = k + 1
        elif self._group > 1:
            if self._npend and s != self._pend_s:
                self._give_back()
            ops, i = self._ops, self._npend * _cuda.MEM_OP_WORDS
            ops[i], ops[i + 1], ops[i + 2] = _OP_WRITE, self._drained_dev[slot], k + 1
            self._npend += 1
            self._pend_s, self._pend_k = s, k + 1
            if self._npend >= self._group:
                self._give_back()
            return
        else:
            self._write_value(s, self._drained_dev[slot], k + 1)
            self._st.wrote(s)
        self._tail.value = k + 1
        self._st.last = k + 1
        _notify(self._tx_ev, self._tx_sleep, self._tx_ev_addr)

    def _give_back(self):
        """Queues the group of releases in _ops (one driver call) and gives
        their slots back."""
        n, s = self._npend, self._pend_s
        if n == 1:
            self._write_value(s, self._ops[1], self._ops[2])
        else:
            self._batch(s, n)
        self._gave_back()

    def _gave_back(self, last=True):
        """The group's writes are queued (last: after every wait of this
        end's on their stream): tail moves past them."""
        self._npend = 0
        if last:
            self._st.wrote(self._pend_s)
        self._tail.value = self._pend_k
        self._st.last = self._pend_k
        _notify(self._tx_ev, self._tx_sleep, self._tx_ev_addr)

    def _abandon(self, msg):
        with self._lock:
            if self._out is msg:
                msg._ch = self._out = None

    def _usable(self):
        if self._closed:
            raise ValueError(f"gpushm: channel {self.name!r} is closed")
        if self._out is not None:
            raise RuntimeError(f"gpushm: channel {self.name!r}: message {self._out.seq} is still out; "
                               f"leave its with block (or call done()) first")
        if self._lost:
            raise ConnectionError(f"gpushm: channel {self.name!r}: {self._lost}")

    # ---- ending ---------------------------------------------------------------

    def close(self):
        """Ends this end. A producer first waits (up to 10 s) until its last
        message's writes are done on the GPU, so that the consumer gets every
        message it sent, then EOFError. A message still out is dropped (the
        producer's is not sent). Tensors handed out stay mapped while they
        live, but must not be used after their message was handed over. A
        channel dropped without close() is closed when it is collected."""
        if self._closed:
            return
        self._closed = True
        # A thread waiting in send or recv sees _closed once woken, and
        # lets go of the lock.
        _futex_wake(self._rx_ev_addr)
        _futex_wake(self._tx_ev_addr)
        with self._lock:
            out, self._out = self._out, None
            if out is not None:
                out._ch = None
            if self._npend:
                try:
                    self._give_back()  # its last releases; the daemon would give them back anyway
                except Exception:
                    self._npend = 0
            st, client = self._st, self._client
            self._fin.detach()
            landed = _landed(st)
            err = None
            if st.leased and client._pid == os.getpid() and not client._closed:
                # A reconnection on the way reclaims the role (this channel
                # is still held by the client), so that this close ends it.
                try:
                    client._call("close", segment=st.seg, role=self.role)
                except InvalidError:
                    pass  # the lease went with a connection the daemon lost
                except Exception as e:
                    err = e
            st.leased = False
            client._unhold(self)
            self._tensors = ()
            self.views = ()
            self._m = None
            if landed:
                # Stream work on the block is over, unless a wait was queued
                # with no write of this end after it.
                _release_block(st.dev, st.ctl, st.registered, st.pending_wait)
            else:
                # A stream may still write the block: leave it pinned and mapped.
                warnings.warn(f"gpushm: channel {self.name!r}: the GPU did not finish this end's last message "
                              f"within {_CLOSE_WAIT:g}s; its control block stays mapped", RuntimeWarning)
        if err is not None:
            raise err

    def _reclaim(self, exchange):
        """Takes the role back on a new connection (the client's lock is
        held): the client core calls it for what it holds (Core._hold)."""
        st = self._st
        if not st.leased:
            return
        fields = {"segment": st.seg, "count": 1, "role": self.role}
        if self.role == RX:
            fields["readonly"] = True
        rep, fd = exchange("reclaim", fields, -1)
        if fd >= 0:
            os.close(fd)
        err = rep.get("error")
        if err:
            st.leased = False
            self._lost = f"its role could not be taken back after the daemon restarted: {err.get('message') or err.get('code')}"
