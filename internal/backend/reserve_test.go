package backend

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/segment"
)

func TestReserveLayout(t *testing.T) {
	const mib = 1 << 20
	for _, tc := range []struct {
		total, align int64
		want         []int64
	}{
		{64 * mib, 2 * mib, []int64{50 * mib, 6 * mib, 4 * mib, 2 * mib, 2 * mib}},
		// A piece for a 16 GiB eviction, the next an eighth of it.
		{20 << 30, 2 * mib, []int64{16 << 30, 2 << 30, 1 << 30, 512 * mib, 256 * mib, 128 * mib, 128 * mib}},
		{5 * mib, 2 * mib, []int64{4 * mib}},
		{3 * mib, 2 * mib, []int64{2 * mib}},
		{1 * mib, 2 * mib, nil},
		{0, 2 * mib, nil},
		// 1 GiB huge pages: whole ones.
		{10 << 30, 1 << 30, []int64{8 << 30, 1 << 30, 1 << 30}},
	} {
		t.Run(fmt.Sprint(tc.total), func(t *testing.T) {
			got := reserveLayout(tc.total, tc.align)
			if !slices.Equal(got, tc.want) {
				t.Fatalf("reserveLayout(%d, %d) = %v, want %v", tc.total, tc.align, got, tc.want)
			}
		})
	}
	// Every size from a 256th of the reserve up to its largest piece finds
	// a piece at most reserveMaxWaste times it (but for a size within an
	// alignment of a piece's).
	for _, total := range []int64{64 * mib, 20 << 30, 175 << 30} {
		got := reserveLayout(total, 2*mib)
		for size := total / 256; size <= got[0]; size += total / 997 {
			if !slices.ContainsFunc(got, func(p int64) bool { return p >= size && p <= reserveMaxWaste*size+2*mib }) {
				t.Fatalf("reserveLayout(%d) = %v: no piece for %d bytes", total, got, size)
			}
		}
	}
	// Never more than ten pieces, and never more than asked.
	for total := int64(2 * mib); total < 1<<40; total = total*3 + 12345 {
		got := reserveLayout(total, 2*mib)
		var sum int64
		for _, s := range got {
			sum += s
		}
		if len(got) > 10 || sum > total || sum < total-2*mib {
			t.Fatalf("reserveLayout(%d) = %d pieces of %d bytes in all", total, len(got), sum)
		}
	}
}

func TestParseMeminfo(t *testing.T) {
	in := `MemTotal:       24684084 kB
MemFree:        20000000 kB
MemAvailable:   24056888 kB
HugePages_Total:      16
HugePages_Free:       10
HugePages_Rsvd:        2
HugePages_Surp:        0
Hugepagesize:       2048 kB
`
	got, err := parseMeminfo([]byte(in))
	want := meminfo{available: 24056888 << 10, hugeTotal: 16, hugeAvail: 8 * 2 << 20, hugePage: 2 << 20}
	if err != nil || got != want {
		t.Fatalf("parseMeminfo = %+v, %v; want %+v", got, err, want)
	}
	if _, err := parseMeminfo([]byte("MemTotal: 1 kB\n")); err == nil {
		t.Fatal("parseMeminfo without MemAvailable: no error")
	}
}

func TestTHPAllows(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want bool
	}{
		{"always within_size advise [never] deny force", false},
		{"always within_size advise never [deny] force", false},
		{"always within_size [advise] never deny force", true},
		{"always [within_size] advise never deny force", true},
		{"[always] within_size advise never deny force", true},
		{"always within_size advise never deny [force]\n", true},
		{"", false},
	} {
		if got := thpAllows(tc.in); got != tc.want {
			t.Errorf("thpAllows(%q) = %v, want %v", tc.in, got, tc.want)
		}
	}
}

// reserveFixture runs a Spill's reserve of total bytes, with the memory
// available what avail says, checked every few milliseconds.
type reserveFixture struct {
	s     *Spill
	avail atomic.Int64
	done  chan struct{}
	stop  context.CancelFunc
}

func startReserve(t *testing.T, total int64) *reserveFixture {
	t.Helper()
	return startReserveDemand(t, total, nil)
}

