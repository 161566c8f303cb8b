package segment

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"sync"
	"syscall"
	"testing"
	"time"
)

// dataAlloc is a fake allocator whose memory the registry can read and
// write: Go byte slices, rounded to 4 KiB, counted while live.
type dataAlloc struct {
	mu       sync.Mutex
	live     int
	bytes    int64
	allocs   int
	capacity int64
	failOver int64 // allocations larger than this fail with ENOMEM; 0: never
	// resizable makes memory that resizes in place until its FD is
	// taken, as host memory does; onResize, if set, runs in each Resize.
	resizable bool
	resizes   int
	onResize  func()
}

func newDataAlloc() *dataAlloc { return &dataAlloc{capacity: 1 << 30} }

func (f *dataAlloc) HandleType() string { return "fake" }

func (f *dataAlloc) Capacity(device int) (int64, error) {
	if device != 0 {
		return 0, fmt.Errorf("%w: %d", ErrNoDevice, device)
	}
	return f.capacity, nil
}

func (f *dataAlloc) RoundSize(_ int, size int64) int64 { return (size + 4095) / 4096 * 4096 }

func (f *dataAlloc) Allocate(device int, size int64) (Memory, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	alloc := f.RoundSize(device, size)
	if f.failOver > 0 && alloc > f.failOver {
		return nil, fmt.Errorf("fake: %w", syscall.ENOMEM)
	}
	f.live++
	f.bytes += alloc
	f.allocs++
	b := make([]byte, alloc)
	for i := range b {
		b[i] = 0xee // memory is not promised to be zero
	}
	return &dataMem{f: f, b: b, growable: f.resizable}, nil
}

func (f *dataAlloc) stats() (live int, bytes int64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.live, f.bytes
}

type dataMem struct {
	f        *dataAlloc
	mu       sync.Mutex // the fake's bytes are Go memory: the race detector watches them
	b        []byte
	freed    bool
	growable bool // Resize works until FD
}

var (
	_ Data    = (*dataMem)(nil)
	_ Resizer = (*dataMem)(nil)
	_ Lender  = (*dataMem)(nil)
)

// FD fixes the size, as a descriptor handed out does a memfd's.
func (m *dataMem) FD() (int, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.growable = false
	return 3, nil
}

func (m *dataMem) Size() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return int64(len(m.b))
}

// Resize keeps the bytes that stay; those it adds are zeros, and those a
// shrink loses come back as zeros.
func (m *dataMem) Resize(size int64, commit bool) error {
	if hook := m.f.onResize; hook != nil {
		hook()
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.check(0, 0)
	if !m.growable {
		return ErrFixed
	}
	size = m.f.RoundSize(0, size)
	b := make([]byte, size)
	copy(b, m.b)
	m.f.mu.Lock()
	m.f.bytes += size - int64(len(m.b))
	m.f.resizes++
	m.f.mu.Unlock()
	m.b = b
	return nil
}

func (m *dataMem) Lend(off, n int64) ([]byte, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.check(off, n)
	return m.b[off : off+n], nil
}
func (m *dataMem) Free() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.freed {
		panic("double free")
	}
	m.freed = true
	m.f.mu.Lock()
	m.f.live--
	m.f.bytes -= int64(len(m.b))
	m.f.mu.Unlock()
	return nil
}

func (m *dataMem) check(off, n int64) {
	if m.freed {
		panic("use after free")
	}
	if off < 0 || off+n > int64(len(m.b)) {
		panic(fmt.Sprintf("%d bytes at %d outside %d", n, off, len(m.b)))
	}
}

func (m *dataMem) ReadAt(p []byte, off int64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.check(off, int64(len(p)))
	copy(p, m.b[off:])
	return nil
}

func (m *dataMem) WriteAt(p []byte, off int64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.check(off, int64(len(p)))
	copy(m.b[off:], p)
	return nil
}

func (m *dataMem) Zero(off, n int64) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.check(off, n)
	clear(m.b[off : off+n])
	return nil
}

