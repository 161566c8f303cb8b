package backend

import (
	"context"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/xfer"
)

// Spill memory in parts. An eviction that finds no memory made ahead
// (the reserve, memory kept for reuse) makes it, and the kernel makes the
// pages of one shmem file no faster than its lock lets it, however many
// threads write: on an H200 machine, 16 threads making 16 GiB wrote one
// memfd at 2.70 GB/s (pwrite) to 5.70 GB/s (fallocate), and a memfd each
// at 32.5 and 51.8 GB/s (docs/benchmarks.md). So a large eviction into new
// memory gets several memfds, written by the copy engine's pwrite on one
// thread each; every part is a segment's memory to the journal (a record
// of its own, which its segment's record names: segment.Parted).

const (
	// partMin is the smallest part, so that the descriptors an evicted
	// segment costs stay few: one per 256 MiB, at most maxParts.
	partMin  = 256 << 20
	maxParts = 16
)

// partsFor is how many parts new spill memory of size bytes gets.
func partsFor(size int64) int { return int(min(maxParts, max(1, size/partMin))) }

// partsMemory is spill memory made of several sealed memfds, in order.
// Its descriptor (FD) is the first part's. Nothing maps it: the copies
// and the FUSE view read and write it with pread and pwrite (fill and
// dump run on segments on their device only, which an open restores).
type partsMemory struct {
	parts []*hostMemory
	mems  []segment.Memory // parts, for Parts
	size  int64
	// settle, until the first copy into it ends, counts it among the
	// allocations making new memory (Spill.making).
	settle func()
}

var (
	_ segment.Data   = (*partsMemory)(nil)
	_ segment.Parted = (*partsMemory)(nil)
)

// makeParts makes n sealed memfds of size bytes in all, each a multiple of
// the page size. Their pages are made by the writes of the copy that
// fills them (ENOMEM there, not a SIGBUS: nothing maps them first).
func makeParts(size int64, n int) (*partsMemory, error) {
	g := int64(os.Getpagesize())
	each := (size/int64(n) + g - 1) / g * g
	m := &partsMemory{size: size}
	for off := int64(0); off < size; off += each {
		p, err := newMemfd("gpushm-spill", min(each, size-off), func(*hostMemory) error { return nil })
		if err != nil {
			m.Free()
			return nil, err
		}
		m.add(p)
	}
	return m, nil
}

// JoinParts is spill memory restored after a restart from its parts, in
// order (Host.Restore of each).
func JoinParts(parts []segment.Memory) (segment.Memory, error) {
	m := &partsMemory{}
	for i, p := range parts {
		h, ok := p.(*hostMemory)
		if !ok || h.growing() {
			return nil, fmt.Errorf("part %d of spill memory is not a sealed memfd", i)
		}
		m.add(h)
		m.size += h.size
	}
	if len(m.parts) == 0 {
		return nil, errors.New("spill memory of no parts")
	}
	return m, nil
}

// FD implements segment.Memory.
func (m *partsMemory) FD() (int, error) { return m.parts[0].FD() }

// Size implements segment.Memory.
func (m *partsMemory) Size() int64 { return m.size }

// Parts implements segment.Parted. The limits count them on every
// create: it does not allocate.
func (m *partsMemory) Parts() []segment.Memory { return m.mems }

// add appends p to m's parts.
func (m *partsMemory) add(p *hostMemory) {
	m.parts, m.mems = append(m.parts, p), append(m.mems, p)
}

// Free implements segment.Memory.
func (m *partsMemory) Free() error {
	m.settled()
	var errs []error
	for _, p := range m.parts {
		errs = append(errs, p.Free())
	}
	return errors.Join(errs...)
}

func (m *partsMemory) settled() {
	if m.settle != nil {
		m.settle()
	}
}

// each calls f for the parts that [off, off+n) covers, with the range
// within the part and where it starts in [off, off+n).
func (m *partsMemory) each(off, n int64, f func(p *hostMemory, off, n, at int64) error) error {
	if err := within(off, n, m.size); err != nil {
		return err
	}
	start := int64(0)
	for _, p := range m.parts {
		lo, hi := max(off, start), min(off+n, start+p.size)
		if lo < hi {
			if err := f(p, lo-start, hi-lo, lo-off); err != nil {
				return err
			}
		}
		start += p.size
	}
	return nil
}