// startReserveDemand is startReserve with demand as SetDemand's function.
func startReserveDemand(t *testing.T, total int64, demand func() int64) *reserveFixture {
	t.Helper()
	host, err := NewHost()
	if err != nil {
		t.Fatal(err)
	}
	f := &reserveFixture{s: NewSpill(host, 0), done: make(chan struct{})}
	if demand != nil {
		f.s.SetDemand(demand)
	}
	f.avail.Store(1 << 50)
	f.s.every = 5 * time.Millisecond
	f.s.meminfo = func() (meminfo, error) {
		return meminfo{available: f.avail.Load(), hugePage: 2 << 20}, nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	f.stop = func() {
		cancel()
		select {
		case <-f.done:
		case <-time.After(10 * time.Second):
			t.Fatal("Reserve did not return once its context was done")
		}
	}
	go func() {
		defer close(f.done)
		f.s.Reserve(ctx, total, slog.New(slog.DiscardHandler))
	}()
	t.Cleanup(f.stop)
	return f
}

func (f *reserveFixture) waitFull(t *testing.T) {
	t.Helper()
	waitFor(t, "the reserve to fill", func() bool {
		r := f.s.Reserved()
		return r.Target > 0 && r.Bytes == r.Target
	})
}

// spillMemfds counts this process's descriptors of spill memory.
func spillMemfds(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		if l, _ := os.Readlink(filepath.Join("/proc/self/fd", e.Name())); strings.HasPrefix(l, "/memfd:gpushm-spill") {
			n++
		}
	}
	return n
}

// smaps is what /proc/self/smaps says of field (Rss, ShmemPmdMapped) of
// the mapping that starts at b, in bytes.
func smaps(t *testing.T, b []byte, field string) int64 {
	t.Helper()
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	start := strings.TrimPrefix(fmt.Sprintf("%p", &b[0]), "0x") + "-"
	in := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		l := sc.Text()
		if strings.HasPrefix(l, start) {
			in = true
			continue
		}
		if in && strings.HasPrefix(l, field+":") {
			kb, _ := strconv.ParseInt(strings.Fields(l)[1], 10, 64)
			return kb << 10
		}
	}
	t.Fatalf("no %s of a mapping at %s in /proc/self/smaps", field, start)
	return 0
}