func (m *dataMem) CopyFrom(src Memory, n int64) error {
	s := src.(*dataMem)
	s.mu.Lock()
	defer s.mu.Unlock()
	m.mu.Lock()
	defer m.mu.Unlock()
	s.check(0, n)
	m.check(0, n)
	copy(m.b[:n], s.b[:n])
	return nil
}

func (m *dataMem) Sync() error { return nil }

func readAll(t *testing.T, r *Registry, s *Segment) []byte {
	t.Helper()
	inf := r.Info(s)
	b := make([]byte, inf.Size+10)
	n, err := r.ReadAt(s, b, 0)
	if err != io.EOF {
		t.Fatalf("ReadAt(whole) = %d, %v; want io.EOF at the end", n, err)
	}
	return b[:n]
}

func TestEmptySegment(t *testing.T) {
	f := newDataAlloc()
	r := New(f, nil)
	if _, _, err := r.Create(alice, CreateOptions{Name: "e"}); !errors.Is(err, ErrBadSize) {
		t.Fatalf("Create size 0 without AllowEmpty = %v, want ErrBadSize", err)
	}
	s, created, err := r.Create(alice, CreateOptions{Name: "e", AllowEmpty: true, Pin: true})
	if err != nil || !created {
		t.Fatalf("Create empty = %v, %v", created, err)
	}
	if inf := r.Info(s); inf.Size != 0 || inf.AllocSize != 0 || inf.Pins != 1 {
		t.Fatalf("Info = %+v", inf)
	}
	if live, _ := f.stats(); live != 0 {
		t.Fatalf("an empty segment allocated %d", live)
	}
	if l := r.List("", 0); len(l) != 1 || l[0].Name != "e" {
		t.Fatalf("List = %+v, want the empty segment", l)
	}
	if _, err := r.Acquire(alice, "e", true); !errors.Is(err, ErrEmpty) || !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("Acquire empty = %v, want ErrEmpty (EINVAL)", err)
	}
	if n, err := r.ReadAt(s, make([]byte, 4), 0); n != 0 || err != io.EOF {
		t.Fatalf("ReadAt empty = %d, %v", n, err)
	}
	if _, err := r.WriteAt(s, []byte("hello"), 0); err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, r, s); string(got) != "hello" {
		t.Fatalf("read back %q", got)
	}
	if _, err := r.Acquire(bob, "e", true); !errors.Is(err, ErrPermission) {
		t.Fatalf("Acquire by bob of mode 0600 = %v", err)
	}
	l, err := r.Acquire(alice, "e", true)
	if err != nil {
		t.Fatalf("Acquire after write = %v", err)
	}
	r.Release(l)
	if err := r.Resize(s, 0); err != nil {
		t.Fatal(err)
	}
	if live, _ := f.stats(); live != 0 {
		t.Fatalf("resize to 0 left %d allocations", live)
	}
	if err := r.Unlink(alice, "e"); err != nil {
		t.Fatal(err)
	}
	if err := r.Unpin(s); err != nil {
		t.Fatal(err)
	}
	if err := r.Pin(alice, s, Read); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Pin of a retired segment = %v", err)
	}
}

