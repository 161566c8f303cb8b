// Package channel is the control block of a tensor channel (docs/protocol.md,
// "Channels"): the counters and flags a producer and a consumer share to hand
// messages over, and the repairs the daemon makes when one of them dies.
//
// The block is shared memory written by several processes (and by GPU
// streams); every access is atomic, and the hand-off is the release store of
// a counter followed by a futex wake. This package, internal/epoch and
// internal/cuda are the ones that use unsafe: atomics on shared memory need
// pointers into it.
package channel

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Sizes and limits.
const (
	BlockBytes = 4096 // the control block
	MaxSlots   = 64
	// Align is the slot stride's unit: a page, so that a slot of host
	// memory can be mapped alone, and far above what any GPU access needs.
	Align = 4096
)

// Offsets in the block.
const (
	offMagic     = 0
	offVersion   = 8
	offSlots     = 12
	offSlotBytes = 16
	offStride    = 24
	offHead      = 64
	offTaken     = 128
	offTail      = 192
	offTx        = 256 // u32 state, u32 pid, u64 start
	offRx        = 272
	offBroken    = 320
	offRemoved   = 328
	offRxEvent   = 384
	offTxEvent   = 448
	offFilled    = 1024
	offDrained   = 1536
)

const magic = "GPUSHMC1"

// Role states.
const (
	StateNone     = 0
	StateAttached = 1
	StateGone     = 2
)

// Role is a channel end.
type Role string

// The two roles.
const (
	Tx Role = "tx"
	Rx Role = "rx"
)

// Stride is the distance between slots for messages of n bytes.
func Stride(n int64) int64 { return (n + Align - 1) / Align * Align }

// Block is a mapped control block.
type Block struct {
	b []byte
}

// Map makes a Block of mapped memory of at least BlockBytes.
func Map(b []byte) (*Block, error) {
	if len(b) < BlockBytes {
		return nil, fmt.Errorf("control block of %d bytes, want %d", len(b), BlockBytes)
	}
	return &Block{b: b[:BlockBytes]}, nil
}

// Init writes a fresh block's header.
func (k *Block) Init(slots int, slotBytes, stride int64) {
	copy(k.b[offMagic:], magic)
	binary.LittleEndian.PutUint32(k.b[offVersion:], 1)
	binary.LittleEndian.PutUint32(k.b[offSlots:], uint32(slots))
	binary.LittleEndian.PutUint64(k.b[offSlotBytes:], uint64(slotBytes))
	binary.LittleEndian.PutUint64(k.b[offStride:], uint64(stride))
}

// Check verifies that the block is a channel's with this layout.
func (k *Block) Check() (slots int, slotBytes, stride int64, err error) {
	if string(k.b[offMagic:offMagic+8]) != magic || binary.LittleEndian.Uint32(k.b[offVersion:]) != 1 {
		return 0, 0, 0, errors.New("not a gpushm channel control block (bad magic or version)")
	}
	slots = int(binary.LittleEndian.Uint32(k.b[offSlots:]))
	slotBytes = int64(binary.LittleEndian.Uint64(k.b[offSlotBytes:]))
	stride = int64(binary.LittleEndian.Uint64(k.b[offStride:]))
	if slots < 1 || slots > MaxSlots || slotBytes <= 0 || stride < slotBytes || stride%Align != 0 {
		return 0, 0, 0, fmt.Errorf("control block says %d slots of %d bytes every %d: not a valid layout", slots, slotBytes, stride)
	}
	return slots, slotBytes, stride, nil
}

func (k *Block) u64(off int) *atomic.Uint64 {
	return (*atomic.Uint64)(unsafe.Pointer(&k.b[off]))
}

func (k *Block) u32(off int) *atomic.Uint32 {
	return (*atomic.Uint32)(unsafe.Pointer(&k.b[off]))
}

// Slots is the number of slots.
func (k *Block) Slots() int { return int(binary.LittleEndian.Uint32(k.b[offSlots:])) }

// Counters.
func (k *Block) Head() uint64   { return k.u64(offHead).Load() }
func (k *Block) Taken() uint64  { return k.u64(offTaken).Load() }
func (k *Block) Tail() uint64   { return k.u64(offTail).Load() }
func (k *Block) Broken() uint64 { return k.u64(offBroken).Load() }

// Filled and Drained are the GPU flags of slot i.
func (k *Block) Filled(i int) uint64  { return k.u64(offFilled + 8*i).Load() }
func (k *Block) Drained(i int) uint64 { return k.u64(offDrained + 8*i).Load() }

