package backend

import (
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/xfer"
)

// TestMoveSpeed times the pieces of an eviction and a restore on the
// machine's first backend (cuda where there is a GPU): a diagnostic, run
// only when GPUSHM_MOVE_SPEED is set to a size in MiB.
func TestMoveSpeed(t *testing.T) {
	mib, _ := strconv.Atoi(os.Getenv("GPUSHM_MOVE_SPEED"))
	if mib <= 0 {
		t.Skip("a diagnostic: set GPUSHM_MOVE_SPEED to a size in MiB")
	}
	n := int64(mib) << 20
	b, err := Open("auto", "all", slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	host, _ := NewHost()
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
				if _, err := xfer.Load(tg, []xfer.Range{{File: f, Off: 0, Len: n, At: 0}}, o); err != nil {
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
	r, err := sp.AllocateScratch(0, n)
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