func TestResize(t *testing.T) {
	f := newDataAlloc()
	r := New(f, nil)
	s, _, err := r.Create(alice, CreateOptions{Name: "r", Size: 10, Pin: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.WriteAt(s, []byte("0123456789"), 0); err != nil {
		t.Fatal(err)
	}
	steps := []struct {
		size  int64
		want  []byte
		alloc int64
	}{
		{5, []byte("01234"), 4096},
		{8, []byte("01234\x00\x00\x00"), 4096}, // zeros, not the old bytes
		{5000, append([]byte("01234\x00\x00\x00"), make([]byte, 4992)...), 8192},
		{3, []byte("012"), 4096},
		{0, nil, 0},
		{2, []byte{0, 0}, 4096},
	}
	for _, st := range steps {
		if err := r.Resize(s, st.size); err != nil {
			t.Fatalf("Resize(%d) = %v", st.size, err)
		}
		if got := readAll(t, r, s); !bytes.Equal(got, st.want) {
			t.Fatalf("after Resize(%d): %q, want %q", st.size, got[:min(len(got), 20)], st.want[:min(len(st.want), 20)])
		}
		if inf := r.Info(s); inf.Size != st.size || inf.AllocSize != st.alloc {
			t.Fatalf("after Resize(%d): size %d alloc %d, want alloc %d", st.size, inf.Size, inf.AllocSize, st.alloc)
		}
	}
	if err := r.Resize(s, 1<<30+1); !errors.Is(err, syscall.EFBIG) {
		t.Fatalf("Resize past the device = %v, want EFBIG", err)
	}
	r.Unlink(alice, "r")
	r.Unpin(s)
	if live, _ := f.stats(); live != 0 {
		t.Fatalf("%d allocations live at the end", live)
	}
}

// TestGrowingWrites writes a file sequentially, as cp does: the allocation
// doubles, every byte is copied a bounded number of times, and Trim gives
// back the slack.
func TestGrowingWrites(t *testing.T) {
	f := newDataAlloc()
	r := New(f, nil)
	s, _, _ := r.Create(alice, CreateOptions{Name: "g", AllowEmpty: true, Pin: true})
	chunk := bytes.Repeat([]byte("abcdefgh"), 1024) // 8 KiB
	const n = 100
	for i := range n {
		if _, err := r.WriteAt(s, chunk, int64(i*len(chunk))); err != nil {
			t.Fatal(err)
		}
	}
	inf := r.Info(s)
	if inf.Size != n*8192 {
		t.Fatalf("size %d", inf.Size)
	}
	if f.allocs > 10 {
		t.Fatalf("%d allocations for 100 sequential writes; growth is not geometric", f.allocs)
	}
	if inf.AllocSize < inf.Size || inf.AllocSize > 2*inf.Size {
		t.Fatalf("alloc %d for size %d", inf.AllocSize, inf.Size)
	}
	if err := r.Trim(s); err != nil {
		t.Fatal(err)
	}
	if inf := r.Info(s); inf.AllocSize != n*8192 {
		t.Fatalf("after Trim: alloc %d", inf.AllocSize)
	}
	if got := readAll(t, r, s); !bytes.Equal(got, bytes.Repeat(chunk, n)) {
		t.Fatal("contents changed by growing")
	}
	// A write past the end leaves zeros in the gap, whatever the memory
	// held before.
	if _, err := r.WriteAt(s, []byte("z"), n*8192+100); err != nil {
		t.Fatal(err)
	}
	got := readAll(t, r, s)
	if len(got) != n*8192+101 || !bytes.Equal(got[n*8192:n*8192+100], make([]byte, 100)) || got[n*8192+100] != 'z' {
		t.Fatalf("gap not zero: %q", got[n*8192:])
	}
	// Out of memory for doubling, the write still fits in less.
	f.failOver = 2 << 20
	if _, err := r.WriteAt(s, chunk, 2<<20-8192); err != nil {
		t.Fatalf("write near the memory limit = %v", err)
	}
	if _, err := r.WriteAt(s, chunk, 4<<20); !errors.Is(err, syscall.ENOMEM) {
		t.Fatalf("write past the memory limit = %v, want ENOMEM", err)
	}
	if inf := r.Info(s); inf.Size != 2<<20 {
		t.Fatalf("a failed write changed the size to %d", inf.Size)
	}
}

func TestResizeBusyWhileLeased(t *testing.T) {
	r := New(newDataAlloc(), nil)
	s, _, _ := r.Create(alice, CreateOptions{Name: "b", Size: 100, Pin: true})
	l, err := r.Acquire(alice, "b", false)
	if err != nil {
		t.Fatal(err)
	}
	for name, op := range map[string]func() error{
		"Resize":  func() error { return r.Resize(s, 10) },
		"grow":    func() error { _, err := r.WriteAt(s, []byte("x"), 100); return err },
		"Reserve": func() error { return r.Reserve(s, 1<<20) },
	} {
		if err := op(); !errors.Is(err, ErrBusy) || !errors.Is(err, syscall.EBUSY) {
			t.Errorf("%s of a leased segment = %v, want EBUSY", name, err)
		}
	}
	// Writing within the size is fine: the lease holder sees it.
	if _, err := r.WriteAt(s, []byte("in place"), 0); err != nil {
		t.Fatal(err)
	}
	if err := r.Trim(s); err != nil {
		t.Fatalf("Trim of a leased segment = %v, want a silent no-op", err)
	}
	r.Release(l)
	if err := r.Resize(s, 10); err != nil {
		t.Fatalf("Resize after the lease ended = %v", err)
	}
}

func TestRename(t *testing.T) {
	f := newDataAlloc()
	changes := 0
	r := New(f, func() { changes++ })
	a, _, _ := r.Create(alice, CreateOptions{Name: "a", Size: 1})
	b, _, _ := r.Create(bob, CreateOptions{Name: "b", Size: 1})
	c, _, _ := r.Create(alice, CreateOptions{Name: "c", Size: 1})

	if err := r.Rename(bob, "a", "x", 0); !errors.Is(err, syscall.EPERM) {
		t.Fatalf("rename of another's segment = %v, want EPERM", err)
	}
	if err := r.Rename(alice, "a", "b", 0); !errors.Is(err, syscall.EPERM) {
		t.Fatalf("rename over another's segment = %v, want EPERM", err)
	}
	if err := r.Rename(alice, "a", "c", RenameNoReplace); !errors.Is(err, syscall.EEXIST) {
		t.Fatalf("rename NOREPLACE over c = %v, want EEXIST", err)
	}
	if err := r.Rename(alice, "a", "nope", RenameExchange); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("exchange with a missing name = %v, want ENOENT", err)
	}
	if err := r.Rename(alice, "a", "a", 0); err != nil || changes != 0 {
		t.Fatalf("rename to itself = %v (changes %d)", err, changes)
	}
	if err := r.Rename(alice, "a", "x", 0); err != nil {
		t.Fatal(err)
	}
	if changes != 1 {
		t.Fatalf("rename bumped changed %d times, want 1", changes)
	}
	if s, _, err := r.Lookup("x"); err != nil || s != a {
		t.Fatalf("Lookup(x) = %v, %v; want a", s, err)
	}
	if _, err := r.Stat("a"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Stat(a) after rename = %v", err)
	}
	// Replacing c frees it.
	if err := r.Rename(alice, "x", "c", 0); err != nil {
		t.Fatal(err)
	}
	if live, _ := f.stats(); live != 2 {
		t.Fatalf("%d live after renaming over c, want 2", live)
	}
	if inf, _ := r.Stat("c"); inf.ID != a.ID() {
		t.Fatalf("c is segment %d, want %d", inf.ID, a.ID())
	}
	if err := r.Rename(Root, "c", "b", RenameExchange); err != nil {
		t.Fatal(err)
	}
	if s, _, _ := r.Lookup("b"); s != a {
		t.Fatal("exchange did not swap")
	}
	if s, _, _ := r.Lookup("c"); s != b {
		t.Fatal("exchange did not swap")
	}
	_ = c
}

func TestModeOwnerMeta(t *testing.T) {
	changes := 0
	r := New(newDataAlloc(), func() { changes++ })
	s, _, _ := r.Create(alice, CreateOptions{Name: "m", Size: 1, Mode: 0o644, UseMode: true})
	tests := []struct {
		name string
		op   func() error
		want error
	}{
		{"chmod by owner", func() error { return r.SetMode(alice, s, 0o600) }, nil},
		{"chmod by other", func() error { return r.SetMode(bob, s, 0o666) }, syscall.EPERM},
		{"chmod setuid", func() error { return r.SetMode(alice, s, 0o4600) }, syscall.EINVAL},
		{"chown by owner", func() error { return r.SetOwner(alice, s, int64(bob.UID), -1) }, syscall.EPERM},
		{"chgrp to own group", func() error { return r.SetOwner(alice, s, -1, int64(alice.GID)) }, nil},
		{"chgrp to another group", func() error { return r.SetOwner(alice, s, -1, 4242) }, syscall.EPERM},
		{"chgrp by other", func() error { return r.SetOwner(eve, s, -1, int64(eve.GID)) }, syscall.EPERM},
		{"chown by root", func() error { return r.SetOwner(Root, s, int64(bob.UID), 77) }, nil},
		{"meta by old owner", func() error { return r.SetMeta(alice, s, []byte(`{}`)) }, syscall.EPERM},
		{"meta by owner", func() error { return r.SetMeta(bob, s, []byte(`{"dtype":"f16"}`)) }, nil},
		{"bad meta", func() error { return r.SetMeta(bob, s, []byte(`{`)) }, syscall.EINVAL},
		{"utimes by other", func() error { return r.SetTimes(eve, s, time.Unix(1, 0), false) }, syscall.EPERM},
		{"touch without write", func() error { return r.SetTimes(eve, s, time.Now(), true) }, syscall.EPERM},
		{"utimes by owner", func() error { return r.SetTimes(bob, s, time.Unix(1e9, 0), false) }, nil},
	}
	for _, tc := range tests {
		err := tc.op()
		if tc.want == nil && err != nil || tc.want != nil && !errors.Is(err, tc.want) {
			t.Errorf("%s = %v, want %v", tc.name, err, tc.want)
		}
	}
	inf := r.Info(s)
	if inf.Mode != 0o600 || inf.UID != bob.UID || inf.GID != 77 || string(inf.Meta) != `{"dtype":"f16"}` || inf.Modified.Unix() != 1e9 {
		t.Fatalf("Info = %+v", inf)
	}
	if changes != 2 { // chmod, and root's chown; the chgrp changed nothing
		t.Fatalf("changed bumped %d times, want 2", changes)
	}
	if err := r.Access(bob, s, Read|Write); err != nil {
		t.Fatalf("owner access = %v", err)
	}
	if err := r.Access(Root, s, Exec); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("root exec of mode 0600 = %v, want EACCES", err)
	}
}

