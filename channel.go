package gpushm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/channel"
	"github.com/gpushm/gpushm/internal/cuda"
	"github.com/gpushm/gpushm/internal/wire"
)

// BrokenError says which message was the first that a dead producer did
// not finish (its Seq); errors.Is(err, ErrBroken) matches it.
type BrokenError = channel.BrokenError

// Role is a channel end: one producer and one consumer per channel.
type Role string

// The roles.
const (
	Producer Role = "tx"
	Consumer Role = "rx"
)

// Errors a channel's Send and Recv return (also matched by errors.Is).
var (
	// ErrNoConsumer: Send with NoWait found no consumer attached.
	ErrNoConsumer = channel.ErrNoConsumer
	// ErrFull: Send with NoWait found every slot holding a message the
	// consumer has not released.
	ErrFull = channel.ErrFull
	// ErrRemoved: the channel was removed ('gpushm rm').
	ErrRemoved = channel.ErrRemoved
	// ErrBroken: the producer died before it finished a message (a
	// *BrokenError says which); see Recv.
	ErrBroken = channel.ErrBroken
)

// ChannelOptions are the optional parts of opening (or making) a channel.
type ChannelOptions struct {
	// SlotBytes > 0 makes the channel if it does not exist (or finds one
	// with the same layout): Slots messages of SlotBytes each (Slots 0
	// means 4). 0 opens an existing channel.
	Slots     int
	SlotBytes int64
	// Meta, Mode and Device are as for a create.
	Meta   json.RawMessage
	Mode   *uint32
	Device *int
	// Devices are the GPUs that touch the slots in this process (a
	// consumer on another GPU); empty means the channel's own GPU.
	Devices []int
	// NoWait makes Send fail with ErrNoConsumer or ErrFull instead of
	// waiting for a consumer or a free slot.
	NoWait bool
}

// Channel is one end of a channel (docs/protocol.md, "Channels"). It is
// not safe for concurrent use; one message is out at a time.
type Channel struct {
	c      *Client
	name   string
	role   Role
	info   SegmentInfo
	m      *Mapping
	ctl    []byte
	blk    *channel.Block
	ctlDev uint64 // the block's address on the GPU (cuda channels)
	noWait bool
	stride int64
	slots  int

	mu     sync.Mutex
	out    *Message // taken or being written, not yet Done
	last   uint64   // the producer's last message + 1
	seen   uint64   // the consumer's: the last break it was told of
	closed bool
}

// Message is one slot handed out by Send (to fill) or Recv (to read).
// Done hands it over.
type Message struct {
	ch   *Channel
	seq  uint64
	slot int
}

// Channel opens one end of the channel name, making it first when
// o.SlotBytes says how. The producer needs write permission, the consumer
// read permission.
func (c *Client) Channel(ctx context.Context, name string, role Role, o *ChannelOptions) (*Channel, error) {
	if o == nil {
		o = &ChannelOptions{}
	}
	if role != Producer && role != Consumer {
		return nil, fmt.Errorf("gpushm: channel role %q (want Producer or Consumer)", role)
	}
	readOnly := role == Consumer
	req := &wire.Request{Op: wire.OpOpen, Name: name, Role: string(role), ReadOnly: readOnly}
	if o.SlotBytes > 0 {
		slots := o.Slots
		if slots == 0 {
			slots = 4
		}
		co := &CreateOptions{Device: o.Device, Mode: o.Mode, Meta: o.Meta, ExistOK: true}
		req = co.request(name, 0, true)
		req.Slots, req.SlotBytes, req.Role = slots, o.SlotBytes, string(role)
		// A consumer that makes the channel still maps its slots for
		// reading only.
		req.ReadOnly = readOnly
	}
	rep, fd, err := c.roundTrip(ctx, req)
	if err != nil {
		return nil, fmt.Errorf("gpushm: channel %q: %w", name, err)
	}
	ch := &Channel{c: c, name: name, role: role, info: *rep.Segment, noWait: o.NoWait}
	err = ch.attach(fd, rep.CtlFD, readOnly, o.Devices)
	closeFD(fd)
	closeFD(rep.CtlFD)
	if err != nil {
		c.roundTrip(context.Background(), &wire.Request{Op: wire.OpClose, Segment: ch.info.ID})
		return nil, fmt.Errorf("gpushm: channel %q: %w", name, err)
	}
	c.hold(ch)
	return ch, nil
}