// TestReserve: an eviction's memory comes from the reserve, its pages made
// and mapped, sealed, its tail given back; the reserve refills; a size it
// cannot serve makes its own memory.
func TestReserve(t *testing.T) {
	const mib = 1 << 20
	before := spillMemfds(t)
	f := startReserve(t, 64*mib)
	f.waitFull(t)
	if r := f.s.Reserved(); r.Target != 64*mib || r.Memfds != 5 || r.Takes != 0 {
		t.Fatalf("full reserve: %+v, want 64 MiB in 5 memfds (50, 6, 4, 2 and 2 MiB)", r)
	}
	// Its pages are made, and not mapped while they wait (piece).
	if n := reserveMapped(t, f.s); n > 0 {
		t.Fatalf("%d of the reserve's pieces are mapped while they wait", n)
	}

	// 7 MiB and a page: the 50 MiB piece (the 6 MiB one is too small).
	const size = 7*mib + 4096
	m, err := f.s.AllocateScratch(0, size, maxParts)
	if err != nil {
		t.Fatal(err)
	}
	if r := f.s.Reserved(); r.Takes != 1 || r.TakenBytes != size {
		t.Fatalf("after an eviction of %d bytes: %+v, want one take of it", size, r)
	}
	hm := m.(*hostMemory)
	if m.Size() != size {
		t.Fatalf("Size() = %d, want %d", m.Size(), size)
	}
	seals, err := unix.FcntlInt(uintptr(hm.fd), unix.F_GET_SEALS, 0)
	want := unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL
	if err != nil || seals&want != want {
		t.Fatalf("seals %#x, %v; want %#x", seals, err, want)
	}
	b, err := hm.bytes()
	if err != nil || len(b) != size {
		t.Fatalf("bytes() = %d bytes, %v; want %d", len(b), err, size)
	}
	if got := smaps(t, hm.view.b, "Rss"); got < size {
		t.Fatalf("%d bytes of the mapping resident, want its pages made (%d)", got, size)
	}
	if shmemTHP() {
		if got := smaps(t, hm.view.b, "ShmemPmdMapped"); got < 4*mib {
			t.Fatalf("shmem may have transparent huge pages, but %d bytes of the mapping are mapped huge", got)
		}
	} else {
		t.Log("shmem has no transparent huge pages here: their use is not tested")
	}
	// The piece's tail is punched out in the background: its pages go
	// (but for the rest of a huge page it ends in), its size stays
	// (sealed).
	waitFor(t, "the tail to be given back", func() bool {
		var st unix.Stat_t
		unix.Fstat(hm.fd, &st)
		return st.Size == 50*mib && st.Blocks*512 >= size && st.Blocks*512 <= 8*mib
	})
	want2 := bytes.Repeat([]byte("evicted!"), size/8)
	if err := hm.WriteAt(want2, 0); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, size)
	if err := hm.ReadAt(got, 0); err != nil || !bytes.Equal(got, want2) {
		t.Fatalf("read back: equal %v, %v", bytes.Equal(got, want2), err)
	}
	// Moved into, as an eviction does.
	host, _ := NewHost()
	src, err := host.Allocate(0, size)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Free()
	src.(segment.Data).WriteAt([]byte("from the device"), 0)
	if err := host.Move(m, src, size); err != nil {
		t.Fatal(err)
	}
	if hm.ReadAt(got[:15], 0); string(got[:15]) != "from the device" {
		t.Fatalf("after the move: %q", got[:15])
	}

	// The reserve makes the piece again.
	f.waitFull(t)
	if err := m.Free(); err != nil {
		t.Fatal(err)
	}

	// Too large for any piece (50 MiB at most), too small for any (a
	// piece at most 8 times its size): new memory.
	for _, n := range []int64{51 * mib, 64 << 10} {
		m, err := f.s.AllocateScratch(0, n, maxParts)
		if err != nil {
			t.Fatal(err)
		}
		if r := f.s.Reserved(); r.Takes != 1 || r.Bytes != r.Target {
			t.Fatalf("after an allocation of %d bytes: %+v, want the reserve untouched", n, r)
		}
		m.Free()
	}
	// Allocate (zeroed memory, an evicted segment that grows) takes from
	// it too: a piece never written is zeros.
	z, err := f.s.Allocate(0, 2*mib)
	if err != nil {
		t.Fatal(err)
	}
	zb := make([]byte, 2*mib)
	z.(segment.Data).ReadAt(zb, 0)
	if r := f.s.Reserved(); r.Takes != 2 || !bytes.Equal(zb, make([]byte, 2*mib)) {
		t.Fatalf("Allocate: %+v, zeros %v; want a second take, zeros", r, bytes.Equal(zb, make([]byte, 2*mib)))
	}
	z.Free()

	f.stop()
	if r := f.s.Reserved(); r != (segment.Reserve{}) {
		t.Fatalf("after Reserve returned: %+v", r)
	}
	if n := spillMemfds(t); n != before {
		t.Fatalf("%d spill memfds open after Reserve returned, %d before", n, before)
	}
}