// TestUnlinkWhilePinned: a pin keeps the memory of an unlinked segment, as
// an open file keeps an unlinked file's data; the last reference frees it.
func TestUnlinkWhilePinned(t *testing.T) {
	f := newDataAlloc()
	r := New(f, nil)
	s, _, _ := r.Create(alice, CreateOptions{Name: "u", Size: 5, Pin: true})
	r.WriteAt(s, []byte("bytes"), 0)
	l, _ := r.Acquire(alice, "u", true)
	if err := r.Unlink(alice, "u"); err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, r, s); string(got) != "bytes" {
		t.Fatalf("read after unlink: %q", got)
	}
	if inf := r.Info(s); inf.Linked {
		t.Fatal("still linked")
	}
	r.Unpin(s)
	if live, _ := f.stats(); live != 1 {
		t.Fatal("freed while leased")
	}
	r.Release(l)
	if live, _ := f.stats(); live != 0 {
		t.Fatal("not freed after the last reference")
	}
}

// TestConcurrentIO runs readers, in-place writers, growing writers, resizes,
// leases and renames on one segment at once: run it with -race. Each
// writer owns a stripe, so what it reads back must be what it wrote, unless
// a truncate cut the stripe off.
func TestConcurrentIO(t *testing.T) {
	r := New(newDataAlloc(), nil)
	s, _, _ := r.Create(alice, CreateOptions{Name: "c", Size: 64 << 10, Pin: true})
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for w := range 4 {
		wg.Go(func() {
			p := bytes.Repeat([]byte{byte('a' + w)}, 4096)
			got := make([]byte, 4096)
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				off := int64(w*4096 + (i%8)*4*4096)
				if _, err := r.WriteAt(s, p, off); err != nil && !errors.Is(err, ErrBusy) {
					t.Errorf("writer %d: %v", w, err)
					return
				}
				n, err := r.ReadAt(s, got, off)
				if err != nil && err != io.EOF {
					t.Errorf("reader %d: %v", w, err)
					return
				}
				for _, c := range got[:n] {
					if c != byte('a'+w) && c != 0 {
						t.Errorf("writer %d read %q back", w, c)
						return
					}
				}
			}
		})
	}
	wg.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			size := int64(64<<10 + (i%3)*100<<10)
			if err := r.Resize(s, size); err != nil && !errors.Is(err, ErrBusy) {
				t.Errorf("resize: %v", err)
				return
			}
			if i%5 == 0 {
				r.Trim(s)
			}
		}
	})
	wg.Go(func() {
		names := []string{"c", "d"}
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			if l, err := r.Acquire(alice, names[i%2], i%3 == 0); err == nil {
				r.Info(l)
				r.Release(l)
			}
			r.Rename(alice, names[i%2], names[(i+1)%2], 0)
		}
	})
	time.Sleep(300 * time.Millisecond)
	close(stop)
	wg.Wait()
}