// MarkFilled and MarkDrained set slot i's flags from the CPU: the
// hand-off of host-memory channels, where no stream writes them.
func (k *Block) MarkFilled(i int, v uint64)  { k.u64(offFilled + 8*i).Store(v) }
func (k *Block) MarkDrained(i int, v uint64) { k.u64(offDrained + 8*i).Store(v) }

// FilledOffset and DrainedOffset are where slot i's flags lie in the block,
// for a stream operation on the block's device address.
func FilledOffset(i int) int64  { return int64(offFilled + 8*i) }
func DrainedOffset(i int) int64 { return int64(offDrained + 8*i) }

// Holder describes who holds a role.
type Holder struct {
	State uint32
	PID   int
	Start uint64
}

func (k *Block) roleOff(r Role) int {
	if r == Tx {
		return offTx
	}
	return offRx
}

// Holder reads a role's holder.
func (k *Block) Holder(r Role) Holder {
	off := k.roleOff(r)
	return Holder{State: k.u32(off).Load(), PID: int(k.u32(off + 4).Load()), Start: k.u64(off + 8).Load()}
}

// Attach records that pid (started at start) holds r now, and wakes the
// other end. The caller (the daemon) decided that it may.
func (k *Block) Attach(r Role, pid int, start uint64) {
	off := k.roleOff(r)
	k.u32(off + 4).Store(uint32(pid))
	k.u64(off + 8).Store(start)
	if b := k.u64(offBroken).Load(); r == Tx && b != 0 {
		// The messages its dead predecessor cut off are withdrawn, so the
		// consumer never takes one as valid: the new producer writes over
		// them.
		k.u64(offHead).Store(b - 1)
		k.u64(offBroken).Store(0)
	}
	k.u32(off).Store(StateAttached)
	k.wakeOther(r)
}

// wakeOther bumps the event word the other end waits on, and wakes it.
func (k *Block) wakeOther(r Role) {
	if r == Tx {
		k.Wake(offRxEvent)
	} else {
		k.Wake(offTxEvent)
	}
}

// Wake bumps an event word and wakes whoever waits on it.
func (k *Block) Wake(off int) {
	k.u32(off).Add(1)
	futex(k.u32(off), futexWake, 0, nil)
}

// Detach ends r's holding. A producer that leaves cleanly ends the stream
// after what it sent (the consumer gets EOF once it has taken it all); with
// died, the messages it sent but whose writes the block does not show as
// done are cut off, and every flag a consumer's stream may wait on is
// written, so that no GPU waits forever. A consumer that goes drops the
// messages it took but did not release, and every drained flag is written
// for the producer's stream.
func (k *Block) Detach(r Role, died bool) {
	off := k.roleOff(r)
	slots := k.Slots()
	if r == Tx {
		head := k.Head()
		if died {
			// The first sent message not marked filled: its producer's
			// GPU work may never have run.
			broken := uint64(0)
			for m := max(k.Taken(), head-min(head, uint64(slots))); m < head; m++ {
				if k.Filled(int(m%uint64(slots))) < m+1 {
					broken = m + 1
					break
				}
			}
			if broken != 0 {
				k.u64(offBroken).Store(broken)
			}
			for m := head - min(head, uint64(slots)); m < head; m++ {
				f := k.u64(offFilled + 8*int(m%uint64(slots)))
				if f.Load() < m+1 {
					f.Store(m + 1)
				}
			}
		}
		k.u32(off).Store(StateGone)
	} else {
		taken := k.Taken()
		k.u64(offTail).Store(taken)
		for i := range slots {
			d := k.u64(offDrained + 8*i)
			if d.Load() < taken {
				d.Store(taken)
			}
		}
		k.u32(off).Store(StateNone)
	}
	k.wakeOther(r)
}

// Removed reports whether the channel was removed (unlinked).
func (k *Block) Removed() bool { return k.u64(offRemoved).Load() != 0 }

// MarkRemoved tells both ends that the channel was removed.
func (k *Block) MarkRemoved() {
	k.u64(offRemoved).Store(1)
	k.Wake(offRxEvent)
	k.Wake(offTxEvent)
}

// ErrRemoved: the channel was removed ('gpushm rm').
var ErrRemoved = errors.New("channel: removed")

// ErrEOF ends a stream: the producer is gone and everything it sent was
// taken.
var ErrEOF = errors.New("channel: the producer is gone and every message it sent was received")

// ErrNoConsumer: a send that was asked not to wait found no consumer.
var ErrNoConsumer = errors.New("channel: no consumer is attached")