// TestReserveOnDemand: a segment larger than the layout's largest piece
// has the reserve make a piece its size, which its eviction takes; a
// demand the layout serves, or none, frees it.
func TestReserveOnDemand(t *testing.T) {
	const mib = 1 << 20
	before := spillMemfds(t)
	var want atomic.Int64
	f := startReserveDemand(t, 64*mib, want.Load)
	f.waitFull(t)
	if r := f.s.Reserved(); r.Target != 64*mib || r.Memfds != 5 {
		t.Fatalf("no demand: %+v, want the layout alone (64 MiB in 5 memfds)", r)
	}
	// 100 MiB and a byte: a piece of 102 MiB (whole huge pages), but not
	// while an eviction makes new memory.
	const big = 100*mib + 1
	f.s.making.Add(1)
	want.Store(big)
	time.Sleep(40 * f.s.every)
	if r := f.s.Reserved(); r.Bytes != 64*mib {
		t.Fatalf("while an eviction makes new memory: %+v, want no piece made", r)
	}
	f.s.making.Add(-1)
	waitFor(t, "the piece on demand", func() bool {
		r := f.s.Reserved()
		return r.Target == 166*mib && r.Bytes == r.Target && r.Memfds == 6
	})
	m, err := f.s.AllocateScratch(0, big, maxParts)
	if err != nil {
		t.Fatal(err)
	}
	if r := f.s.Reserved(); r.Takes != 1 || r.Bytes != 64*mib {
		t.Fatalf("after the eviction of %d bytes: %+v, want it served by the piece on demand", int64(big), r)
	}
	m.Free()
	// Still asked for (the next large segment): made again.
	waitFor(t, "the piece on demand, again", func() bool { return f.s.Reserved().Bytes == 166*mib })
	// A demand the layout's 50 MiB piece serves: the piece goes.
	want.Store(30 * mib)
	waitFor(t, "the piece on demand to go", func() bool {
		r := f.s.Reserved()
		return r.Target == 64*mib && r.Bytes == 64*mib && r.Memfds == 5
	})
	// Its memfd is closed once its pages are punched out, just after.
	waitFor(t, "the layout's 5 spill memfds alone", func() bool { return spillMemfds(t)-before == 5 })
	// A smaller demand that the piece still serves keeps it.
	want.Store(big)
	waitFor(t, "the piece on demand, again", func() bool { return f.s.Reserved().Bytes == 166*mib })
	want.Store(90 * mib)
	time.Sleep(20 * f.s.every)
	if r := f.s.Reserved(); r.Target != 166*mib || r.Bytes != 166*mib {
		t.Fatalf("a demand of 90 MiB with a piece of 102: %+v, want the piece kept", r)
	}
	// An eviction while the piece it would take is being made waits for
	// it, rather than make memory beside it; and the piece is made while
	// it waits, though another eviction makes new memory (which pauses
	// the reserve's makers otherwise).
	const huge = 2*partMin - 2*mib // one memfd: an eviction in parts waits for no piece
	f.s.making.Add(1)
	defer f.s.making.Add(-1)
	want.Store(huge)
	f.s.waitRate = 1 // however slowly a busy machine makes it
	r := f.s.res.Load()
	waitFor(t, "the piece on demand being made", func() bool {
		r.mu.Lock()
		defer r.mu.Unlock()
		return r.making == len(r.sizes)-1 && r.sizes[r.making] == huge
	})
	taken := f.s.Reserved().TakenBytes
	m, err = f.s.AllocateScratch(0, huge, maxParts)
	if err != nil {
		t.Fatal(err)
	}
	if r := f.s.Reserved(); r.Takes != 2 || r.TakenBytes-taken != huge {
		t.Fatalf("an eviction of %d bytes while its piece was being made: %+v, want it served by that piece", int64(huge), r)
	}
	m.Free()
	f.stop()
	if n := spillMemfds(t); n != before {
		t.Fatalf("%d spill memfds open after Reserve returned, %d before", n, before)
	}
}

// TestReserveDemandSteady: a piece on demand is made only for a demand
// that held demandSteady intervals, and not within demandRest of freeing
// one, so that segments made and removed in a loop do not keep the
// daemon making and freeing memory.
func TestReserveDemandSteady(t *testing.T) {
	host, err := NewHost()
	if err != nil {
		t.Fatal(err)
	}
	s := NewSpill(host, 0)
	var want atomic.Int64
	s.SetDemand(want.Load)
	r := &reserve{sizes: []int64{50 << 20, 0}, pieces: make([]*piece, 2), align: 2 << 20, making: -1}
	log := slog.New(slog.DiscardHandler)
	grow := func() int64 {
		s.grow(r, log)
		return r.sizes[1]
	}
	want.Store(100 << 20)
	if got := grow(); got != 0 {
		t.Fatalf("a demand seen once: a piece of %d, want none yet", got)
	}
	r.pendingSince = time.Now().Add(-demandSteady * s.every)
	if got := grow(); got != 100<<20 {
		t.Fatalf("a demand that held: a piece of %d, want 100 MiB", got)
	}
	r.pieces[1] = &piece{fd: -1, n: 100 << 20}
	want.Store(0)
	if got := grow(); got != 0 || r.pieces[1] != nil {
		t.Fatalf("no demand: a piece of %d (%v), want it freed", got, r.pieces[1])
	}
	want.Store(200 << 20)
	grow()
	r.pendingSince = time.Now().Add(-demandSteady * s.every)
	if got := grow(); got != 0 {
		t.Fatalf("a demand that held, just after a piece was freed: a piece of %d, want none yet", got)
	}
	r.freed = time.Now().Add(-demandRest * s.every)
	if got := grow(); got != 200<<20 {
		t.Fatalf("a demand that held, long after a piece was freed: a piece of %d, want 200 MiB", got)
	}
}

