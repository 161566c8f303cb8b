package backend

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/xfer"
)

// speedSetup is what the speed diagnostics share: the size asked for in
// GPUSHM_MOVE_SPEED (MiB, and bytes), the machine's first backend (closed
// at the test's end) and a host backend; it skips the test without it.
func speedSetup(t *testing.T) (mib int, n int64, b Backend, host *Host) {
	t.Helper()
	mib, _ = strconv.Atoi(os.Getenv("GPUSHM_MOVE_SPEED"))
	if mib <= 0 {
		t.Skip("a diagnostic: set GPUSHM_MOVE_SPEED to a size in MiB")
	}
	b, err := Open("auto", "all", slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	if host, err = NewHost(); err != nil {
		t.Fatal(err)
	}
	return mib, int64(mib) << 20, b, host
}

// TestMoveSpeed times the pieces of an eviction and a restore on the
// machine's first backend (cuda where there is a GPU): a diagnostic, run
// only when GPUSHM_MOVE_SPEED is set to a size in MiB.
func TestMoveSpeed(t *testing.T) {
	mib, n, b, host := speedSetup(t)
	dev := b.DefaultDevice()
	free := func() uint64 {
		ds, _ := b.Devices()
		return ds[0].FreeBytes >> 20
	}
	line := func(what string, d time.Duration) {
		fmt.Printf("%-40s %9.1f ms %7.1f GB/s   free %d MiB\n", what, d.Seconds()*1e3, float64(n)/d.Seconds()/1e9, free())
	}
	fmt.Printf("backend %s, %d MiB, free at start %d MiB\n", b.Name(), mib, free())
	start := time.Now()
	g, err := b.Allocate(dev, n)
	if err != nil {
		t.Fatal(err)
	}
	g.FD()
	line("allocate + export", time.Since(start))
	start = time.Now()
	s, err := NewSpill(host, 0).Allocate(0, n)
	if err != nil {
		t.Fatal(err)
	}
	line("spill allocate (populate)", time.Since(start))
	mover := b.(segment.Mover)
	for i := range 2 {
		start = time.Now()
		if err := mover.Move(s, g, n); err != nil {
			t.Fatal(err)
		}
		line(fmt.Sprintf("move out %d", i), time.Since(start))
		start = time.Now()
		if err := mover.Move(g, s, n); err != nil {
			t.Fatal(err)
		}
		line(fmt.Sprintf("move in %d", i), time.Since(start))
	}
	xt, ok := g.(interface{ XferTarget() (xfer.Target, error) })
	hb := s.(*hostMemory)
	if ok {
		tg, _ := xt.XferTarget()
		f := os.NewFile(uintptr(hb.fd), "spill")
		for _, w := range []int{4, 8, 16} {
			for _, chunk := range []int64{2 << 20, 8 << 20} {
				o := &xfer.Options{Workers: w, Chunk: chunk, Direct: xfer.DirectNever}
				start = time.Now()
				if _, err := xfer.Load(context.Background(), tg, []xfer.Range{{File: f, Off: 0, Len: n, At: 0}}, o); err != nil {
					t.Fatal(err)
				}
				line(fmt.Sprintf("load (pread) w%d c%dM", w, chunk>>20), time.Since(start))
				b, _ := hb.span(0, n)
				start = time.Now()
				if _, err := xfer.Move(tg, b, true, o); err != nil {
					t.Fatal(err)
				}
				line(fmt.Sprintf("move in (memcpy) w%d c%dM", w, chunk>>20), time.Since(start))
				start = time.Now()
				if _, err := xfer.Move(tg, b, false, o); err != nil {
					t.Fatal(err)
				}
				line(fmt.Sprintf("move out (memcpy) w%d c%dM", w, chunk>>20), time.Since(start))
			}
		}
	}
	sp := NewSpill(host, 2*n)
	start = time.Now()
	s.(*hostMemory).recycle = sp.recycle
	s.Free()
	line("free spill (kept for reuse)", time.Since(start))
	start = time.Now()
	r, err := sp.AllocateScratch(0, n, maxParts)
	if err != nil {
		t.Fatal(err)
	}
	if err := mover.Move(r, g, n); err != nil {
		t.Fatal(err)
	}
	line("evict into reused spill memory", time.Since(start))
	start = time.Now()
	r.(*hostMemory).recycle = nil
	r.Free()
	line("free spill", time.Since(start))
	start = time.Now()
	g.Free()
	line("free gpu", time.Since(start))
	time.Sleep(100 * time.Millisecond)
	line("100 ms later", time.Since(start))
}

// TestEvictSpeed times a first eviction into new host memory against one
// into the reserve (Spill.Reserve, made ahead), and the restore from the
// reserve's memory, on the machine's first backend: a diagnostic, run
// only when GPUSHM_MOVE_SPEED is set to a size in MiB. The reserve is
// twice the size, so that its largest piece holds the segment.
func TestEvictSpeed(t *testing.T) {
	mib, n, b, host := speedSetup(t)
	mover := b.(segment.Mover)
	dev := b.DefaultDevice()
	row := func(what string, d time.Duration, bytes int64) {
		if bytes == 0 {
			fmt.Printf("%-46s %10.3f ms\n", what, d.Seconds()*1e3)
			return
		}
		fmt.Printf("%-46s %10.1f ms %8.1f GB/s\n", what, d.Seconds()*1e3, float64(bytes)/d.Seconds()/1e9)
	}
	fmt.Printf("backend %s, %d MiB, shmem transparent huge pages %v, %d cores\n\n", b.Name(), mib, shmemTHP(), runtime.NumCPU())
	fmt.Printf("%-46s %13s %13s\n", "step", "time", "rate")
	g, err := b.Allocate(dev, n)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Free()
	if d, ok := g.(segment.Data); ok {
		d.Zero(0, n) // its pages made, on the host backend
	}

	// Into new memory: the kernel makes its pages on the way.
	sp := NewSpill(host, 0)
	start := time.Now()
	m, err := sp.AllocateScratch(0, n, maxParts)
	if err != nil {
		t.Fatal(err)
	}
	made := time.Since(start)
	if err := mover.Move(m, g, n); err != nil {
		t.Fatal(err)
	}
	all := time.Since(start)
	row("new memory: make its pages", made, n)
	row("new memory: copy", all-made, n)
	row("evict into new memory", all, n)
	m.Free()

	// Into the reserve, made ahead.
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	start = time.Now()
	go func() {
		defer close(done)
		sp.Reserve(ctx, 2*n, slog.Default())
	}()
	defer func() { cancel(); <-done }()
	for r := sp.Reserved(); r.Target == 0 || r.Bytes < r.Target; r = sp.Reserved() {
		if time.Since(start) > 10*time.Minute {
			t.Fatalf("the reserve is not full after 10 minutes: %+v", r)
		}
		time.Sleep(10 * time.Millisecond)
	}
	row(fmt.Sprintf("reserve of %d MiB made (background, nice 19)", 2*mib), time.Since(start), 2*n)
	start = time.Now()
	m, err = sp.AllocateScratch(0, n, maxParts)
	if err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	if r := sp.Reserved(); r.Takes != 1 {
		t.Fatalf("the eviction did not take from the reserve: %+v", r)
	}
	if err := mover.Move(m, g, n); err != nil {
		t.Fatal(err)
	}
	all = time.Since(start)
	row("reserve: take a piece", took, 0)
	row("reserve: copy", all-took, n)
	row("evict into the reserve", all, n)

	// Back, from the reserve's memory, into new device memory.
	back, err := b.Allocate(dev, n)
	if err != nil {
		t.Fatal(err)
	}
	defer back.Free()
	start = time.Now()
	if err := mover.Move(back, m, n); err != nil {
		t.Fatal(err)
	}
	row("restore from the reserve's memory (copy)", time.Since(start), n)
	m.Free()
}

// TestPopulateSpeed times making the pages of new host memory (shmem),
// by threads and by how many memfds share the size: a diagnostic for the
// reserve's growth, run only when GPUSHM_MOVE_SPEED is set to a size in MiB.
func TestPopulateSpeed(t *testing.T) {
	mib, _ := strconv.Atoi(os.Getenv("GPUSHM_MOVE_SPEED"))
	if mib <= 0 {
		t.Skip("a diagnostic: set GPUSHM_MOVE_SPEED to a size in MiB")
	}
	n := int64(mib) << 20
	fmt.Printf("%d MiB, %d cores, shmem transparent huge pages %v\n", mib, runtime.NumCPU(), shmemTHP())
	fmt.Printf("%8s %8s %10s %9s\n", "threads", "memfds", "ms", "GB/s")
	for _, threads := range []int{1, 2, 4, 8, 16} {
		for _, files := range []int{1, threads} {
			each := n / int64(files)
			fds := newFiles(t, files, each, speedMemfd)
			per := each / reserveChunk
			start := time.Now()
			err := inChunks(int(per)*files, threads, nil, nil, func(i int) error {
				return populateAt(fds[i%files], int64(i/files)*reserveChunk, reserveChunk)
			})
			d := time.Since(start)
			closeAll(fds)
			if err != nil {
				t.Fatal(err)
			}
			fmt.Printf("%8d %8d %10.1f %9.2f\n", threads, files, d.Seconds()*1e3, float64(n)/d.Seconds()/1e9)
			if threads == 1 {
				break
			}
		}
	}
}

// TestHugeTmpfsSpeed times making the pages of files of a private tmpfs
// mounted huge=always (root only), where shmem's own transparent huge
// pages are off: a diagnostic, run only when GPUSHM_MOVE_SPEED is set.
func TestHugeTmpfsSpeed(t *testing.T) {
	mib, _ := strconv.Atoi(os.Getenv("GPUSHM_MOVE_SPEED"))
	if mib <= 0 {
		t.Skip("a diagnostic: set GPUSHM_MOVE_SPEED to a size in MiB")
	}
	dir := t.TempDir()
	if err := unix.Mount("gpushm", dir, "tmpfs", 0, "huge=always,mode=0700"); err != nil {
		t.Skipf("mount tmpfs huge=always: %v", err)
	}
	root, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(root)
	// Detached: reachable only through root from here on.
	if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	n := int64(mib) << 20
	fmt.Printf("%d MiB in files of a private tmpfs, huge=always, %d cores\n", mib, runtime.NumCPU())
	fmt.Printf("%8s %8s %10s %9s\n", "threads", "files", "ms", "GB/s")
	for _, threads := range []int{1, 2, 4, 8, 16} {
		for _, files := range []int{1, threads} {
			each := n / int64(files)
			fds := newFiles(t, files, each, func() (int, error) {
				return unix.Openat(root, ".", unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
			})
			chunk := min(32<<20, each) // a file smaller than a chunk is one
			per := each / chunk
			start := time.Now()
			err := inChunks(int(per)*files, threads, nil, nil, func(i int) error {
				return populateAt(fds[i%files], int64(i/files)*chunk, chunk)
			})
			d := time.Since(start)
			made := per * chunk * int64(files)
			huge := meminfoLine("ShmemHugePages")
			closeAll(fds)
			if err != nil {
				t.Fatal(err)
			}
			fmt.Printf("%8d %8d %10.1f %9.2f   ShmemHugePages %s\n", threads, files, d.Seconds()*1e3, float64(made)/d.Seconds()/1e9, huge)
			if threads == 1 {
				break
			}
		}
	}
}

// meminfoLine is a line's value of /proc/meminfo, as written there.
func meminfoLine(key string) string {
	b, _ := os.ReadFile("/proc/meminfo")
	for _, l := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(l, ":"); ok && k == key {
			return strings.TrimSpace(v)
		}
	}
	return "?"
}

// TestFreshPageSpeed times the first touch of new memory three ways, each
// twice in a row (the second round gets pages the first freed): anonymous
// memory with transparent huge pages, anonymous memory in 4 KiB pages, and
// shmem in a memfd per thread. Which of them are slow, and whether a
// second round is faster, tells a bound of the kernel's shmem from one of
// a virtual machine's first touch (docs/benchmarks.md, "The first eviction
// at the default settings"). A diagnostic, run only when GPUSHM_MOVE_SPEED
// is set to a size in MiB; run it first on a fresh machine.
func TestFreshPageSpeed(t *testing.T) {
	mib, _ := strconv.Atoi(os.Getenv("GPUSHM_MOVE_SPEED"))
	if mib <= 0 {
		t.Skip("a diagnostic: set GPUSHM_MOVE_SPEED to a size in MiB")
	}
	n := int64(mib) << 20
	threads := runtime.NumCPU()
	const chunk = 32 << 20
	fmt.Printf("%d MiB, %d threads, anonymous THP %s, shmem THP %v\n", mib, threads,
		strings.TrimSpace(readFile("/sys/kernel/mm/transparent_hugepage/enabled")), shmemTHP())
	fmt.Printf("%-24s %6s %10s %9s\n", "memory", "round", "ms", "GB/s")
	for _, kind := range []string{"anonymous, huge pages", "anonymous, 4 KiB pages", "shmem, a memfd a thread"} {
		for round := 1; round <= 2; round++ {
			var region []byte
			var fds []int
			per := n / chunk
			var err error
			if kind == "shmem, a memfd a thread" {
				each := n / int64(threads) / chunk * chunk
				per = each / chunk * int64(threads)
				fds = newFiles(t, threads, each, speedMemfd)
			} else {
				region, err = unix.Mmap(-1, 0, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
				if err != nil {
					t.Fatal(err)
				}
				advice := unix.MADV_HUGEPAGE
				if kind == "anonymous, 4 KiB pages" {
					advice = unix.MADV_NOHUGEPAGE
				}
				if err := unix.Madvise(region, advice); err != nil {
					t.Fatal(err)
				}
			}
			start := time.Now()
			err = inChunks(int(per), threads, nil, nil, func(i int) error {
				if fds == nil {
					return unix.Madvise(region[int64(i)*chunk:int64(i+1)*chunk], unix.MADV_POPULATE_WRITE)
				}
				return populateAt(fds[i%threads], int64(i/threads)*chunk, chunk)
			})
			d := time.Since(start)
			huge := meminfoLine("AnonHugePages")
			if region != nil {
				unix.Munmap(region)
			}
			closeAll(fds)
			if err != nil {
				t.Fatal(err)
			}
			fmt.Printf("%-24s %6d %10.1f %9.2f   AnonHugePages %s\n", kind, round, d.Seconds()*1e3, float64(per*chunk)/d.Seconds()/1e9, huge)
		}
	}
}

func readFile(path string) string {
	b, _ := os.ReadFile(path)
	return string(b)
}

// TestShmemWays times making new shmem pages four ways: faults
// (MADV_POPULATE_WRITE of a mapping, what the reserve does), fallocate,
// pwrite of nonzero bytes, and fallocate followed by mapping every page;
// each into a memfd a thread and into one memfd that every thread shares
// (as a segment's one memfd would be). A diagnostic, run only when
// GPUSHM_MOVE_SPEED is set to a size in MiB.
func TestShmemWays(t *testing.T) {
	mib, _ := strconv.Atoi(os.Getenv("GPUSHM_MOVE_SPEED"))
	if mib <= 0 {
		t.Skip("a diagnostic: set GPUSHM_MOVE_SPEED to a size in MiB")
	}
	threads := runtime.NumCPU()
	const chunk = 32 << 20
	each := (int64(mib) << 20) / int64(threads) / chunk * chunk
	per := int(each/chunk) * threads
	n := int64(per) * chunk
	data := make([]byte, chunk)
	for i := range data {
		data[i] = byte(i) | 1
	}
	populate := func(fd int, off int64) error { return populateAt(fd, off, chunk) }
	ways := []struct {
		name string
		do   func(fd int, off int64) error
		then func(fd int, off int64) error
	}{
		{"faults (populate)", populate, nil},
		{"fallocate", func(fd int, off int64) error { return unix.Fallocate(fd, 0, off, chunk) }, nil},
		{"pwrite", func(fd int, off int64) error { _, err := unix.Pwrite(fd, data, off); return err }, nil},
		{"fallocate, then mapped", func(fd int, off int64) error { return unix.Fallocate(fd, 0, off, chunk) }, populate},
	}
	fmt.Printf("%d MiB of shmem, %d threads\n", n>>20, threads)
	fmt.Printf("%-24s %7s %10s %9s\n", "way", "memfds", "ms", "GB/s")
	for _, w := range ways {
		for _, files := range []int{threads, 1} {
			fds := newFiles(t, files, n/int64(files), speedMemfd)
			where := func(i int) (int, int64) { return fds[i%files], int64(i/files) * chunk }
			start := time.Now()
			err := inChunks(per, threads, nil, nil, func(i int) error { return w.do(where(i)) })
			if err == nil && w.then != nil {
				err = inChunks(per, threads, nil, nil, func(i int) error { return w.then(where(i)) })
			}
			d := time.Since(start)
			closeAll(fds)
			if err != nil {
				t.Fatal(err)
			}
			fmt.Printf("%-24s %7d %10.1f %9.2f\n", w.name, files, d.Seconds()*1e3, float64(n)/d.Seconds()/1e9)
		}
	}
}

// newFiles makes n files of size bytes each with open, failing t.
func newFiles(t *testing.T, n int, size int64, open func() (int, error)) []int {
	t.Helper()
	fds := make([]int, 0, n)
	for range n {
		fd, err := open()
		if err == nil {
			err = unix.Ftruncate(fd, size)
			fds = append(fds, fd)
		}
		if err != nil {
			closeAll(fds)
			t.Fatal(err)
		}
	}
	return fds
}

func speedMemfd() (int, error) { return unix.MemfdCreate("move-speed", unix.MFD_CLOEXEC) }

func closeAll(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// populateAt makes the pages of n bytes of fd at off by faults: a shared
// mapping of them, MADV_POPULATE_WRITE, as the reserve makes its pieces.
func populateAt(fd int, off, n int64) error {
	b, err := unix.Mmap(fd, off, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return err
	}
	err = unix.Madvise(b, unix.MADV_POPULATE_WRITE)
	unix.Munmap(b)
	return err
}

// TestPartsSpeed times an eviction into new spill memory in parts and
// restores from it two ways: pread (what the daemon does), and each part
// mapped (MADV_POPULATE_READ) then copied from the mapping; a diagnostic,
// run only when GPUSHM_MOVE_SPEED is set to a size in MiB.
func TestPartsSpeed(t *testing.T) {
	_, n, b, _ := speedSetup(t)
	line := func(what string, d time.Duration) {
		fmt.Printf("%-44s %9.1f ms %7.1f GB/s\n", what, d.Seconds()*1e3, float64(n)/d.Seconds()/1e9)
	}
	g, err := b.Allocate(b.DefaultDevice(), n)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Free()
	mover := b.(segment.Mover)
	for round := range 2 {
		p, err := makeParts(n, partsFor(n))
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		if err := mover.Move(p, g, n); err != nil {
			t.Fatal(err)
		}
		line(fmt.Sprintf("%d: evict into %d new parts (pwrite)", round, len(p.parts)), time.Since(start))
		for i := range 2 {
			start = time.Now()
			if err := mover.Move(g, p, n); err != nil {
				t.Fatal(err)
			}
			line(fmt.Sprintf("%d: restore (pread) %d", round, i), time.Since(start))
		}
		xt, ok := g.(interface{ XferTarget() (xfer.Target, error) })
		if !ok {
			p.Free()
			continue
		}
		tg, _ := xt.XferTarget()
		var spans [][]byte
		start = time.Now()
		for _, h := range p.parts {
			b, err := unix.Mmap(h.fd, 0, int(h.size), unix.PROT_READ, unix.MAP_SHARED)
			if err != nil {
				t.Fatal(err)
			}
			spans = append(spans, b)
		}
		var wg sync.WaitGroup
		for _, s := range spans {
			wg.Go(func() { populateWith(unix.MADV_POPULATE_READ, s, reserveChunk, 1, nil, nil) })
		}
		wg.Wait()
		line(fmt.Sprintf("%d: map every part (populate read)", round), time.Since(start))
		for i := range 2 {
			start = time.Now()
			at := int64(0)
			for _, s := range spans {
				sub := tg
				sub.Ptr, sub.Size = tg.Ptr+uint64(at), int64(len(s))
				if _, err := xfer.Move(sub, s, true, nil); err != nil {
					t.Fatal(err)
				}
				at += int64(len(s))
			}
			line(fmt.Sprintf("%d: restore from the mappings %d", round, i), time.Since(start))
		}
		for _, s := range spans {
			unix.Munmap(s)
		}
		p.Free()
	}
}
