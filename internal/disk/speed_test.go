package disk

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestDiskSpeed compares a store's writes and reads with the raw O_DIRECT
// rate of its directories: a diagnostic, run only when GPUSHM_DISK_SPEED
// is set to a size in MiB; GPUSHM_DISK_DIRS lists the directories (one per
// drive, comma-separated; /var/tmp if unset), in each of which it works
// in a new subdirectory, removed at the end. GPUSHM_DISK_CHUNK is the
// chunk in MiB (64 if unset).
//
//	GPUSHM_DISK_SPEED=4096 GPUSHM_DISK_DIRS=/nvme0,/nvme1 go test -run TestDiskSpeed -v ./internal/disk
func TestDiskSpeed(t *testing.T) {
	mib, _ := strconv.Atoi(os.Getenv("GPUSHM_DISK_SPEED"))
	if mib <= 0 {
		t.Skip("a diagnostic: set GPUSHM_DISK_SPEED to a size in MiB")
	}
	roots := strings.Split(os.Getenv("GPUSHM_DISK_DIRS"), ",")
	if roots[0] == "" {
		roots = []string{"/var/tmp"}
	}
	chunk := int64(64)
	if c, err := strconv.Atoi(os.Getenv("GPUSHM_DISK_CHUNK")); err == nil {
		chunk = int64(c)
	}
	var dirs []string
	for _, r := range roots {
		d, err := os.MkdirTemp(r, "gpushm-disk-speed-")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(d) })
		dirs = append(dirs, filepath.Join(d, "store"))
	}
	reps := 3
	if n, err := strconv.Atoi(os.Getenv("GPUSHM_DISK_REPS")); err == nil && n > 0 {
		reps = n
	}
	fmt.Printf("%d MiB over %d directories (%s), chunk %d MiB, best of %d runs, alternating\n", mib, len(dirs), strings.Join(roots, ", "), chunk, reps)
	best := map[int]*Rates{}
	ratios := map[int][][2]float64{} // each run's write and read, to raw
	for range reps {
		for _, streams := range []int{1, 2} {
			r, err := Bench(context.Background(), dirs, int64(mib)<<20, Options{Chunk: chunk << 20, Streams: streams, Log: quiet})
			if err != nil {
				t.Fatal(err)
			}
			ratios[streams] = append(ratios[streams], [2]float64{r.RawWrite.Seconds() / r.Write.Seconds(), r.RawRead.Seconds() / r.Read.Seconds()})
			b := best[streams]
			if b == nil {
				best[streams] = &r
				continue
			}
			b.RawWrite, b.RawRead = min(b.RawWrite, r.RawWrite), min(b.RawRead, r.RawRead)
			b.Write, b.Read = min(b.Write, r.Write), min(b.Read, r.Read)
		}
	}
	fmt.Printf("%-8s %-22s %10s %8s %8s %14s\n", "streams", "", "best ms", "GB/s", "x best raw", "median x raw")
	for _, streams := range []int{1, 2} {
		r := best[streams]
		line := func(what string, d, raw time.Duration, k int) {
			med := ""
			if k >= 0 {
				var xs []float64
				for _, x := range ratios[streams] {
					xs = append(xs, x[k])
				}
				slices.Sort(xs)
				med = fmt.Sprintf("%.2f", xs[len(xs)/2])
			}
			fmt.Printf("%-8d %-22s %10.1f %8.2f %10.2f %14s\n", streams, what, d.Seconds()*1e3, GBps(r.Bytes, d), raw.Seconds()/d.Seconds(), med)
		}
		direct := "O_DIRECT"
		if !r.Direct {
			direct = "buffered"
		}
		line("raw "+direct+" write", r.RawWrite, r.RawWrite, -1)
		line("raw "+direct+" read", r.RawRead, r.RawRead, -1)
		line("Store.Write", r.Write, r.RawWrite, 0)
		line("Store.Read", r.Read, r.RawRead, 1)
	}
}