// TestReserveUnderPressure: short of memory, the reserve gives its pieces
// back, makes none while memory stays short, and fills again after.
func TestReserveUnderPressure(t *testing.T) {
	const mib = 1 << 20
	f := startReserve(t, 64*mib)
	f.waitFull(t)
	low := f.s.res.Load().low
	f.avail.Store(low - 1)
	waitFor(t, "memory given back", func() bool { return f.s.Reserved().Bytes == 0 })
	time.Sleep(20 * f.s.every)
	if r := f.s.Reserved(); r.Bytes != 0 {
		t.Fatalf("short of memory: the reserve holds %+v, want nothing", r)
	}
	// Memory back, with room above twice the threshold for 5 MiB: only
	// the pieces of at most that are made.
	f.avail.Store(2*low + 5*mib)
	waitFor(t, "the small pieces", func() bool { return f.s.Reserved().Bytes == 8*mib })
	time.Sleep(20 * f.s.every)
	if r := f.s.Reserved(); r.Bytes != 8*mib {
		t.Fatalf("with room for 5 MiB of pieces: %+v, want the 4 MiB and two 2 MiB pieces only", r)
	}
	f.avail.Store(1 << 50)
	f.waitFull(t)
}

// TestReserveRelief: under the threshold, the reserve gives back enough to
// bring available memory up to twice it: the smallest piece that is
// enough, else the largest, and again; never hugetlb pieces, which
// available memory does not count.
func TestReserveRelief(t *testing.T) {
	const mib = 1 << 20
	host, err := NewHost()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name       string
		low, avail int64
		huge       int64 // the piece of this size is hugetlb
		left       []int64
	}{
		// The pieces: 50, 6, 4, 2 and 2 MiB. Needed: twice low less avail.
		{"one piece is enough", 5 * mib, 4 * mib, 0, []int64{50 * mib, 4 * mib, 2 * mib, 2 * mib}},
		{"the largest, then the smallest that is enough", 30 * mib, 7 * mib, 0, []int64{6 * mib, 2 * mib, 2 * mib}},
		{"not under the threshold", 40 * mib, 40 * mib, 0, []int64{50 * mib, 6 * mib, 4 * mib, 2 * mib, 2 * mib}},
		{"hugetlb stays", 40 * mib, 39 * mib, 50 * mib, []int64{50 * mib}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := NewSpill(host, 0)
			s.meminfo = func() (meminfo, error) { return meminfo{available: tc.avail}, nil }
			r := &reserve{sizes: reserveLayout(64*mib, 2*mib), low: tc.low}
			r.pieces = make([]*piece, len(r.sizes))
			for i, size := range r.sizes {
				p, err := makePiece(size, 0, false, func() bool { return true }, nil, 0)
				if err != nil {
					t.Fatal(err)
				}
				p.huge = size == tc.huge
				r.pieces[i] = p
			}
			defer r.close()
			s.relieve(r, slog.New(slog.DiscardHandler))
			var left []int64
			for _, p := range r.pieces {
				if p != nil {
					left = append(left, p.size())
				}
			}
			if !slices.Equal(left, tc.left) {
				t.Fatalf("left %v, want %v", left, tc.left)
			}
		})
	}
}