// TestGrowInPlace: memory that resizes in place grows a file written
// sequentially without a new allocation, and shrinks to fit at Trim; once
// its descriptor went to a client, it is replaced as other memory is.
func TestGrowInPlace(t *testing.T) {
	f := newDataAlloc()
	f.resizable = true
	r := New(f, nil)
	s, _, _ := r.Create(alice, CreateOptions{Name: "g", AllowEmpty: true, Pin: true})
	chunk := bytes.Repeat([]byte("abcdefgh"), 1024) // 8 KiB
	const n = 100
	for i := range n {
		if _, err := r.WriteAt(s, chunk, int64(i*len(chunk))); err != nil {
			t.Fatal(err)
		}
	}
	if f.allocs != 1 || f.resizes == 0 || f.resizes > 10 {
		t.Fatalf("%d allocations and %d resizes for 100 sequential writes; want 1, and a few", f.allocs, f.resizes)
	}
	if err := r.Trim(s); err != nil {
		t.Fatal(err)
	}
	if inf := r.Info(s); inf.AllocSize != n*8192 || f.allocs != 1 {
		t.Fatalf("after Trim: alloc %d, %d allocations", inf.AllocSize, f.allocs)
	}
	want := bytes.Repeat(chunk, n)
	if got := readAll(t, r, s); !bytes.Equal(got, want) {
		t.Fatal("contents changed by growing")
	}
	// Bytes past a shrunk size read as zeros when it grows again, in
	// the allocation (the fake keeps them) and past it.
	if err := r.Resize(s, 100); err != nil {
		t.Fatal(err)
	}
	if err := r.Resize(s, 3*8192); err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, r, s); !bytes.Equal(got[:100], want[:100]) || !bytes.Equal(got[100:], make([]byte, 3*8192-100)) {
		t.Fatal("bytes past a shrunk size came back")
	}
	if _, err := r.WriteAt(s, []byte("z"), 5*8192); err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, r, s); !bytes.Equal(got[3*8192:5*8192], make([]byte, 2*8192)) || got[5*8192] != 'z' {
		t.Fatal("the gap of a write past the end is not zeros")
	}
	if f.allocs != 1 {
		t.Fatalf("%d allocations; resizes should have kept one", f.allocs)
	}
	// A client's descriptor fixes the size: growing replaces the memory.
	if _, err := r.Acquire(alice, "g", false); err != nil {
		t.Fatal(err)
	}
	if _, err := s.FD(); err != nil {
		t.Fatal(err)
	}
	r.Release(s)
	if _, err := r.WriteAt(s, chunk, 1<<20); err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, r, s); f.allocs != 2 || got[5*8192] != 'z' || !bytes.Equal(got[1<<20:], chunk) {
		t.Fatalf("growing fixed memory: %d allocations, or its bytes were lost", f.allocs)
	}
	r.Unpin(s)
	r.Unlink(alice, "g")
	if live, b := f.stats(); live != 0 || b != 0 {
		t.Fatalf("after unlink: %d allocations of %d bytes live", live, b)
	}
}

