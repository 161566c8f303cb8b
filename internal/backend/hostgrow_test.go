package backend

import (
	"bytes"
	"errors"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/segment"
)

func seals(t *testing.T, fd int) int {
	t.Helper()
	s, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func fileSize(t *testing.T, fd int) (size, blocks int64) {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		t.Fatal(err)
	}
	return st.Size, st.Blocks
}

// TestHostGrowInPlace: host memory grows and shrinks in place, keeping its
// bytes and its descriptor, until FD hands the descriptor out: then it is
// committed and sealed, and Resize says ErrFixed.
func TestHostGrowInPlace(t *testing.T) {
	h, err := NewHost()
	if err != nil {
		t.Fatal(err)
	}
	mem, err := h.Allocate(0, 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Free()
	m := mem.(*hostMemory)
	d := mem.(segment.Data)
	head := bytes.Repeat([]byte{0x5a}, 4096)
	if err := d.WriteAt(head, 0); err != nil {
		t.Fatal(err)
	}
	if got := seals(t, m.fd); got&(unix.F_SEAL_GROW|unix.F_SEAL_SHRINK) != 0 {
		t.Fatalf("seals %#x before the descriptor left", got)
	}
	if err := m.Resize(64<<20+1, false); err != nil {
		t.Fatal(err)
	}
	size, blocks := fileSize(t, m.fd)
	if m.Size() != 64<<20+4096 || size != m.Size() {
		t.Fatalf("after growing: Size %d, file %d bytes", m.Size(), size)
	}
	if blocks*512 > 1<<20 {
		t.Fatalf("growing committed %d bytes; it should leave that to the writes", blocks*512)
	}
	tail := bytes.Repeat([]byte{0xa5}, 1<<20)
	if err := d.WriteAt(tail, 32<<20); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 64<<20)
	if err := d.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, 64<<20)
	copy(want, head)
	copy(want[32<<20:], tail)
	if !bytes.Equal(got, want) {
		t.Fatal("bytes after growing in place differ")
	}
	// Zeroing punches out whole pages.
	if err := d.Zero(32<<20+100, 1<<20-200); err != nil {
		t.Fatal(err)
	}
	if _, after := fileSize(t, m.fd); after*512 > 16<<10 {
		t.Fatalf("%d bytes still held after zeroing the only pages written", after*512)
	}
	b := make([]byte, 1<<20)
	if err := d.ReadAt(b, 32<<20); err != nil || !bytes.Equal(b[:100], tail[:100]) || !bytes.Equal(b[100:1<<20-100], make([]byte, 1<<20-200)) || !bytes.Equal(b[1<<20-100:], tail[:100]) {
		t.Fatalf("after zeroing: %v", err)
	}
	// Lent bytes are the memory's own, through a mapping made once the
	// memory is committed.
	lent, err := m.Lend(0, 4096)
	if err != nil || !bytes.Equal(lent, head) {
		t.Fatalf("Lend = %v", err)
	}
	if _, blocks := fileSize(t, m.fd); blocks*512 < 64<<20 {
		t.Fatalf("mapped with %d bytes committed of %d", blocks*512, 64<<20)
	}
	if err := m.Resize(8192, false); err != nil {
		t.Fatal(err)
	}
	if size, _ := fileSize(t, m.fd); size != 8192 || m.Size() != 8192 {
		t.Fatalf("after shrinking: file %d bytes, Size %d", size, m.Size())
	}
	// The journal's descriptor leaves the memory growable; a client's
	// does not.
	if fd, err := m.JournalFD(); err != nil || fd != m.fd || seals(t, fd)&unix.F_SEAL_GROW != 0 {
		t.Fatalf("JournalFD = %d, %v; sealed %#x", fd, err, seals(t, m.fd))
	}
	fd, err := m.FD()
	if err != nil {
		t.Fatal(err)
	}
	const want3 = unix.F_SEAL_GROW | unix.F_SEAL_SHRINK | unix.F_SEAL_SEAL
	if got := seals(t, fd); got&want3 != want3 {
		t.Fatalf("seals %#x once handed out", got)
	}
	if err := unix.Ftruncate(fd, 1<<20); !errors.Is(err, unix.EPERM) {
		t.Fatalf("ftruncate of a handed out memfd = %v, want EPERM", err)
	}
	if err := m.Resize(1<<20, false); !errors.Is(err, segment.ErrFixed) {
		t.Fatalf("Resize after FD = %v, want ErrFixed", err)
	}
	if err := d.ReadAt(b[:4096], 0); err != nil || !bytes.Equal(b[:4096], head) {
		t.Fatalf("read after sealing: %v", err)
	}
}

// TestHostRestoreGrowable: a memfd the journal kept before it was sealed
// comes back growable, at the record's size.
func TestHostRestoreGrowable(t *testing.T) {
	h, err := NewHost()
	if err != nil {
		t.Fatal(err)
	}
	mem, err := h.Allocate(0, 3*4096)
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Free()
	d := mem.(segment.Data)
	d.WriteAt([]byte("kept"), 0)
	fd, _ := mem.(segment.Journaled).JournalFD()
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	// Grown after the record was written, then the daemon died.
	if err := mem.(segment.Resizer).Resize(5*4096, false); err != nil {
		t.Fatal(err)
	}
	back, err := h.Restore(0, dup, 3*4096)
	if err != nil {
		unix.Close(dup)
		t.Fatal(err)
	}
	defer back.Free()
	if back.Size() != 3*4096 {
		t.Fatalf("restored Size %d", back.Size())
	}
	b := make([]byte, 4)
	if err := back.(segment.Data).ReadAt(b, 0); err != nil || string(b) != "kept" {
		t.Fatalf("restored bytes %q, %v", b, err)
	}
	if err := back.(segment.Resizer).Resize(8*4096, false); err != nil {
		t.Fatalf("restored growable memory: Resize = %v", err)
	}
	// A memfd sealed but for its size is not memory this daemon made.
	odd, err := unix.MemfdCreate("odd", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(odd)
	unix.Ftruncate(odd, 4096)
	if _, err := unix.FcntlInt(uintptr(odd), unix.F_ADD_SEALS, unix.F_SEAL_SEAL); err != nil {
		t.Fatal(err)
	}
	if m, err := h.Restore(0, odd, 4096); err == nil {
		m.Free()
		t.Fatal("restored a memfd whose size can neither change nor be sealed")
	}
}
