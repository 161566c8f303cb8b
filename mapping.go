package gpushm

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/cuda"
	"github.com/gpushm/gpushm/internal/wire"
)

// Mapping is a segment mapped into this process: host memory as a []byte,
// cuda memory as a device pointer in this process's address space.
type Mapping struct {
	size     int64 // the segment's size, as asked at creation
	alloc    int64 // the mapped length
	reserved int64 // the address range's length: alloc at the first map
	readOnly bool
	// released: the memory was given back (Segment.Release), the address
	// range is kept, and reading or writing it faults.
	released bool
	// owner is the lease this mapping goes with (Release, Reacquire and
	// Refresh act on it).
	owner lease

	host []byte // memfd segments

	dev    *cuda.Device // cuda segments
	ptr    uint64
	handle cuda.Handle
}

// Bytes is a host segment's memory (nil for a cuda segment, and while
// released: a slice taken before faults then, as a device pointer does).
func (m *Mapping) Bytes() []byte {
	if m.host == nil || m.released {
		return nil
	}
	return m.host[:m.size]
}

// DevicePtr is a cuda segment's device address in this process (0 for a
// host segment).
func (m *Mapping) DevicePtr() uint64 { return m.ptr }

// OnDevice reports whether the memory is GPU memory.
func (m *Mapping) OnDevice() bool { return m.dev != nil }

// Device is the GPU ordinal of a cuda mapping, -1 for host memory.
func (m *Mapping) Device() int {
	if m.dev == nil {
		return -1
	}
	return m.dev.Ordinal()
}

// Size is the segment's size.
func (m *Mapping) Size() int64 { return m.size }

// ReadOnly reports whether the mapping refuses writes.
func (m *Mapping) ReadOnly() bool { return m.readOnly }

// Released reports whether the mapping's memory was given back
// (Segment.Release): its addresses are kept, and touching them faults.
func (m *Mapping) Released() bool { return m.released }

// lease is what a Mapping needs of the lease it goes with (a Segment's
// shared), so that Release, Reacquire and Refresh on the mapping act on the
// segment (remap.go). Declared here, the mapping knows nothing more of it.
type lease interface {
	release(ctx context.Context) error
	remapTo(ctx context.Context, anyVersion bool) (changed bool, err error)
}

var errReleased = errors.New("gpushm: the mapping's memory was released (reacquire the segment to map it again)")

// ReadAt copies from the segment into p (a device-to-host copy on cuda).
func (m *Mapping) ReadAt(p []byte, off int64) (int, error) {
	if m.released {
		return 0, errReleased
	}
	if off < 0 || off > m.size {
		return 0, fmt.Errorf("gpushm: read at %d: %w", off, errOffset)
	}
	n := min(int64(len(p)), m.size-off)
	if m.host != nil {
		copy(p[:n], m.host[off:])
	} else if n > 0 {
		if err := m.dev.CopyDtoH(p[:n], m.ptr+uint64(off)); err != nil {
			return 0, fmt.Errorf("gpushm: read: %w", err)
		}
	}
	if n < int64(len(p)) {
		return int(n), io.EOF
	}
	return int(n), nil
}

// WriteAt copies p into the segment (a host-to-device copy on cuda).
func (m *Mapping) WriteAt(p []byte, off int64) (int, error) {
	if m.readOnly {
		return 0, errors.New("gpushm: write to a read-only mapping")
	}
	if m.released {
		return 0, errReleased
	}
	if off < 0 || off+int64(len(p)) > m.size {
		return 0, fmt.Errorf("gpushm: write of %d bytes at %d: %w", len(p), off, errOffset)
	}
	if m.host != nil {
		copy(m.host[off:], p)
	} else if len(p) > 0 {
		if err := m.dev.CopyHtoD(m.ptr+uint64(off), p); err != nil {
			return 0, fmt.Errorf("gpushm: write: %w", err)
		}
	}
	return len(p), nil
}

var errOffset = errors.New("outside the segment")