// TestResizeInPlaceHoldsOpens: an open waits while the size changes in
// place, so that the descriptor it hands out is never of a size about to
// change, and sees the new size.
func TestResizeInPlaceHoldsOpens(t *testing.T) {
	f := newDataAlloc()
	f.resizable = true
	r := New(f, nil)
	s, _, _ := r.Create(alice, CreateOptions{Name: "h", Size: 1 << 20, Pin: true})
	entered, release := make(chan struct{}), make(chan struct{})
	f.onResize = func() {
		close(entered)
		<-release
	}
	resized := make(chan error)
	go func() { resized <- r.Resize(s, 8192) }()
	<-entered
	opened := make(chan error)
	go func() {
		_, err := r.Acquire(alice, "h", false)
		opened <- err
	}()
	select {
	case err := <-opened:
		t.Fatalf("an open during a resize in place returned (%v) before it ended", err)
	case <-time.After(50 * time.Millisecond):
	}
	close(release)
	if err := <-resized; err != nil {
		t.Fatal(err)
	}
	if err := <-opened; err != nil {
		t.Fatal(err)
	}
	if inf := r.Info(s); inf.Size != 8192 || inf.AllocSize != 8192 {
		t.Fatalf("after: size %d, alloc %d", inf.Size, inf.AllocSize)
	}
}

