package xfer

import (
	"errors"
	"os"
	"strconv"
	"unsafe"

	"golang.org/x/sys/unix"
)

// openDirect opens f again, as a new open file description, with O_DIRECT
// (the flag is per description, and f's other readers want the page
// cache). It returns -1 when the file system refuses O_DIRECT (tmpfs before
// Linux 6.6, many FUSE and overlay mounts) or says it has no alignment for
// it, and the alignment to use otherwise.
//
// Only for files this process opened itself: the reopen checks permissions
// as this process (Options.Borrowed).
func openDirect(f *os.File) (fd int, align int64) {
	align, ok := directAlign(f)
	if !ok {
		return -1, 0
	}
	fd, err := unix.Open("/proc/self/fd/"+strconv.Itoa(int(f.Fd())), unix.O_RDONLY|unix.O_DIRECT|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, 0
	}
	return fd, align
}

// ownDirect says whether f's own open file description reads with
// O_DIRECT, and the alignment to read it with.
func ownDirect(f *os.File) (bool, int64) {
	fl, err := unix.FcntlInt(uintptr(fdOf(f)), unix.F_GETFL, 0)
	if err != nil || fl&unix.O_DIRECT == 0 {
		return false, 0
	}
	align, ok := directAlign(f)
	return ok, align
}

// directAlign returns the alignment of O_DIRECT reads of f, or false when
// its file system says it has none.
func directAlign(f *os.File) (int64, bool) {
	var sx unix.Statx_t
	align := int64(dioAlign)
	if unix.Statx(fdOf(f), "", unix.AT_EMPTY_PATH, unix.STATX_DIOALIGN, &sx) == nil && sx.Mask&unix.STATX_DIOALIGN != 0 {
		if sx.Dio_offset_align == 0 || sx.Dio_mem_align == 0 {
			return 0, false // the file system says: no O_DIRECT here
		}
		align = max(align, int64(sx.Dio_offset_align), int64(sx.Dio_mem_align))
	}
	return align, true
}

// preadDirect fills b from off, stopping at the end of the file (a read
// shorter than asked that is not a multiple of the alignment). It returns
// the bytes read.
func preadDirect(fd int, b []byte, off, align int64) (int64, error) {
	var got int64
	for got < int64(len(b)) {
		n, err := unix.Pread(fd, b[got:], off+got)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return got, err
		}
		if n == 0 {
			break
		}
		got += int64(n)
		if got%align != 0 {
			break
		}
	}
	return got, nil
}

func directUnsupported(err error) bool {
	return errors.Is(err, unix.EINVAL) || errors.Is(err, unix.EOPNOTSUPP)
}

// allocAligned returns page-aligned memory outside the Go heap, for O_DIRECT.
func allocAligned(n int) ([]byte, error) {
	return unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
}

func freeAligned(b []byte) { unix.Munmap(b) }

// newResidency asks cachestat(2) (Linux 6.5 and later), else mincore(2) over
// a mapping of the file. Either answers for pages only when the kernel lets
// this process know (mincore: for files it owns or may write); pages it will
// not vouch for count as absent, which costs speed, never correctness.
func newResidency(f *os.File, size int64) residency {
	if size == 0 {
		return nil
	}
	if c := (&cachestat{fd: int(f.Fd())}); c.ok() {
		return c
	}
	return newMincore(f, size)
}

func newMincore(f *os.File, size int64) residency {
	b, err := unix.Mmap(int(f.Fd()), 0, int(size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil
	}
	defer unix.Munmap(b)
	page := int64(os.Getpagesize())
	vec := make([]byte, (size+page-1)/page)
	if _, _, e := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), uintptr(unsafe.Pointer(&vec[0]))); e != 0 {
		return nil
	}
	return &mincore{vec: vec, page: page}
}

type cachestat struct{ fd int }

// struct cachestat_range and struct cachestat of linux/mman.h.
type cachestatRange struct{ off, len uint64 }
type cachestatResult struct {
	cache, dirty, writeback, evicted, recentlyEvicted uint64
}

func (c *cachestat) pages(off, n int64) (uint64, bool) {
	r := cachestatRange{uint64(off), uint64(n)}
	var out cachestatResult
	_, _, e := unix.Syscall6(unix.SYS_CACHESTAT, uintptr(c.fd), uintptr(unsafe.Pointer(&r)), uintptr(unsafe.Pointer(&out)), 0, 0, 0)
	return out.cache, e == 0
}

func (c *cachestat) ok() bool {
	_, ok := c.pages(0, 1)
	return ok
}

// cached counts a chunk as cached when most of its pages are: a read through
// the cache then fetches the rest with readahead.
func (c *cachestat) cached(off, n int64) bool {
	got, ok := c.pages(off, n)
	page := int64(os.Getpagesize())
	return ok && int64(got)*2 >= (n+page-1)/page
}

func (c *cachestat) close() {}

type mincore struct {
	vec  []byte
	page int64
}

func (m *mincore) cached(off, n int64) bool {
	lo, hi := off/m.page, min((off+n+m.page-1)/m.page, int64(len(m.vec)))
	var in int64
	for _, v := range m.vec[lo:hi] {
		in += int64(v & 1)
	}
	return in*2 >= hi-lo
}

func (m *mincore) close() {}

// allocateAhead makes the pages of [lo, hi) of f, a file on tmpfs, in
// pieces, ahead of the copiers that write them, until done closes. On tmpfs
// a write must first make and zero each 4 KiB page, which bounds a store
// into a new file (about 3 GB/s, the same as cp's); fallocate makes them
// in bulk and faster, and the copiers' writes then only copy. Measured on an
// H200 machine, 2026-11-26, `gpushm bench files --sizes 4GiB,16GiB`: get
// into /dev/shm 3.02 and 3.21 GB/s before, 3.51 and 3.73 GB/s with it.
// Other file systems allocate without zeroing, and are left alone. The
// pages are the file's, as the writes would have made them: a copy that
// fails leaves the file as long as writes up to its end would have.
func allocateAhead(f *os.File, lo, hi int64, done <-chan struct{}) {
	var fs unix.Statfs_t
	fd := fdOf(f)
	if fd < 0 || unix.Fstatfs(fd, &fs) != nil || fs.Type != unix.TMPFS_MAGIC {
		return
	}
	const piece = 256 << 20
	for off := lo; off < hi; off += piece {
		select {
		case <-done:
			return
		default:
		}
		if unix.Fallocate(fd, 0, off, min(piece, hi-off)) != nil {
			return // out of room, say: the writes will say so
		}
	}
}