func mapSegment(fd int, info *wire.Segment, readOnly bool, devices []int) (*Mapping, error) {
	m := &Mapping{size: info.Size, alloc: info.AllocSize, reserved: info.AllocSize, readOnly: readOnly}
	switch info.HandleType {
	case wire.HandleMemfd:
		prot := unix.PROT_READ
		if !readOnly {
			prot |= unix.PROT_WRITE
		}
		b, err := unix.Mmap(fd, 0, int(info.AllocSize), prot, unix.MAP_SHARED)
		if err != nil {
			return nil, fmt.Errorf("mmap: %w", err)
		}
		m.host = b
	case wire.HandleCUDA:
		dev, err := homeDevice(info)
		if err != nil {
			return nil, err
		}
		access, err := accessList(dev, devices)
		if err != nil {
			return nil, err
		}
		h, err := dev.ImportFD(fd)
		if err != nil {
			return nil, err
		}
		ptr, err := reserve(dev, info.AllocSize)
		if err != nil {
			dev.Release(h)
			return nil, err
		}
		if err := dev.MapAt(ptr, h, info.AllocSize, readOnly, access...); err != nil {
			unreserve(dev, ptr, info.AllocSize)
			dev.Release(h)
			return nil, err
		}
		// The handle is released with the mapping, not now: one driver
		// call fewer on the open path.
		m.dev, m.ptr, m.handle = dev, ptr, h
	default:
		return nil, fmt.Errorf("unknown handle type %q", info.HandleType)
	}
	return m, nil
}

// homeDevice is the GPU that holds a cuda segment, as this process numbers
// it: the daemon names it by UUID, since a process in a container or under
// CUDA_VISIBLE_DEVICES numbers the node's GPUs its own way. A daemon that
// sends no UUID is taken to number them as this process does.
func homeDevice(info *wire.Segment) (*cuda.Device, error) {
	ord := info.Device
	if info.UUID != "" {
		var err error
		if ord, err = cuda.OrdinalOf(info.UUID); err != nil {
			return nil, fmt.Errorf("segment %q lives on GPU %s (the daemon's device %d): %w", info.Name, info.UUID, info.Device, err)
		}
	}
	return cuda.GetDevice(ord)
}

// accessList resolves the GPUs that will touch memory on home, checking
// that each can reach it.
func accessList(home *cuda.Device, devices []int) ([]*cuda.Device, error) {
	if len(devices) == 0 {
		return []*cuda.Device{home}, nil
	}
	out := make([]*cuda.Device, 0, len(devices))
	for _, i := range devices {
		d, err := cuda.GetDevice(i)
		if err != nil {
			return nil, fmt.Errorf("GPU %d: %w", i, err)
		}
		if i != home.Ordinal() {
			ok, err := d.CanAccessPeer(home)
			if err != nil {
				return nil, err
			}
			if !ok {
				return nil, fmt.Errorf("GPU %d cannot reach GPU %d's memory (no peer access between them)", i, home.Ordinal())
			}
		}
		out = append(out, d)
	}
	return out, nil
}

func (m *Mapping) unmap() error {
	if m.host != nil {
		err := unix.Munmap(m.host[:m.reserved])
		m.host = nil
		return err
	}
	if m.dev != nil {
		// The memory goes as in a release, which waits for the GPU's
		// work on it first; then the range.
		err := m.releaseMemory()
		if err == nil {
			unreserve(m.dev, m.ptr, m.reserved)
		}
		m.dev, m.ptr = nil, 0
		return err
	}
	return nil
}

// releaseMemory unmaps the memory and keeps the address range: a host
// range becomes inaccessible anonymous memory (MAP_FIXED over it, so that
// nothing else is mapped there), a cuda range stays reserved. Work the
// GPU still has queued on it is waited for first: cuMemUnmap does not,
// and a write from pageable memory returns before its DMA lands.
// Unmapping under either faults, and the fault poisons the process's
// context for every later call.
func (m *Mapping) releaseMemory() error {
	if m.released {
		return nil
	}
	if m.host != nil {
		_, err := unix.MmapPtr(-1, 0, unsafe.Pointer(unsafe.SliceData(m.host)), uintptr(m.reserved),
			unix.PROT_NONE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_FIXED|unix.MAP_NORESERVE)
		if err != nil {
			return fmt.Errorf("mmap over the released range: %w", err)
		}
		m.released = true
		return nil
	}
	if err := m.dev.Synchronize(); err != nil {
		return err
	}
	if err := m.dev.UnmapAt(m.ptr, m.alloc); err != nil {
		return err
	}
	err := m.dev.Release(m.handle)
	m.handle, m.released = 0, true
	return err
}

