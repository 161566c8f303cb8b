// Package channel is the control block of a tensor channel (docs/protocol.md,
// "Channels"): the counters and flags a producer and a consumer share to hand
// messages over, and the repairs the daemon makes when one of them dies.
//
// The block is shared memory written by several processes (and by GPU
// streams); every access is atomic, and the hand-off is the release store of
// a counter, a bump of the other end's event word and, if that end said it
// may be asleep, a futex wake. This package, internal/epoch and
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
	// Version is the block's layout: 2 added the sleeping words, without
	// which an end of version 1 would sleep unwoken (its peer wakes it
	// only when it says it sleeps), so an end speaks one version only.
	Version = 2
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
	offBrokenEnd = 336
	offBreaks    = 344
	offRxEvent   = 384
	offRxSleep   = 388 // the consumer may be asleep on rx_event (version 2)
	offTxEvent   = 448
	offTxSleep   = 452
	offFilled    = 1024
	offDrained   = 1536
)

const magic = "GPUSHMC1"

// Cut marks a filled flag that the daemon wrote for a message its dead
// producer never finished: Cut | (k+1) for message k. A stream's wait for
// k+1 or less (cyclic greater-or-equal: the difference is below 2^63) is
// met, so no GPU waits for ever, and no producer writes such a value
// (message numbers stay below 2^62), so the flag tells itself apart from a
// finished message's. The mark goes when the next producer attaches.
const Cut = 1 << 62

// Reached reports whether a flag holding v meets a stream's wait for at
// least want: CU_STREAM_WAIT_VALUE_GEQ's cyclic comparison, which the CPU
// makes the same way where no stream waits (host memory).
func Reached(v, want uint64) bool { return int64(v-want) >= 0 }

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
	binary.LittleEndian.PutUint32(k.b[offVersion:], Version)
	binary.LittleEndian.PutUint32(k.b[offSlots:], uint32(slots))
	binary.LittleEndian.PutUint64(k.b[offSlotBytes:], uint64(slotBytes))
	binary.LittleEndian.PutUint64(k.b[offStride:], uint64(stride))
}

// Check verifies that the block is a channel's with this layout, of a
// version the daemon knows: version 1 differs only by words the daemon
// never reads, so blocks made before an upgrade keep their channels. An
// end checks the version too (CheckVersion).
func (k *Block) Check() (slots int, slotBytes, stride int64, err error) {
	if string(k.b[offMagic:offMagic+8]) != magic {
		return 0, 0, 0, errors.New("not a gpushm channel control block (bad magic)")
	}
	if v := k.Version(); v != 1 && v != Version {
		return 0, 0, 0, fmt.Errorf("channel control block of version %d, newer than this daemon's %d", v, Version)
	}
	slots = int(binary.LittleEndian.Uint32(k.b[offSlots:]))
	slotBytes = int64(binary.LittleEndian.Uint64(k.b[offSlotBytes:]))
	stride = int64(binary.LittleEndian.Uint64(k.b[offStride:]))
	if slots < 1 || slots > MaxSlots || slotBytes <= 0 || stride < slotBytes || stride%Align != 0 {
		return 0, 0, 0, fmt.Errorf("control block says %d slots of %d bytes every %d: not a valid layout", slots, slotBytes, stride)
	}
	return slots, slotBytes, stride, nil
}

// Version is the block's layout version.
func (k *Block) Version() uint32 { return k.u32(offVersion).Load() }

// CheckVersion reports, for an end, a block of another version than its
// own: ends of two versions must not share a channel, since one of them
// would sleep unwoken.
func (k *Block) CheckVersion() error {
	if v := k.Version(); v != Version {
		return fmt.Errorf("its control block is version %d, this client's is %d: the daemon or the channel's other end "+
			"runs another gpushm version (a channel made before an upgrade takes the new version once neither end holds it)", v, Version)
	}
	return nil
}