// attach maps the slots and the control block.
func (ch *Channel) attach(fd, ctlFD int, readOnly bool, devices []int) error {
	if ch.info.Channel == nil || ctlFD < 0 {
		return fmt.Errorf("%q is not a channel", ch.info.Name)
	}
	ch.slots, ch.stride = ch.info.Channel.Slots, ch.info.Channel.SlotStride
	m, err := mapSegment(fd, &ch.info, readOnly, devices)
	if err != nil {
		return err
	}
	ctl, err := unix.Mmap(ctlFD, 0, channel.BlockBytes, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		m.unmap()
		return fmt.Errorf("map control block: %w", err)
	}
	blk, err := channel.Map(ctl)
	if err == nil {
		_, _, _, err = blk.Check()
	}
	if err == nil {
		err = blk.CheckVersion()
	}
	if err == nil && m.dev != nil {
		// The streams write and wait on the block: pin it, with an address
		// on the GPU.
		ch.ctlDev, err = m.dev.RegisterHost(ctl)
	}
	if err != nil {
		unix.Munmap(ctl)
		m.unmap()
		return err
	}
	ch.m, ch.ctl, ch.blk = m, ctl, blk
	blk.Awake(channel.Role(ch.role))
	if ch.role == Producer {
		ch.last = blk.Head()
	} else {
		ch.seen = blk.Seen()
	}
	return nil
}

// Info describes the channel as it was opened.
func (ch *Channel) Info() SegmentInfo { return ch.info }

// Slots is the number of slots; SlotBytes a message's size.
func (ch *Channel) Slots() int { return ch.slots }

// SlotBytes is the size of one message.
func (ch *Channel) SlotBytes() int64 { return ch.info.Channel.SlotBytes }

func waitArgs(ctx context.Context) (time.Duration, <-chan struct{}) {
	timeout := time.Duration(0)
	if d, ok := ctx.Deadline(); ok {
		timeout = max(time.Until(d), time.Nanosecond)
	}
	return timeout, ctx.Done()
}

func (ch *Channel) stream(h uintptr) *cuda.Stream {
	if ch.m.dev == nil {
		return nil
	}
	return ch.m.dev.ForeignStream(h)
}

// Send waits for a free slot and returns it as the next message. On a
// cuda channel, stream (a CUstream; 0 for the default stream) first waits,
// on the GPU, until the consumer's reads of the slot's last message are
// done; queue the work that fills the slot on the same stream, then call
// Done with it. No CPU synchronization takes place.
func (ch *Channel) Send(ctx context.Context, stream uintptr) (*Message, error) {
	if ch.role != Producer {
		return nil, errors.New("gpushm: Send on a consumer's channel")
	}
	ch.mu.Lock()
	defer ch.mu.Unlock()
	if err := ch.usable(); err != nil {
		return nil, err
	}
	timeout, done := waitArgs(ctx)
	if ch.noWait {
		timeout = -1
	}
	k, err := ch.blk.WaitSlot(true, timeout, done)
	if err != nil {
		return nil, ch.waitErr(ctx, err)
	}
	slot := int(k % uint64(ch.slots))
	if s := ch.stream(stream); s != nil && k >= uint64(ch.slots) {
		if err := s.WaitValue64(ch.ctlDev+uint64(channel.DrainedOffset(slot)), k-uint64(ch.slots)+1); err != nil {
			return nil, fmt.Errorf("gpushm: channel %q: %w", ch.name, err)
		}
	}
	msg := &Message{ch: ch, seq: k, slot: slot}
	ch.out = msg
	return msg, nil
}