// TestStamp: the stamp moves with every change the daemon makes and every
// lease taken, and nothing is quiet while a lease is held.
func TestStamp(t *testing.T) {
	r := New(newDataAlloc(), nil)
	s, _, _ := r.Create(alice, CreateOptions{Name: "st", Size: 8192, Pin: true})
	st, quiet := r.Stamp(s)
	if !quiet {
		t.Fatal("a segment nobody holds open is not quiet")
	}
	step := func(what string, wantQuiet bool, op func()) {
		t.Helper()
		op()
		now, q := r.Stamp(s)
		if now == st || q != wantQuiet {
			t.Fatalf("after %s: stamp %d (was %d), quiet %v; want a new stamp, quiet %v", what, now, st, q, wantQuiet)
		}
		st = now
	}
	step("a write", true, func() { r.WriteAt(s, []byte("x"), 0) })
	step("a growing write", true, func() { r.WriteAt(s, []byte("x"), 8192) })
	step("a resize", true, func() { r.Resize(s, 100) })
	step("an open", false, func() { r.Acquire(alice, "st", true) })
	if now, q := r.Stamp(s); now != st || q {
		t.Fatal("the stamp moved by itself")
	}
	r.Release(s)
	if _, q := r.Stamp(s); !q {
		t.Fatal("not quiet once the lease ended")
	}
	if now, _ := r.Stamp(s); now == 0 {
		t.Fatal("zero stamp")
	}
}

// TestLend: lent bytes are the segment's own, up to its size, and keep it
// from changing size until given back.
func TestLend(t *testing.T) {
	f := newDataAlloc()
	r := New(f, nil)
	s, _, _ := r.Create(alice, CreateOptions{Name: "l", AllowEmpty: true, Pin: true})
	if b, done, err := r.Lend(s, 0, 10); err != io.EOF || len(b) != 0 {
		t.Fatalf("Lend of an empty segment = %q, %v; want io.EOF", b, err)
	} else {
		done()
	}
	r.WriteAt(s, []byte("0123456789"), 0)
	b, done, err := r.Lend(s, 4, 100)
	if err != io.EOF || string(b) != "456789" {
		t.Fatalf("Lend past the end = %q, %v; want the rest and io.EOF", b, err)
	}
	resized := make(chan error)
	go func() { resized <- r.Resize(s, 3) }()
	select {
	case err := <-resized:
		t.Fatalf("resized (%v) while its bytes were lent", err)
	case <-time.After(50 * time.Millisecond):
	}
	done()
	if err := <-resized; err != nil {
		t.Fatal(err)
	}
	if _, _, err := r.Lend(s, -1, 1); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("Lend at -1 = %v", err)
	}
}