// TestReserveHugetlb: where the machine has hugetlb pages free, pieces are
// hugetlbfs memfds, and evicted memory on them works as any: mapped,
// moved into, freed, and restored after a restart.
func TestReserveHugetlb(t *testing.T) {
	mi, err := readMeminfo()
	if err != nil {
		t.Fatal(err)
	}
	if mi.hugeAvail < 8<<20 || mi.hugePage != 2<<20 {
		t.Skipf("needs 8 MiB of 2 MiB hugetlb pages free (%d bytes of %d-byte pages free; echo 8 > /proc/sys/vm/nr_hugepages)", mi.hugeAvail, mi.hugePage)
	}
	host, err := NewHost()
	if err != nil {
		t.Fatal(err)
	}
	s := NewSpill(host, 0)
	s.every = 5 * time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.Reserve(ctx, 8<<20, slog.New(slog.DiscardHandler))
	}()
	defer func() { cancel(); <-done }()
	waitFor(t, "the reserve to fill", func() bool { r := s.Reserved(); return r.Target > 0 && r.Bytes == r.Target })
	s.res.Load().mu.Lock()
	for _, p := range s.res.Load().pieces {
		var fs unix.Statfs_t
		unix.Fstatfs(p.fd, &fs)
		if !p.huge || fs.Type != unix.HUGETLBFS_MAGIC {
			t.Errorf("piece of %d bytes: huge %v, file system %#x; want hugetlbfs", p.size(), p.huge, fs.Type)
		}
	}
	s.res.Load().mu.Unlock()
	const size = 3<<20 + 4096
	m, err := s.AllocateScratch(0, size, maxParts)
	if err != nil {
		t.Fatal(err)
	}
	src, _ := host.Allocate(0, size)
	defer src.Free()
	want := bytes.Repeat([]byte{0xa5}, size)
	src.(segment.Data).WriteAt(want, 0)
	if err := host.Move(m, src, size); err != nil {
		t.Fatal(err)
	}
	// A restart: the supervisor's descriptor comes back as host memory of
	// the record's size, which maps in whole huge pages.
	fd, _ := m.FD()
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	back, err := host.Restore(0, dup, size)
	if err != nil {
		unix.Close(dup)
		t.Fatal(err)
	}
	got := make([]byte, size)
	if err := back.(segment.Data).ReadAt(got, 0); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("restored: equal %v, %v", bytes.Equal(got, want), err)
	}
	if err := back.Free(); err != nil {
		t.Fatalf("free of restored hugetlb memory: %v", err)
	}
	if err := m.Free(); err != nil {
		t.Fatalf("free: %v", err)
	}
}

