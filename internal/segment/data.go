package segment

import (
	"errors"
	"fmt"
	"io"
	"syscall"
	"time"
)

// Data is what the registry needs of a Memory to read, write and resize it
// in the daemon itself, for the FUSE view. The backends' memories implement
// it (mapping the memory into the daemon on first use); a Memory without it
// makes ReadAt, WriteAt and resizing fail with ErrNoData.
type Data interface {
	// ReadAt fills p from off; the range lies within Size.
	ReadAt(p []byte, off int64) error
	// WriteAt copies p to off; the range lies within Size. The bytes are in
	// the memory, visible to every process mapping it, when it returns.
	WriteAt(p []byte, off int64) error
	// Zero clears n bytes at off.
	Zero(off, n int64) error
	// CopyFrom copies the first n bytes of src, a Memory of the same
	// allocator and device, to the start of this one.
	CopyFrom(src Memory, n int64) error
	// Sync returns once every copy into the memory has completed.
	Sync() error
}

// Rounder is implemented by allocators that can tell how many bytes
// Allocate gives for a size (its granularity); the registry uses it to
// resize within an allocation instead of replacing it. Without it, every
// change of allocation size replaces the memory.
type Rounder interface {
	RoundSize(device int, size int64) int64
}

// Resizer is implemented by memory that can change size in place, keeping
// its bytes and its descriptor, for as long as no other process holds the
// descriptor (host memory before a socket client first opens it): a file
// the FUSE view grows is then extended instead of copied into new memory.
type Resizer interface {
	// Resize makes the memory size bytes (rounded as Allocate rounds).
	// Bytes past the old size read as zeros; commit makes their memory
	// now, as Allocate does, where otherwise it may come as they are
	// written. It fails with ErrFixed once the size can no longer change,
	// and the registry then replaces the memory instead. The caller holds
	// the segment's io lock exclusively.
	Resize(size int64, commit bool) error
}

// Journaled is implemented by memory whose descriptor the journal (the
// daemon's own supervisor) may keep without fixing its size, as FD would
// for a client: the descriptor, as JournalFD returns it, stays resizable.
type Journaled interface {
	JournalFD() (int, error)
}

// Parted is implemented by memory made of several descriptors (spill
// memory made in parts, so that the kernel makes its pages on several
// files at once): Parts are its pieces in order, each with its own
// descriptor, the first being the memory's own (FD). The journal keeps
// every part's descriptor, each under a record of its own that names the
// segment (Record.PartOf), and the segment's record lists them in order
// (Record.Parts).
type Parted interface {
	Parts() []Memory
}

// ErrFixed: the memory's size can no longer change in place.
var ErrFixed = errors.New("memory size is fixed")

// ErrTooLarge: a write or resize past the device's memory.
var ErrTooLarge = &Error{"larger than the device", syscall.EFBIG}

// ErrMoreThanDevice: a segment larger than its device's memory, which no
// eviction could make room for: no space (ENOSPC), as a budget's limit.
var ErrMoreThanDevice = &Error{"more than the device holds", syscall.ENOSPC}

func dataOf(mem Memory) (Data, error) {
	d, ok := mem.(Data)
	if !ok {
		return nil, ErrNoData
	}
	return d, nil
}

func (r *Registry) roundSize(device int, size int64) int64 {
	if size <= 0 {
		return 0
	}
	if rd, ok := r.alloc.(Rounder); ok {
		return rd.RoundSize(device, size)
	}
	return size
}

func memSize(mem Memory) int64 {
	if mem == nil {
		return 0
	}
	return mem.Size()
}

func (r *Registry) checkEnd(s *Segment, end int64) error {
	limit, err := r.alloc.Capacity(s.device)
	if err != nil {
		return err
	}
	if end < 0 || end > limit {
		return fmt.Errorf("%w: %d bytes on device %d of %d", ErrTooLarge, end, s.device, limit)
	}
	return nil
}

