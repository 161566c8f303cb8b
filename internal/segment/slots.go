package segment

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
)

// Channels (docs/protocol.md, "Channels"): a segment whose memory is slots
// of a fixed size, with a control block beside it in host memory that the
// producer, the consumer and the daemon share. The registry knows the
// layout and keeps the two memories together; what the block holds is the
// server's business (internal/channel).

// MaxSlots bounds a channel's slots; ControlBytes is its control block.
const (
	MaxSlots     = 64
	ControlBytes = 4096
	slotAlign    = 4096
)

func channelStride(slotBytes int64) int64 { return (slotBytes + slotAlign - 1) / slotAlign * slotAlign }

func describeLayout(slots int, slotBytes int64) string {
	if slots == 0 {
		return "not a channel"
	}
	return fmt.Sprintf("a channel of %d slots of %d bytes", slots, slotBytes)
}

// channelSize checks a channel's layout and returns the bytes its slots
// take.
func (r *Registry) channelSize(o CreateOptions) (int64, error) {
	if o.Slots < 1 || o.Slots > MaxSlots {
		return 0, fmt.Errorf("%w: %d slots (want 1 to %d)", ErrBadSize, o.Slots, MaxSlots)
	}
	if o.SlotBytes <= 0 || o.SlotBytes > 1<<40 {
		return 0, fmt.Errorf("%w: slots of %d bytes (want 1 byte to 1 TiB)", ErrBadSize, o.SlotBytes)
	}
	size := int64(o.Slots) * channelStride(o.SlotBytes)
	if o.Size != 0 && o.Size != size {
		return 0, fmt.Errorf("%w: size %d for %d slots of %d bytes (want %d, or none)", ErrBadSize, o.Size, o.Slots, o.SlotBytes, size)
	}
	if r.ctlAlloc == nil {
		return 0, fmt.Errorf("%w: this daemon makes no channels", ErrNoData)
	}
	return size, nil
}

// SetControlAllocator gives the registry the host memory allocator that
// channels' control blocks come from.
func (r *Registry) SetControlAllocator(a Allocator) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ctlAlloc = a
}

// ChannelMemory is a channel's memory: its slots and its control block,
// freed together.
type ChannelMemory struct {
	Data, Control Memory
}

func (m *ChannelMemory) FD() (int, error) { return m.Data.FD() }
func (m *ChannelMemory) Size() int64      { return m.Data.Size() }
func (m *ChannelMemory) Free() error      { return errors.Join(m.Data.Free(), m.Control.Free()) }

// ControlFD is the control block's descriptor.
func (m *ChannelMemory) ControlFD() (int, error) { return m.Control.FD() }

func (r *Registry) allocateChannel(o CreateOptions) (Memory, error) {
	data, err := r.alloc.Allocate(o.Device, o.Size)
	if err != nil {
		return nil, err
	}
	ctl, err := r.ctlAlloc.Allocate(0, ControlBytes)
	if err != nil {
		free(data)
		return nil, fmt.Errorf("control block: %w", err)
	}
	m := &ChannelMemory{Data: data, Control: ctl}
	if o.Control != nil {
		if err := o.Control(m); err != nil {
			free(m)
			return nil, fmt.Errorf("control block: %w", err)
		}
	}
	return m, nil
}

// controlFD is mem's control block descriptor, or -1 for memory that has
// none.
func controlFD(mem Memory) int {
	if c, ok := mem.(*ChannelMemory); ok {
		if fd, err := c.ControlFD(); err == nil {
			return fd
		}
	}
	return -1
}

// WithControl runs fn with a channel's control block descriptor, which
// stays open until fn returns, whether or not the caller holds a lease: a
// segment freed meanwhile waits for fn, one already freed is ErrNotFound.
func (r *Registry) WithControl(s *Segment, fn func(fd int) error) error {
	s.io.RLock()
	defer s.io.RUnlock()
	r.mu.Lock()
	mem, gone := s.mem, s.gone
	r.mu.Unlock()
	if gone || mem == nil {
		return fmt.Errorf("%w: segment %d was removed", ErrNotFound, s.id)
	}
	c, ok := mem.(*ChannelMemory)
	if !ok {
		return fmt.Errorf("%w: not a channel", ErrBadSize)
	}
	fd, err := c.ControlFD()
	if err != nil {
		return err
	}
	return fn(fd)
}

// IsChannel reports whether s is a channel.
func (s *Segment) IsChannel() bool { return s.slots > 0 }

// Channels lists every channel holding memory, for a server that repairs
// their control blocks after a restart.
func (r *Registry) Channels() []*Segment {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []*Segment
	for _, s := range r.byID {
		if s.slots > 0 && s.orphan == "" {
			out = append(out, s)
		}
	}
	return out
}

// sameJSON reports whether two JSON documents mean the same (no document
// and null are the same).
func sameJSON(a, b json.RawMessage) bool {
	var x, y any
	if len(a) > 0 && json.Unmarshal(a, &x) != nil {
		return false
	}
	if len(b) > 0 && json.Unmarshal(b, &y) != nil {
		return false
	}
	return reflect.DeepEqual(x, y)
}

// OnChannelRemoved sets what runs when a channel loses its name (unlink, or
// a rename over it, by any path: the socket or the FUSE view), so that its
// ends can be told. Set it before the registry is used.
func (r *Registry) OnChannelRemoved(fn func(*Segment)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.removed = fn
}

// channelRemoved tells the hook that s lost its name, if s is a channel.
func (r *Registry) channelRemoved(s *Segment) {
	r.mu.Lock()
	fn := r.removed
	r.mu.Unlock()
	if fn != nil && s.slots > 0 {
		fn(s)
	}
}