func TestCgroupRoom(t *testing.T) {
	root := t.TempDir()
	write := func(path, s string) {
		t.Helper()
		p := filepath.Join(root, path)
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, []byte(s+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	// v2: a pod's limit above its container's high mark.
	write("kubepods/memory.max", "1000")
	write("kubepods/memory.current", "300")
	write("kubepods/pod/memory.max", "max")
	write("kubepods/pod/memory.high", "600")
	write("kubepods/pod/memory.current", "100")
	// v1: none on the process's own, one above it.
	write("memory/memory.limit_in_bytes", "2000")
	write("memory/memory.usage_in_bytes", "500")
	write("memory/a/memory.limit_in_bytes", "9223372036854771712")
	write("memory/a/memory.usage_in_bytes", "400")
	for _, tc := range []struct {
		name, self  string
		limit, room int64
	}{
		{"v2", "0::/kubepods/pod\n", 600, 500},
		{"v2, the parent's", "0::/kubepods\n", 1000, 700},
		{"v2, none", "0::/\n", 0, 0},
		{"v1", "9:name=systemd:/\n4:memory:/a\n0::/\n", 2000, 1500},
		{"v1, a cgroup not there", "4:cpu,memory:/b/c\n", 2000, 1500},
		{"nothing", "", 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			limit, room := cgroupRoom(root, []byte(tc.self))
			if limit != tc.limit || room != tc.room {
				t.Fatalf("cgroupRoom(%q) = %d, %d; want %d, %d", tc.self, limit, room, tc.limit, tc.room)
			}
		})
	}
	if _, err := readMeminfo(); err != nil {
		t.Fatalf("readMeminfo here: %v", err)
	}
}

// TestReserveStoppedWhileFilling: a reserve stopped while it makes its
// pieces returns at once, frees what it made, and does not crash (a stop
// in the middle of a piece once dereferenced the piece it had not made).
func TestReserveStoppedWhileFilling(t *testing.T) {
	before := spillMemfds(t)
	for i := range 20 {
		f := startReserve(t, 256<<20)
		time.Sleep(time.Duration(i) * time.Millisecond)
		f.stop()
	}
	if n := spillMemfds(t); n != before {
		t.Fatalf("%d spill memfds left open by stopped reserves", n-before)
	}
}

// keeper records what a Spill asks its Keeper to hold.
type keeper struct {
	mu   sync.Mutex
	held map[uint64]int // id -> a dup of the descriptor, as the supervisor's
	ever int
}

func (k *keeper) Hold(id uint64, fd int) {
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		panic(err)
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if _, ok := k.held[id]; ok {
		panic(fmt.Sprintf("piece %d held twice", id))
	}
	k.held[id] = dup
	k.ever++
}

func (k *keeper) Unhold(id uint64) {
	k.mu.Lock()
	defer k.mu.Unlock()
	fd, ok := k.held[id]
	if !ok {
		panic(fmt.Sprintf("piece %d let go of but not held", id))
	}
	unix.Close(fd)
	delete(k.held, id)
}

func (k *keeper) count() (held, ever int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.held), k.ever
}

// TestReserveKeeper: every piece of the reserve is held by the keeper
// while it is the reserve's, let go of once an eviction takes it (the
// segment's record brings it to the supervisor then) and once the reserve
// is freed; the piece made again is held again.
func TestReserveKeeper(t *testing.T) {
	const mib = 1 << 20
	k := &keeper{held: map[uint64]int{}}
	host, err := NewHost()
	if err != nil {
		t.Fatal(err)
	}
	f := &reserveFixture{s: NewSpill(host, 0), done: make(chan struct{})}
	f.s.SetKeeper(k)
	f.avail.Store(1 << 50)
	f.s.every = 5 * time.Millisecond
	f.s.meminfo = func() (meminfo, error) { return meminfo{available: f.avail.Load(), hugePage: 2 << 20}, nil }
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		defer close(f.done)
		f.s.Reserve(ctx, 64*mib, slog.New(slog.DiscardHandler))
	}()
	defer func() { cancel(); <-f.done }()
	f.waitFull(t)
	if held, ever := k.count(); held != 5 || ever != 5 {
		t.Fatalf("full reserve of 5 pieces: %d held, %d ever; want 5, 5", held, ever)
	}
	m, err := f.s.AllocateScratch(0, 7*mib, maxParts)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Free()
	if held, _ := k.count(); held != 4 {
		t.Fatalf("after an eviction took a piece: %d held, want 4", held)
	}
	f.waitFull(t)
	if held, ever := k.count(); held != 5 || ever != 6 {
		t.Fatalf("after the piece was made again: %d held, %d ever; want 5, 6", held, ever)
	}
	cancel()
	<-f.done
	if held, _ := k.count(); held != 0 {
		t.Fatalf("after the reserve was freed: %d still held", held)
	}
}

// reserveMapped counts the pieces of s's reserve that this process maps.
func reserveMapped(t *testing.T, s *Spill) int {
	t.Helper()
	maps, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	mapped := map[string]bool{}
	for _, l := range strings.Split(string(maps), "\n") {
		if f := strings.Fields(l); len(f) >= 6 && strings.HasPrefix(f[5], "/memfd:gpushm-spill") {
			mapped[f[4]] = true
		}
	}
	r := s.res.Load()
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, p := range r.pieces {
		var st unix.Stat_t
		if p != nil && unix.Fstat(p.fd, &st) == nil && mapped[strconv.FormatUint(st.Ino, 10)] {
			n++
		}
	}
	return n
}