// remap maps the memory fd refers to (info describes it) at the range this
// mapping keeps, after releaseMemory: the same addresses as before, for
// the same segment or another version of its name that fits the range.
func (m *Mapping) remap(fd int, info *wire.Segment, devices []int) error {
	if !m.released {
		return errors.New("remap of memory still mapped")
	}
	if info.AllocSize > m.reserved {
		return fmt.Errorf("it needs %d bytes of addresses, and this mapping keeps %d: %w", info.AllocSize, m.reserved, syscall.EFBIG)
	}
	if m.host != nil {
		if info.HandleType != wire.HandleMemfd {
			return fmt.Errorf("handle type %q in place of host memory: %w", info.HandleType, syscall.EINVAL)
		}
		prot := unix.PROT_READ
		if !m.readOnly {
			prot |= unix.PROT_WRITE
		}
		_, err := unix.MmapPtr(fd, 0, unsafe.Pointer(unsafe.SliceData(m.host)), uintptr(info.AllocSize),
			prot, unix.MAP_SHARED|unix.MAP_FIXED)
		if err != nil {
			return fmt.Errorf("mmap at the kept range: %w", err)
		}
	} else {
		if info.HandleType != wire.HandleCUDA {
			return fmt.Errorf("handle type %q in place of GPU memory: %w", info.HandleType, syscall.EINVAL)
		}
		dev, err := homeDevice(info)
		if err != nil {
			return err
		}
		if dev.Ordinal() != m.dev.Ordinal() {
			return fmt.Errorf("it lives on GPU %d, this mapping's range on GPU %d: %w", dev.Ordinal(), m.dev.Ordinal(), syscall.EXDEV)
		}
		access, err := accessList(dev, devices)
		if err != nil {
			return err
		}
		h, err := dev.ImportFD(fd)
		if err != nil {
			return err
		}
		if err := dev.MapAt(m.ptr, h, info.AllocSize, m.readOnly, access...); err != nil {
			dev.Release(h)
			return err
		}
		m.handle = h
	}
	m.size, m.alloc, m.released = info.Size, info.AllocSize, false
	return nil
}

// Address ranges of unmapped cuda segments are kept for the next mapping of
// the same size on the same device: a process that opens and closes
// segments of a few sizes again and again (tensors handed over per request)
// then skips cuMemAddressReserve and cuMemAddressFree. A range holds no
// memory, only address space, and at most vaCacheMax are kept.
const vaCacheMax = 64

type vaKey struct {
	dev  int
	size int64
}

var vaCache struct {
	sync.Mutex
	free map[vaKey][]uint64
	n    int
}

func reserve(dev *cuda.Device, size int64) (uint64, error) {
	k := vaKey{dev.Ordinal(), size}
	vaCache.Lock()
	if l := vaCache.free[k]; len(l) > 0 {
		ptr := l[len(l)-1]
		vaCache.free[k] = l[:len(l)-1]
		vaCache.n--
		vaCache.Unlock()
		return ptr, nil
	}
	vaCache.Unlock()
	return dev.Reserve(size)
}

func unreserve(dev *cuda.Device, ptr uint64, size int64) {
	k := vaKey{dev.Ordinal(), size}
	vaCache.Lock()
	if vaCache.n < vaCacheMax {
		if vaCache.free == nil {
			vaCache.free = make(map[vaKey][]uint64)
		}
		vaCache.free[k] = append(vaCache.free[k], ptr)
		vaCache.n++
		vaCache.Unlock()
		return
	}
	vaCache.Unlock()
	dev.Free(ptr, size)
}