// Recv waits for the next message. On a cuda channel, stream waits, on the
// GPU, until the producer's writes of it are done; queue the work that
// reads it on the same stream, then call Done with it. At the end of the
// stream (the producer closed or died after sending it all) it returns
// io.EOF.
//
// A producer that dies before its writes of a message are done cuts that
// message off, and every one it sent after it. The consumer is told once,
// with a *BrokenError (ErrBroken) naming the first: from Recv, when it
// would take it, or when it took it before the producer died (on a cuda
// channel, Recv returns before the producer's GPU has written the
// message); or from the Done of a message cut off. Results of work queued
// on messages from that one on are not to be used. After that, Recv skips
// the messages cut off, and goes on with what a next producer sends, or
// io.EOF.
func (ch *Channel) Recv(ctx context.Context, stream uintptr) (*Message, error) {
	if ch.role != Consumer {
		return nil, errors.New("gpushm: Recv on a producer's channel")
	}
	ch.mu.Lock()
	defer ch.mu.Unlock()
	if err := ch.usable(); err != nil {
		return nil, err
	}
	timeout, done := waitArgs(ctx)
	for {
		k, skip, err := ch.blk.WaitMessage(timeout, done, ch.m.dev == nil, ch.seen)
		if errors.Is(err, channel.ErrEOF) {
			return nil, io.EOF
		}
		var cut *channel.BrokenError
		if errors.As(err, &cut) {
			ch.seen = cut.Count
		}
		if err != nil {
			return nil, ch.waitErr(ctx, err)
		}
		slot := int(k % uint64(ch.slots))
		s := ch.stream(stream)
		if skip {
			// Released unread, in the order of the slot's other releases.
			if err := ch.release(s, k, slot); err != nil {
				return nil, err
			}
			continue
		}
		if s != nil {
			if err := s.WaitValue64(ch.ctlDev+uint64(channel.FilledOffset(slot)), k+1); err != nil {
				return nil, fmt.Errorf("gpushm: channel %q: %w", ch.name, err)
			}
		}
		msg := &Message{ch: ch, seq: k, slot: slot}
		ch.out = msg
		return msg, nil
	}
}

// release gives message k's slot back to the producer (the consumer).
func (ch *Channel) release(s *cuda.Stream, k uint64, slot int) error {
	if s != nil {
		if err := s.WriteValue64(ch.ctlDev+uint64(channel.DrainedOffset(slot)), k+1); err != nil {
			return fmt.Errorf("gpushm: channel %q: %w", ch.name, err)
		}
	} else {
		ch.blk.MarkDrained(slot, k+1)
	}
	ch.blk.Released(k)
	ch.last = k + 1
	return nil
}

func (ch *Channel) usable() error {
	switch {
	case ch.closed:
		return fmt.Errorf("gpushm: channel %q is closed", ch.name)
	case ch.out != nil:
		return fmt.Errorf("gpushm: channel %q: message %d is still out; call its Done first", ch.name, ch.out.seq)
	}
	return nil
}

func (ch *Channel) waitErr(ctx context.Context, err error) error {
	if errors.Is(err, channel.ErrCanceled) {
		return ctx.Err()
	}
	if errors.Is(err, channel.ErrTimeout) {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		// The block's wait ends at the deadline, maybe before the
		// context's timer fires.
		if d, ok := ctx.Deadline(); ok && !time.Now().Before(d) {
			return context.DeadlineExceeded
		}
	}
	return fmt.Errorf("gpushm: channel %q: %w", ch.name, err)
}

// Seq is the message's number in the stream (0 for the first).
func (m *Message) Seq() uint64 { return m.seq }

// Bytes is the slot's memory on a host channel (nil on a cuda one).
func (m *Message) Bytes() []byte {
	if m.ch.m.host == nil {
		return nil
	}
	off := int64(m.slot) * m.ch.stride
	return m.ch.m.host[off : off+m.ch.info.Channel.SlotBytes]
}