// ReadAt implements segment.Data.
func (m *partsMemory) ReadAt(p []byte, off int64) error {
	return m.each(off, int64(len(p)), func(h *hostMemory, o, n, at int64) error { return h.pread(p[at:at+n], o) })
}

// WriteAt implements segment.Data.
func (m *partsMemory) WriteAt(p []byte, off int64) error {
	return m.each(off, int64(len(p)), func(h *hostMemory, o, n, at int64) error { return h.pwrite(p[at:at+n], o) })
}

// Zero implements segment.Data.
func (m *partsMemory) Zero(off, n int64) error {
	return m.each(off, n, func(h *hostMemory, o, n, _ int64) error { return h.pzero(o, n) })
}

// CopyFrom implements segment.Data: from a memfd.
func (m *partsMemory) CopyFrom(src segment.Memory, n int64) error {
	h, ok := src.(*hostMemory)
	if !ok {
		return fmt.Errorf("copy from %T to spill memory in parts", src)
	}
	b, err := h.span(0, n)
	if err != nil {
		return err
	}
	return m.WriteAt(b, 0)
}

// Sync implements segment.Data.
func (m *partsMemory) Sync() error { return nil }

// files are the parts as files, for the copy engine, with a descriptor of
// their own each (closed by close), so that the copy's files never close
// the memory's.
type partFiles []*os.File

func (m *partsMemory) files() (partFiles, error) {
	var fs partFiles
	for _, p := range m.parts {
		fd, err := unix.FcntlInt(uintptr(p.fd), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			fs.close()
			return nil, fmt.Errorf("dup: %w", err)
		}
		fs = append(fs, os.NewFile(uintptr(fd), "gpushm-spill"))
	}
	return fs, nil
}

func (fs partFiles) close() {
	for _, f := range fs {
		f.Close()
	}
}

// ranges lays the first n bytes of m over fs in chunks of chunk bytes,
// the parts taken in turn: the copy engine's workers take ranges in order,
// so each writes another part than its neighbours, and no part's lock is
// taken by more than a few of them at once.
func (m *partsMemory) ranges(fs partFiles, n, chunk int64) []xfer.Range {
	type cursor struct {
		f            *os.File
		off, end, at int64
	}
	var cs []cursor
	at := int64(0)
	for i, p := range m.parts {
		cs = append(cs, cursor{fs[i], 0, min(p.size, max(n-at, 0)), at})
		at += p.size
	}
	var rs []xfer.Range
	for more := true; more; {
		more = false
		for i := range cs {
			c := &cs[i]
			if c.off >= c.end {
				continue
			}
			l := min(chunk, c.end-c.off)
			rs = append(rs, xfer.Range{File: c.f, Off: c.off, Len: l, At: c.at + c.off})
			c.off += l
			more = true
		}
	}
	return rs
}

// moveParts copies n bytes between t and m: from m into t when in is
// true, from t into m otherwise, through the parts' files: pwrite makes
// their pages, a part a thread, and pread reads them back without mapping
// them. The first access to a page pwrite made costs, whichever way:
// on an H200 machine 60 GiB came back in 2.43 s through pread, and in
// 3.51 s with each part mapped on a thread of its own first
// (MADV_POPULATE_READ) and copied from the mappings; read once before,
// the same mapping took 0.30 s and the copy 1.30 s (TestPartsSpeed).
func moveParts(t xfer.Target, m *partsMemory, n int64, in bool) error {
	defer m.settled()
	fs, err := m.files()
	if err != nil {
		return err
	}
	defer fs.close()
	const chunk = 8 << 20
	o := &xfer.Options{Chunk: chunk, Direct: xfer.DirectNever}
	t.Size = n
	rs := m.ranges(fs, n, chunk)
	if in {
		_, err = xfer.Load(context.Background(), t, rs, o)
	} else {
		_, err = xfer.Store(context.Background(), t, rs, o)
	}
	return err
}