// ReadAt copies s's bytes at off into p, up to s's size, and returns how
// many it copied, with io.EOF when that is fewer than len(p). The caller
// holds a pin or a lease on s.
func (r *Registry) ReadAt(s *Segment, p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("read at %d: %w", off, syscall.EINVAL)
	}
	s.io.RLock()
	defer s.io.RUnlock()
	r.mu.Lock()
	size, mem := s.size, s.mem
	r.mu.Unlock()
	if off >= size {
		return 0, io.EOF
	}
	n := min(int64(len(p)), size-off)
	d, err := dataOf(mem)
	if err != nil {
		return 0, err
	}
	if err := d.ReadAt(p[:n], off); err != nil {
		return 0, fmt.Errorf("read %d bytes at %d of %q: %w", n, off, s.name, err)
	}
	if n < int64(len(p)) {
		return int(n), io.EOF
	}
	return int(n), nil
}

// Lender is implemented by memory the daemon maps, whose bytes a reply can
// be made of without copying them first (host memory).
type Lender interface {
	// Lend returns the n bytes at off, as they are in the memory; they
	// stay valid until the memory is resized or freed.
	Lend(off, n int64) ([]byte, error)
}

// Lend is ReadAt without the copy, for memory that can lend its bytes
// (Lender): it returns s's bytes at off, up to n and s's size (io.EOF when
// fewer), and done, to call once they are no longer used; until then s
// keeps its memory and its size. It fails with ErrNoData for memory that
// cannot lend. The caller holds a pin or a lease on s.
func (r *Registry) Lend(s *Segment, off int64, n int) (b []byte, done func(), err error) {
	if off < 0 {
		return nil, nil, fmt.Errorf("read at %d: %w", off, syscall.EINVAL)
	}
	s.io.RLock()
	r.mu.Lock()
	size, mem := s.size, s.mem
	r.mu.Unlock()
	l, ok := mem.(Lender)
	switch {
	case off >= size:
		s.io.RUnlock()
		return nil, func() {}, io.EOF
	case !ok:
		s.io.RUnlock()
		return nil, nil, ErrNoData
	}
	k := min(int64(n), size-off)
	if b, err = l.Lend(off, k); err != nil {
		s.io.RUnlock()
		return nil, nil, fmt.Errorf("read %d bytes at %d of %q: %w", k, off, s.name, err)
	}
	if k < int64(n) {
		err = io.EOF
	}
	return b, s.io.RUnlock, err
}

// WriteAt copies p into s at off. A write past the end grows s, zeroing any
// gap, into new memory when it does not fit in the allocation; growing is
// refused with ErrBusy while s is leased (another process may have it
// mapped). The allocation grows geometrically, so that a file written
// sequentially is copied O(1) times per byte; Trim gives back the slack.
// The caller holds a pin or a lease on s.
func (r *Registry) WriteAt(s *Segment, p []byte, off int64) (int, error) {
	end := off + int64(len(p))
	if off < 0 || end < off {
		return 0, fmt.Errorf("write at %d: %w", off, syscall.EINVAL)
	}
	s.io.RLock()
	r.mu.Lock()
	if s.gone {
		r.mu.Unlock()
		s.io.RUnlock()
		return 0, fmt.Errorf("%w: segment %d was removed", ErrNotFound, s.id)
	}
	size, mem := s.size, s.mem
	if end <= size {
		s.modified = time.Now()
	}
	r.writtenLocked(s)
	r.forgetSourcesLocked(s, off, end-off)
	r.mu.Unlock()
	if end > size {
		s.io.RUnlock()
		return r.growingWrite(s, p, off)
	}
	defer s.io.RUnlock()
	d, err := dataOf(mem)
	if err != nil {
		return 0, err
	}
	if err := d.WriteAt(p, off); err != nil {
		return 0, fmt.Errorf("write %d bytes at %d of %q: %w", len(p), off, s.name, err)
	}
	s.changes.Add(1)
	return len(p), nil
}