// DevicePtr is the slot's address on the GPU (0 on a host channel).
func (m *Message) DevicePtr() uint64 {
	if m.ch.m.dev == nil {
		return 0
	}
	return m.ch.m.ptr + uint64(m.slot)*uint64(m.ch.stride)
}

// Done hands the message over: the producer's is sent (its stream marks
// the slot filled once the work queued before it is done), the consumer's
// is released (its stream marks the slot drained). stream must be the one
// given to Send or Recv, or one ordered after it. A consumer's Done
// returns a *BrokenError (ErrBroken) when the message was cut off by its
// producer's death (see Recv); the slot is released all the same.
func (m *Message) Done(stream uintptr) error {
	ch := m.ch
	ch.mu.Lock()
	defer ch.mu.Unlock()
	if ch.out != m {
		return fmt.Errorf("gpushm: channel %q: message %d is not out", ch.name, m.seq)
	}
	ch.out = nil
	s := ch.stream(stream)
	if ch.role == Consumer {
		if err := ch.release(s, m.seq, m.slot); err != nil {
			return err
		}
		if cut := ch.blk.Untold(m.seq, ch.seen); cut != nil {
			ch.seen = cut.Count
			return fmt.Errorf("gpushm: channel %q: %w", ch.name, cut)
		}
		return nil
	}
	if s != nil {
		if err := s.WriteValue64(ch.ctlDev+uint64(channel.FilledOffset(m.slot)), m.seq+1); err != nil {
			return fmt.Errorf("gpushm: channel %q: %w", ch.name, err)
		}
	} else {
		ch.blk.MarkFilled(m.slot, m.seq+1)
	}
	ch.blk.Sent(m.seq)
	ch.last = m.seq + 1
	return nil
}

// Close ends this end of the channel. A producer first waits (up to 10 s)
// until its last message's writes are done on the GPU, so that the
// consumer gets every message it sent and then io.EOF.
func (ch *Channel) Close() error {
	ch.mu.Lock()
	if ch.closed {
		ch.mu.Unlock()
		return nil
	}
	ch.closed = true
	if ch.m.dev != nil && ch.last > 0 {
		// The last stream write (the producer's filled, the consumer's
		// drained) must land before the block is unpinned and, for the
		// producer, before the daemon hears that it is done.
		slot := int((ch.last - 1) % uint64(ch.slots))
		flag := ch.blk.Filled
		if ch.role == Consumer {
			flag = ch.blk.Drained
		}
		for deadline := time.Now().Add(10 * time.Second); flag(slot) < ch.last && time.Now().Before(deadline); {
			time.Sleep(50 * time.Microsecond)
		}
	}
	ch.mu.Unlock()
	c := ch.c
	// Still listed while closing: a reconnection on the way reclaims the
	// role first, so that this close ends it.
	_, _, err := c.roundTrip(context.Background(), &wire.Request{Op: wire.OpClose, Segment: ch.info.ID, Role: string(ch.role)})
	c.unhold(ch)
	if errors.Is(err, syscall.EINVAL) {
		err = nil // the lease went with a connection the daemon lost
	}
	if ch.m.dev != nil {
		err = errors.Join(err, ch.m.dev.UnregisterHost(ch.ctl))
	}
	return errors.Join(err, unix.Munmap(ch.ctl), ch.m.unmap())
}

// reclaimLocked takes back ch's role on c's new connection after a
// reconnection; c.mu is held (holder).
func (ch *Channel) reclaimLocked(ctx context.Context, c *Client) (settle string, err error) {
	c.nextID++
	_, fd, err := c.exchangeLocked(ctx, &wire.Request{ID: c.nextID, Op: wire.OpReclaim, Segment: ch.info.ID,
		Count: 1, ReadOnly: ch.role == Consumer, Role: string(ch.role)}, -1)
	closeFD(fd)
	return "", err
}

// end closes ch as its client closes (holder).
func (ch *Channel) end() error { return ch.Close() }
