package backend

import (
	"fmt"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/segment"
)

// Adopt takes memory another process allocated and exported (fd), size
// bytes on device, as a segment's memory: the daemon then holds it, so the
// memory outlives its publisher. On success the Memory owns fd; on failure
// the caller still does.
//
// The descriptor is checked, not trusted: it must be a CUDA VMM export of
// device memory on that device, at least size bytes long (mapping it once
// proves it).
func (c *CUDA) Adopt(device int, fd int, size int64) (segment.Memory, error) {
	d, err := c.device(device)
	if err != nil {
		return nil, err
	}
	if size <= 0 || size%d.gran != 0 {
		return nil, fmt.Errorf("publish: size %d is not a positive multiple of GPU %d's granularity %d: %w", size, device, d.gran, syscall.EINVAL)
	}
	h, err := d.d.ImportFD(fd)
	if err != nil {
		return nil, fmt.Errorf("publish: not a CUDA VMM allocation (%v): %w", err, syscall.EINVAL)
	}
	fail := func(err error) (segment.Memory, error) {
		d.d.Release(h)
		return nil, err
	}
	// The handle types of an imported handle read as none on driver 580;
	// that the import through a POSIX fd worked is the proof needed.
	on, _, err := d.d.HandleDevice(h)
	if err != nil {
		return fail(fmt.Errorf("publish: %v: %w", err, syscall.EINVAL))
	}
	if on != device {
		return fail(fmt.Errorf("publish: the allocation is on GPU %d, not GPU %d: %w", on, device, syscall.EINVAL))
	}
	ptr, err := d.d.Map(h, size, true, d.d)
	if err != nil {
		return fail(fmt.Errorf("publish: cannot map %d bytes of it (%v): %w", size, err, syscall.EINVAL))
	}
	if err := d.d.Unmap(ptr, size); err != nil {
		return fail(err)
	}
	done := make(chan struct{})
	close(done)
	return &cudaMemory{d: d.d, h: h, size: size, fd: fd, done: done}, nil
}

// Adopt takes a memfd of at least size bytes as a segment's memory, sealing
// its size so that its publisher cannot shrink it under other mappings.
// Like every host segment's, its allocation is size rounded up to a page:
// a shorter file grows to it (with zeros) before it is sealed.
func (h *Host) Adopt(device int, fd int, size int64) (segment.Memory, error) {
	if _, err := h.Capacity(device); err != nil {
		return nil, err
	}
	if size <= 0 {
		return nil, fmt.Errorf("publish: size %d (must be positive): %w", size, syscall.EINVAL)
	}
	g := h.Granularity()
	alloc := (size + g - 1) / g * g
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("publish: fstat: %w", err)
	}
	if st.Size < size {
		return nil, fmt.Errorf("publish: the file has %d bytes, %d asked: %w", st.Size, size, syscall.EINVAL)
	}
	fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	if err != nil {
		return nil, fmt.Errorf("publish: fcntl: %w", err)
	}
	if fl&unix.O_PATH != 0 || fl&unix.O_ACCMODE != unix.O_RDWR {
		// The daemon writes through it (the FUSE view) and hands out
		// read-write opens of it: the publisher must have had both.
		return nil, fmt.Errorf("publish: the descriptor is not open for reading and writing: %w", syscall.EINVAL)
	}
	// Nothing is changed (grown, sealed, chmodded) before the descriptor
	// is known to be a memfd that takes seals: the daemon must not grow
	// another kind of file the client sent, with its own privileges.
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, fmt.Errorf("publish: the descriptor is not a memfd (mode %#o): %w", st.Mode&unix.S_IFMT, syscall.EINVAL)
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil || seals&unix.F_SEAL_SEAL != 0 {
		return nil, fmt.Errorf("publish: the descriptor is not a memfd that takes seals (one made with MFD_ALLOW_SEALING is needed): %w", syscall.EINVAL)
	}
	if st.Size < alloc {
		if err := unix.Ftruncate(fd, alloc); err != nil {
			return nil, fmt.Errorf("publish: the file has %d bytes and cannot grow to whole pages (%d): %v: %w", st.Size, alloc, err, syscall.EINVAL)
		}
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW); err != nil {
		return nil, fmt.Errorf("publish: cannot seal its size (a memfd made with MFD_ALLOW_SEALING is needed): %v: %w", err, syscall.EINVAL)
	}
	// Checked again once sealed: the publisher may have shrunk it since.
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("publish: fstat: %w", err)
	}
	if st.Size < alloc {
		return nil, fmt.Errorf("publish: the file shrank to %d bytes: %w", st.Size, syscall.EINVAL)
	}
	restrict(fd)
	return &hostMemory{fd: fd, size: alloc}, nil
}