// growingWrite is WriteAt past the end, with s.io held exclusively: the
// size changes, and with it what readers may see.
func (r *Registry) growingWrite(s *Segment, p []byte, off int64) (int, error) {
	end := off + int64(len(p))
	if err := r.checkEnd(s, end); err != nil {
		return 0, err
	}
	s.io.Lock()
	defer s.io.Unlock()
	r.mu.Lock()
	size, mem, err := r.resizableLocked(s)
	r.mu.Unlock()
	if err != nil {
		return 0, err
	}
	if have := memSize(mem); end > have {
		if mem, err = r.grow(s, mem, size, have, end); err != nil {
			return 0, err
		}
	}
	d, err := dataOf(mem)
	if err != nil {
		return 0, err
	}
	if off > size {
		if err := d.Zero(size, off-size); err != nil {
			return 0, fmt.Errorf("zero %d bytes at %d of %q: %w", off-size, size, s.name, err)
		}
	}
	if err := d.WriteAt(p, off); err != nil {
		return 0, fmt.Errorf("write %d bytes at %d of %q: %w", len(p), off, s.name, err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, _, err := r.resizableLocked(s); err != nil {
		// Leased while we wrote: the bytes past the old end stay unseen.
		return 0, err
	}
	s.size = max(s.size, end)
	s.modified = time.Now()
	s.changes.Add(1)
	r.noteLocked(s, -1)
	return len(p), nil
}

// resizableLocked returns s's size and memory if its size may change now.
func (r *Registry) resizableLocked(s *Segment) (int64, Memory, error) {
	switch {
	case s.gone:
		return 0, nil, fmt.Errorf("%w: segment %d was removed", ErrNotFound, s.id)
	case s.opens > 0:
		return 0, nil, fmt.Errorf("%w: %q has %d lease(s): another process may have it mapped", ErrBusy, s.name, s.opens)
	case s.doubt:
		return 0, nil, fmt.Errorf("%w: %q: the daemon restarted, and clients may still have it mapped (try again in %s)",
			ErrBusy, s.name, max(time.Until(r.graceUntil), 0).Round(time.Second))
	}
	return s.size, s.mem, nil
}

// grow replaces s's memory (have bytes) with at least need bytes, keeping
// its first keep bytes. s.io is held exclusively. It asks for twice what s
// has first, so that sequential writes reallocate log(n) times; when the
// device cannot spare that, it asks for less, down to need.
func (r *Registry) grow(s *Segment, mem Memory, keep, have, need int64) (Memory, error) {
	limit, err := r.alloc.Capacity(s.device)
	if err != nil {
		return nil, err
	}
	var tries []int64
	for _, t := range []int64{2 * have, have + have/8, need} {
		t = min(max(t, need), limit)
		if len(tries) == 0 || t < tries[len(tries)-1] {
			tries = append(tries, t)
		}
	}
	for i, t := range tries {
		nm, err := r.replace(s, mem, keep, t, -1, false)
		if err == nil || i == len(tries)-1 || !isNoMem(err) {
			return nm, err
		}
	}
	panic("unreachable")
}

// isNoMem: out of memory, or over a quota; either way a smaller ask may fit.
func isNoMem(err error) bool {
	return errors.Is(err, syscall.ENOMEM) || errors.Is(err, syscall.ENOSPC)
}

// replace gives s new memory of at least capacity bytes (none for 0)
// holding the first keep bytes of mem, and, when size >= 0, sets the size
// in the same step, zeroing the new memory from keep up to it. s.io is held
// exclusively. The old memory is freed. Memory that can resize in place
// (Resizer) does so instead, and stays s's; commit asks it to make the
// memory it grows by now.
func (r *Registry) replace(s *Segment, mem Memory, keep, capacity, size int64, commit bool) (Memory, error) {
	if capacity > 0 {
		if nm, err := r.resizeInPlace(s, mem, keep, capacity, size, commit); nm != nil || err != nil {
			return nm, err
		}
	}
	var nm Memory
	fd := -1
	if grow := r.roundSize(s.device, capacity) - memSize(mem); grow > 0 {
		r.mu.Lock()
		descs := 0
		if mem == nil {
			descs = 1 // an empty file gets memory, and a descriptor to hold it
		}
		err := r.checkLimitsLocked(Cred{UID: s.uid, GID: s.gid}, s.device, grow, descs, false)
		r.mu.Unlock()
		if err != nil {
			return nil, err
		}
	}
	if capacity > 0 {
		var err error
		r.mu.Lock()
		alloc, dev, where := r.alloc, s.device, fmt.Sprintf("device %d", s.device)
		if s.tier == OnHost {
			// An evicted segment grows where it lives.
			alloc, dev, where = r.tiers.cfg.Spill, 0, "host memory"
		} else if err := r.reserveLocked(s, capacity); err != nil {
			r.mu.Unlock()
			return nil, err
		} else {
			// Let go once the new memory is s's (or was not made).
			defer r.unreserve(s.device, r.roundSize(s.device, capacity))
		}
		r.mu.Unlock()
		if nm, err = alloc.Allocate(dev, capacity); err != nil {
			return nil, fmt.Errorf("allocate %d bytes on %s: %w", capacity, where, err)
		}
		keep = min(keep, memSize(mem), nm.Size())
		d, err := dataOf(nm)
		if err == nil && keep > 0 {
			err = d.CopyFrom(mem, keep)
		}
		if err == nil && size > keep {
			err = d.Zero(keep, size-keep)
		}
		if err == nil {
			fd, err = r.durableFD(nm)
		}
		if err != nil {
			free(nm)
			return nil, fmt.Errorf("move %d bytes of %q to new memory: %w", keep, s.name, err)
		}
	}
	r.mu.Lock()
	if _, _, err := r.resizableLocked(s); err != nil {
		r.mu.Unlock()
		free(nm)
		return nil, err
	}
	r.writtenLocked(s)
	s.changes.Add(1)
	s.mem = nm
	if nm != nil {
		r.byID[s.id] = s
	} else {
		delete(r.byID, s.id)
	}
	if size >= 0 && size != s.size {
		s.size = size
		s.modified = time.Now()
	}
	r.noteLocked(s, fd)
	r.mu.Unlock()
	return nm, free(mem)
}

// resizeInPlace is replace for memory that can resize in place (Resizer):
// it returns nil, nil when mem cannot, for replace to allocate instead.
// Opens wait while the size changes (s.moving, which onDeviceLocked waits
// for), so that no descriptor goes out with a size about to change.
func (r *Registry) resizeInPlace(s *Segment, mem Memory, keep, capacity, size int64, commit bool) (Memory, error) {
	rs, ok := mem.(Resizer)
	if !ok {
		return nil, nil
	}
	have := memSize(mem)
	grow := max(r.roundSize(s.device, capacity)-have, 0)
	r.mu.Lock()
	if s.tier == OnHost {
		// Evicted: it grows where it lives, in the spill's memory.
		r.mu.Unlock()
		return nil, nil
	}
	if grow > 0 {
		// Only what it grows by is new: check and reserve that.
		err := r.checkLimitsLocked(Cred{UID: s.uid, GID: s.gid}, s.device, grow, 0, false)
		if err == nil {
			r.tiers.reserved[s.device] += grow
			if err = r.roomLocked(s.device, s, grow, fmt.Sprintf("growing %q to %s", s.name, fmtBytes(capacity))); err != nil {
				r.tiers.reserved[s.device] -= grow
			}
		}
		if err != nil {
			r.mu.Unlock()
			return nil, err
		}
	}
	if _, _, err := r.resizableLocked(s); err != nil || s.moving != nil {
		// Opened since its caller looked (ErrBusy), or an eviction
		// waits for s.io (replace, as before it).
		r.tiers.reserved[s.device] -= grow
		r.mu.Unlock()
		return nil, err
	}
	done := make(chan struct{})
	s.moving = done
	r.mu.Unlock()

	err := rs.Resize(capacity, commit)
	// What it grew by reads as zeros; what it had past keep may not.
	if end := min(size, have, memSize(mem)); err == nil && end > keep {
		d, derr := dataOf(mem)
		if derr == nil {
			derr = d.Zero(keep, end-keep)
		}
		if derr != nil {
			err = fmt.Errorf("zero %d bytes at %d: %w", end-keep, keep, derr)
		}
	}

	r.mu.Lock()
	defer r.mu.Unlock()
	s.moving = nil
	close(done)
	r.tiers.reserved[s.device] -= grow
	if errors.Is(err, ErrFixed) {
		return nil, nil
	}
	// Even if it failed half way, the memory may have changed.
	r.writtenLocked(s)
	s.changes.Add(1)
	if err == nil {
		_, _, err = r.resizableLocked(s)
	}
	if err == nil && size >= 0 && size != s.size {
		s.size = size
		s.modified = time.Now()
	}
	r.noteLocked(s, -1)
	if err != nil {
		return nil, fmt.Errorf("resize %q to %d bytes: %w", s.name, capacity, err)
	}
	return mem, nil
}

// Resize sets s's size, as truncate(2) does: bytes past the new size are
// gone, and growing adds zeros. The allocation is made to fit: a size that
// rounds to another allocation size gets new memory (the bytes that stay
// are copied), size 0 frees the memory. Refused with ErrBusy while s is
// leased. Permission is the caller's business (a file opened for writing
// may be truncated whatever its mode says now).
func (r *Registry) Resize(s *Segment, size int64) error {
	if err := r.checkEnd(s, size); err != nil {
		return err
	}
	s.io.Lock()
	defer s.io.Unlock()
	r.mu.Lock()
	if s.gone {
		r.mu.Unlock()
		return fmt.Errorf("%w: segment %d was removed", ErrNotFound, s.id)
	}
	cur, mem := s.size, s.mem
	want := r.roundSize(s.device, size)
	if size == cur && want == memSize(mem) {
		r.mu.Unlock()
		return nil
	}
	// Bytes past the new end go: so does any file's range there.
	r.forgetSourcesLocked(s, min(cur, size), 1<<62)
	_, _, err := r.resizableLocked(s)
	r.mu.Unlock()
	if err != nil {
		return err
	}
	if want != memSize(mem) {
		_, err := r.replace(s, mem, min(cur, size), size, size, true)
		return err
	}
	if size > cur {
		d, err := dataOf(mem)
		if err == nil {
			err = d.Zero(cur, size-cur)
		}
		if err != nil {
			return fmt.Errorf("zero %d bytes at %d of %q: %w", size-cur, cur, s.name, err)
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, _, err := r.resizableLocked(s); err != nil {
		return err
	}
	r.writtenLocked(s)
	s.size = size
	s.modified = time.Now()
	s.changes.Add(1)
	r.noteLocked(s, -1)
	return nil
}

// Reserve makes s's allocation at least capacity bytes without changing
// its size (fallocate with FALLOC_FL_KEEP_SIZE). Trim undoes it.
func (r *Registry) Reserve(s *Segment, capacity int64) error {
	if err := r.checkEnd(s, capacity); err != nil {
		return err
	}
	s.io.Lock()
	defer s.io.Unlock()
	r.mu.Lock()
	size, mem, err := r.resizableLocked(s)
	r.mu.Unlock()
	if err != nil || memSize(mem) >= capacity {
		return err
	}
	_, err = r.replace(s, mem, size, capacity, -1, true)
	return err
}

// Trim gives back the slack that growing writes and Reserve left: when s's
// allocation is larger than its size needs, and s is not leased, the bytes
// move to memory of the fitting size. Trimming a leased segment does
// nothing; the slack stays until the next Trim.
func (r *Registry) Trim(s *Segment) error {
	s.io.Lock()
	defer s.io.Unlock()
	r.mu.Lock()
	size, mem, err := r.resizableLocked(s)
	r.mu.Unlock()
	if err != nil || r.roundSize(s.device, size) >= memSize(mem) {
		return nil
	}
	_, err = r.replace(s, mem, size, size, size, false)
	return err
}

// Sync returns once every write to s so far has reached its memory.
func (r *Registry) Sync(s *Segment) error {
	s.io.RLock()
	defer s.io.RUnlock()
	r.mu.Lock()
	mem := s.mem
	r.mu.Unlock()
	if mem == nil {
		return nil
	}
	d, err := dataOf(mem)
	if err != nil {
		return err
	}
	return d.Sync()
}