// Upgrade brings a block of version 1 to this version when no end holds
// it, so that a channel made before a daemon upgrade serves ends of the
// new version. With an end of version 1 still attached it stays as it is,
// and the new end refuses it (CheckVersion) rather than share it.
func (k *Block) Upgrade() {
	if k.Version() != 1 || k.Holder(Tx).State == StateAttached || k.Holder(Rx).State == StateAttached {
		return
	}
	k.u32(offRxSleep).Store(0)
	k.u32(offTxSleep).Store(0)
	k.u32(offVersion).Store(Version)
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

// A Break is the record of the last producer that died before its
// messages were whole: messages First to End-1 are cut off. Count numbers
// the breaks (0: none yet), so that a consumer can tell whether it was
// told of this one.
type Break struct {
	First, End, Count uint64
}

// Break reads the record of the last break. Count is read first and the
// rest after it: the daemon writes it last.
func (k *Block) Break() Break {
	n := k.u64(offBreaks).Load()
	b := k.u64(offBroken).Load()
	if n == 0 || b == 0 {
		return Break{}
	}
	return Break{First: b - 1, End: k.u64(offBrokenEnd).Load(), Count: n}
}

// BrokenError is the error of a consumer told of a break: message Seq and
// every one after it that the dead producer sent are cut off.
type BrokenError struct {
	Seq   uint64 // the first message cut off
	Count uint64 // the break's number (Break.Count)
}

func (e *BrokenError) Error() string {
	return fmt.Sprintf("channel: the producer died before it finished message %d; "+
		"results of work on messages from %d on are not to be used", e.Seq, e.Seq)
}

// Is makes a BrokenError match ErrBroken.
func (e *BrokenError) Is(target error) bool { return target == ErrBroken }

// Untold returns the break that a consumer which knows of breaks up to
// seen was not told of, if it cut off message m or one before it (m:
// the message the consumer releases, or the next it would take); nil if
// none.
func (k *Block) Untold(m, seen uint64) *BrokenError {
	if b := k.Break(); b.Count != 0 && b.Count != seen && b.First <= m {
		return &BrokenError{Seq: b.First, Count: b.Count}
	}
	return nil
}

// Seen is what a consumer attaching now knows of breaks: every break but
// one whose cut-off messages it has still to meet.
func (k *Block) Seen() uint64 {
	b := k.Break()
	if b.Count != 0 && k.Taken() < b.End {
		return b.Count - 1
	}
	return b.Count
}

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
	if r == Tx {
		// The messages a dead predecessor cut off keep their numbers (the
		// consumer skips them), and this producer goes on after them; but
		// a cut mark would meet the consumer's stream waits on this
		// producer's messages too. The plain value still meets every wait
		// on the cut-off messages themselves.
		for i := range k.Slots() {
			if f := k.u64(offFilled + 8*i); f.Load()&Cut != 0 {
				f.Store(f.Load() &^ Cut)
			}
		}
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

// Wake bumps an event word and wakes whoever waits on it. The daemon
// wakes so, whether the end says it sleeps or not: its wakes are rare.
func (k *Block) Wake(off int) {
	k.u32(off).Add(1)
	futex(k.u32(off), futexWake, 0, nil)
}

// notify bumps the event word at off and wakes its end only if that end
// says it may be asleep (the sleeping word beside it): a hand-off to an
// end that polls costs no system call. The bump comes before the read of
// the sleeping word, and the sleeper sets the word before it reads the
// event word and its condition; both sequentially consistent, so either
// the sleeper sees the bump, or this sees the sleeper (see wait).
func (k *Block) notify(off int) {
	ev := k.u32(off)
	ev.Add(1)
	if k.u32(off+4).Load() != 0 {
		futex(ev, futexWake, 0, nil)
	}
}

// Awake says that this end does not sleep (an end that opens the channel
// clears what a predecessor of its role left).
func (k *Block) Awake(r Role) {
	if r == Tx {
		k.u32(offTxSleep).Store(0)
	} else {
		k.u32(offRxSleep).Store(0)
	}
}

// Detach ends r's holding. A producer that leaves cleanly ends the stream
// after what it sent (the consumer gets EOF once it has taken it all); with
// died, the messages it sent from the first one whose writes the block
// does not show as done are cut off (see cut). A consumer that goes drops
// the messages it took but did not release, and every drained flag is
// written for the producer's stream.
func (k *Block) Detach(r Role, died bool) {
	off := k.roleOff(r)
	slots := k.Slots()
	if r == Tx {
		if died {
			k.cut()
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

// cut records a dead producer's break: the first message it sent whose
// writes are not done, and every one it sent after it, are cut off. Their
// flags get the Cut mark, which meets every stream wait on them, so no
// GPU waits for ever; the consumer learns of the break from the record
// (Untold), at its next call or as it releases a message.
//
// Which messages are done is read from the filled flags alone. A
// producer's stream writes filled[i] = k+1 after message k's writes, and
// the messages of one slot are written in turn (a message's writes wait
// for the consumer's release of the slot's message before it, which came
// after that message's flag), so a flag holding v says that the slot's
// messages below v are done and its next one is not (a producer's stream
// runs its work in order, too). This holds however
// far a producer's CPU ran ahead of its GPU, and whether the consumer took
// (or released) a message before the producer died or not.
//
// The process that died must not write the block any more: its GPU work
// ends with it, as the driver tears its contexts down when the process's
// last descriptor of the device closes, before the process is reaped and
// its pidfd says it exited.
func (k *Block) cut() {
	head := k.Head()
	slots := uint64(k.Slots())
	first := head
	for i := range slots {
		v := k.Filled(int(i)) &^ Cut
		first = min(first, v+(i+slots-v%slots)%slots) // slot i's first message from v on
	}
	if first == head {
		return // every message sent is whole
	}
	brk := first + 1
	if old := k.Break(); old.Count != 0 && k.Taken() < old.End {
		// The consumer has not gone past the last break yet: the record
		// covers both, from the first one's first message (this
		// producer's whole messages before its own first unfinished one
		// are cut off too).
		brk = old.First + 1
	}
	k.u64(offBroken).Store(brk)
	k.u64(offBrokenEnd).Store(head)
	k.u64(offBreaks).Add(1)
	for i := range min(slots, head) {
		last := head - 1 - (head-1-i)%slots // the slot's last message sent
		if f := k.u64(offFilled + 8*int(i)); f.Load() < last+1 {
			f.Store(Cut | (last + 1))
		}
	}
}

// Recut writes the Cut mark again where a flag of the last break's
// messages fell below it, and reports whether the break still stands for
// a producer to come (false once a producer holds the channel again, or
// there is no break). The dead producer's GPU work may outlive the
// moment its death is seen by a little: a late write of an older
// message's flag would lower a mark under a consumer's stream wait, which
// would then wait for ever. The daemon calls Recut for a while after a
// break.
func (k *Block) Recut() bool {
	if k.Holder(Tx).State == StateAttached {
		return false
	}
	b := k.Break()
	if b.Count == 0 {
		return false
	}
	slots := uint64(k.Slots())
	for i := range min(slots, b.End) {
		last := b.End - 1 - (b.End-1-i)%slots
		if f := k.u64(offFilled + 8*int(i)); f.Load() < last+1 {
			f.Store(Cut | (last + 1))
		}
	}
	return true
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

// ErrBroken: a message was cut off by its producer's death; its contents
// are undefined (a *BrokenError says which).
var ErrBroken = errors.New("channel: the producer died before a message was written")

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
	k.notify(offRxEvent)
}

// WaitMessage waits (the consumer) for message Taken and takes it,
// returning its number; ErrEOF when the stream ended. host says that no
// stream waits for the message's filled flag: the CPU waits for it (host
// memory). seen is the last break the consumer was told of: a break it
// was not told of that cut off a message it took, or the next one, is a
// *BrokenError; a message cut off by one it was told of is returned with
// skip, for the caller to release at once.
func (k *Block) WaitMessage(timeout time.Duration, done <-chan struct{}, host bool, seen uint64) (m uint64, skip bool, err error) {
	slots := uint64(k.Slots())
	m, err = k.wait(offRxEvent, timeout, done, func() (uint64, bool, error) {
		// Whether the producer is gone is read before the head: a
		// producer's last message is published before its end is
		// recorded, so a head read after seeing it gone is final. Read
		// the other way round, a message sent and the end recorded in
		// between would be lost to a spurious EOF.
		gone := k.Holder(Tx).State == StateGone
		taken := k.Taken()
		head := k.Head()
		// The flag before the break: the daemon records a break before it
		// marks the flags.
		ready := head > taken && (!host || Reached(k.Filled(int(taken%slots)), taken+1))
		if e := k.Untold(taken, seen); e != nil {
			return 0, false, e
		}
		if b := k.Break(); head > taken && b.Count != 0 && b.First <= taken && taken < b.End {
			skip = true
			return taken, true, nil
		}
		if ready {
			return taken, true, nil
		}
		if head > taken {
			return 0, false, ErrTimeout // its producer's writes are not done yet
		}
		if k.Removed() {
			return 0, false, ErrRemoved
		}
		if gone {
			return 0, false, ErrEOF
		}
		return 0, false, ErrTimeout
	})
	if err != nil {
		return 0, false, err
	}
	k.u64(offTaken).Store(m + 1)
	return m, skip, nil
}

// Released returns message k's slot to the producer (the consumer, once
// its reads are ordered).
func (k *Block) Released(m uint64) {
	k.u64(offTail).Store(m + 1)
	k.notify(offTxEvent)
}

// ErrCanceled: the wait's done channel closed.
var ErrCanceled = errors.New("channel: wait canceled")

// wait polls cond, spinning briefly and then sleeping on the event word
// at off, until cond holds or gives an error that waiting cannot cure
// (ErrEOF), or timeout passes (then cond's last error), or done closes.
//
// Before it first sleeps it sets the sleeping word beside the event word
// (so the other end's notify wakes it), then reads the event word and
// cond again, and sleeps only if the event word still holds what it read:
// a bump after the read makes the futex return at once, and one before it
// is seen by cond. The word is cleared when the wait ends. A sleep lasts
// 100 ms at most, so that a wake lost (to a dead process, or a peer that
// cleared the word) delays but never hangs.
func (k *Block) wait(off int, timeout time.Duration, done <-chan struct{}, cond func() (uint64, bool, error)) (uint64, error) {
	ev, sleep := k.u32(off), k.u32(off+4)
	asleep := false
	defer func() {
		if asleep {
			sleep.Store(0)
		}
	}()
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
		if !asleep {
			asleep = true
			sleep.Store(1)
			continue // the event word and cond again, after the store
		}
		d := 100 * time.Millisecond
		if !deadline.IsZero() {
			d = min(d, time.Until(deadline))
		}
		ts := unix.NsecToTimespec(int64(d))
		futex(ev, futexWait, seen, &ts)
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