// ErrFull: a send that was asked not to wait found every slot in use.
var ErrFull = errors.New("channel: every slot holds a message the consumer has not released")

// ErrTimeout: a wait ran past its time.
var ErrTimeout = errors.New("channel: timed out")

// ErrBroken: the message was cut short by its producer's death; its
// contents are undefined.
var ErrBroken = errors.New("channel: the producer died before this message was written")

// WaitSlot waits (the producer) until message Head may be written: a slot
// is free, and with needConsumer a consumer is attached. It returns the
// message's number. A zero timeout waits forever; a negative one does not
// wait.
func (k *Block) WaitSlot(needConsumer bool, timeout time.Duration, done <-chan struct{}) (uint64, error) {
	slots := uint64(k.Slots())
	return k.wait(offTxEvent, timeout, done, func() (uint64, bool, error) {
		if k.Removed() {
			return 0, false, ErrRemoved
		}
		head := k.Head()
		if needConsumer && k.Holder(Rx).State != StateAttached {
			return 0, false, ErrNoConsumer
		}
		if head-k.Tail() >= slots {
			return 0, false, ErrFull
		}
		return head, true, nil
	})
}

// Sent publishes message k (the producer, once its writes are ordered).
func (k *Block) Sent(m uint64) {
	k.u64(offHead).Store(m + 1)
	k.Wake(offRxEvent)
}

// WaitMessage waits (the consumer) for the next message and takes it,
// returning its number; io.EOF-like ErrEOF when the stream ended.
func (k *Block) WaitMessage(timeout time.Duration, done <-chan struct{}) (uint64, error) {
	m, err := k.wait(offRxEvent, timeout, done, func() (uint64, bool, error) {
		taken := k.Taken()
		if b := k.Broken(); b != 0 && taken+1 >= b {
			return 0, false, ErrBroken
		}
		if k.Head() > taken {
			return taken, true, nil
		}
		if k.Removed() {
			return 0, false, ErrRemoved
		}
		if k.Holder(Tx).State == StateGone {
			return 0, false, ErrEOF
		}
		return 0, false, ErrTimeout
	})
	if err != nil {
		return 0, err
	}
	k.u64(offTaken).Store(m + 1)
	return m, nil
}

// Released returns message k's slot to the producer (the consumer, once
// its reads are ordered).
func (k *Block) Released(m uint64) {
	k.u64(offTail).Store(m + 1)
	k.Wake(offTxEvent)
}

// ErrCanceled: the wait's done channel closed.
var ErrCanceled = errors.New("channel: wait canceled")

// wait polls cond, spinning briefly and then sleeping on the event word
// at off, until cond holds or gives an error that waiting cannot cure
// (ErrEOF), or timeout passes (then cond's last error), or done closes.
func (k *Block) wait(off int, timeout time.Duration, done <-chan struct{}, cond func() (uint64, bool, error)) (uint64, error) {
	ev := k.u32(off)
	var deadline time.Time
	if timeout > 0 {
		deadline = time.Now().Add(timeout)
	}
	spinUntil := time.Now().Add(50 * time.Microsecond)
	for {
		seen := ev.Load()
		v, ok, err := cond()
		if ok {
			return v, nil
		}
		if errors.Is(err, ErrEOF) || errors.Is(err, ErrRemoved) || errors.Is(err, ErrBroken) || timeout < 0 {
			return 0, err
		}
		now := time.Now()
		if !deadline.IsZero() && now.After(deadline) {
			if errors.Is(err, ErrTimeout) || err == nil {
				return 0, ErrTimeout
			}
			return 0, fmt.Errorf("%w: %w", ErrTimeout, err)
		}
		if now.Before(spinUntil) {
			continue
		}
		select {
		case <-done:
			return 0, ErrCanceled
		default:
		}
		var ts *unix.Timespec
		if !deadline.IsZero() {
			t := unix.NsecToTimespec(int64(time.Until(deadline)))
			ts = &t
		} else {
			// Wake now and then anyway: a wake lost to a dead process
			// must not hang us.
			t := unix.NsecToTimespec(int64(100 * time.Millisecond))
			ts = &t
		}
		futex(ev, futexWait, seen, ts)
	}
}

// futex(2) operations (x/sys/unix does not name them).
const (
	futexWait = 0
	futexWake = 1
)

// futex calls futex(2) on a word of shared memory (not FUTEX_PRIVATE: the
// other end is another process).
func futex(w *atomic.Uint32, op int, val uint32, ts *unix.Timespec) {
	unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(w)), uintptr(op), uintptr(val), uintptr(unsafe.Pointer(ts)), 0, 0)
}