// Restore takes back the descriptor of a segment this daemon made (or was
// published) before it restarted, alloc bytes on device. It checks what it
// can, since the descriptor comes from outside this process: a CUDA VMM
// export of memory on that device that maps alloc bytes. On success the
// Memory owns fd; on failure the caller still does.
func (c *CUDA) Restore(device int, fd int, alloc int64) (segment.Memory, error) {
	d, err := c.device(device)
	if err != nil {
		return nil, err
	}
	if alloc <= 0 || alloc%d.gran != 0 {
		return nil, fmt.Errorf("size %d is not a positive multiple of GPU %d's granularity %d", alloc, device, d.gran)
	}
	h, err := d.d.ImportFD(fd)
	if err != nil {
		return nil, fmt.Errorf("not a CUDA VMM allocation: %v", err)
	}
	fail := func(err error) (segment.Memory, error) {
		d.d.Release(h)
		return nil, err
	}
	on, _, err := d.d.HandleDevice(h)
	if err != nil {
		return fail(err)
	}
	if on != device {
		return fail(fmt.Errorf("the allocation is on GPU %d, not GPU %d", on, device))
	}
	ptr, err := d.d.Map(h, alloc, true, d.d)
	if err != nil {
		return fail(fmt.Errorf("cannot map %d bytes of it: %v", alloc, err))
	}
	if err := d.d.Unmap(ptr, alloc); err != nil {
		return fail(err)
	}
	done := make(chan struct{})
	close(done)
	return &cudaMemory{d: d.d, h: h, size: alloc, fd: fd, done: done}, nil
}

// Restore takes back a memfd of a segment this daemon made or was
// published before it restarted: a memfd sealed against shrinking and
// growing, of at least alloc bytes; or one not sealed yet, which only the
// daemon's processes ever held (its descriptor went to the journal, never
// to a client: hostgrow_linux.go), taken back growable and made alloc
// bytes again if a resize was cut short.
func (h *Host) Restore(device int, fd int, alloc int64) (segment.Memory, error) {
	if _, err := h.Capacity(device); err != nil {
		return nil, err
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return nil, fmt.Errorf("not a memfd (%v)", err)
	}
	const sized = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW
	growable := seals&(sized|unix.F_SEAL_SEAL) == 0
	if seals&sized != sized && !growable {
		return nil, fmt.Errorf("a memfd whose size is not sealed, and cannot be")
	}
	if alloc <= 0 {
		return nil, fmt.Errorf("size %d is not positive", alloc)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("fstat: %w", err)
	}
	switch {
	case growable && st.Size != alloc:
		if err := unix.Ftruncate(fd, alloc); err != nil {
			return nil, fmt.Errorf("the memfd has %d bytes, the record says %d: %v", st.Size, alloc, err)
		}
	case st.Size < alloc:
		return nil, fmt.Errorf("the memfd has %d bytes, the record says %d", st.Size, alloc)
	}
	restrict(fd) // made by an older daemon, perhaps
	return &hostMemory{fd: fd, size: alloc, growable: growable}, nil
}
