package integration

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testutil"
)

// TestSpillInParts: a segment evicted into new host memory, large enough
// for parts (backend.partsFor: 256 MiB and more each), has several
// memfds, each held by the supervisor under a record of its own; they
// come back joined after the serving process is killed, its bytes whole;
// a restore lets the journal forget them (the daemon keeps them as the
// clean copy), the next eviction journals them again, and a removal frees
// every one.
func TestSpillInParts(t *testing.T) {
	if avail := memAvailable(t); avail < 3<<30 {
		t.Skipf("needs 3 GiB of memory available, has %d", avail)
	}
	sock := filepath.Join(testutil.SocketDir(t), "gpushm.sock")
	// No reserve: the eviction makes its memory.
	d := Start(t, Options{Socket: sock, Args: []string{"--host-reserve", "0", "--create-pool", "0", "--grace", "1s"}})
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// Two parts of unequal size, and a segment of one memfd beside them.
	const big, small = 512<<20 + 64<<10, 4 << 20
	for _, s := range []struct {
		name string
		size int64
		seed uint64
	}{{"big", big, 11}, {"small", small, 12}} {
		seg, err := c.Create(ctx, s.name, s.size, nil)
		if err != nil {
			t.Fatal(err)
		}
		m, err := seg.Map()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := m.WriteAt(tierPattern(s.seed, s.size), 0); err != nil {
			t.Fatal(err)
		}
		seg.Close()
		if _, err := c.Evict(ctx, s.name); err != nil {
			t.Fatal(err)
		}
	}
	inf, err := d.info()
	if err != nil {
		t.Fatal(err)
	}
	spill := func(what string, pid, want int) {
		t.Helper()
		n := -1
		for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
			if n = spillFDs(pid); n == want {
				return
			}
		}
		t.Fatalf("%s: %d descriptors of spill memory in process %d, want %d", what, n, pid, want)
	}
	spill("evicted, the serving process", inf.PID, 3)
	spill("evicted, the supervisor", d.pid, 3)
	if tr := tiersOf(t, sock); tr["big"] != "host" || tr["small"] != "host" {
		t.Fatalf("tiers %v, want both on host", tr)
	}

	d.Crash(t)
	inf = d.waitServing(t, inf.PID)
	spill("after a crash, the serving process", inf.PID, 3)
	if tr := tiersOf(t, sock); tr["big"] != "host" || tr["small"] != "host" {
		t.Fatalf("after a crash: tiers %v, want both on host", tr)
	}
	check := func(when string) {
		t.Helper()
		for _, s := range []struct {
			name string
			seed uint64
		}{{"big", 11}, {"small", 12}} {
			seg, err := c.Open(ctx, s.name, &gpushm.OpenOptions{ReadOnly: true})
			if err != nil {
				t.Fatalf("open %s %s: %v", s.name, when, err)
			}
			err = checkTierBytes(seg, s.name, s.seed)
			seg.Close()
			if err != nil {
				t.Fatalf("%s: %v", when, err)
			}
		}
	}
	check("after a crash")
	// Both back on the device; their host memory kept by the serving
	// process as clean copies, not journaled.
	spill("restored, the supervisor", d.pid, 0)
	spill("restored, the serving process", inf.PID, 3)

	if _, err := c.Evict(ctx, "big"); err != nil {
		t.Fatal(err)
	}
	spill("evicted again (a swap), the supervisor", d.pid, 2)
	if _, err := c.Load(ctx, "big"); err != nil {
		t.Fatal(err)
	}
	// The journal forgot the parts, not the segments.
	d.Crash(t)
	inf = d.waitServing(t, inf.PID)
	if tr := tiersOf(t, sock); tr["big"] != "gpu" || tr["small"] != "gpu" {
		t.Fatalf("after a crash on the device: tiers %v, want both on the device", tr)
	}
	check("after a crash on the device")
	spill("after a crash on the device, the supervisor", d.pid, 0)
	if _, err := c.Evict(ctx, "big"); err != nil {
		t.Fatal(err)
	}
	spill("evicted into new memory, the supervisor", d.pid, 2)
	if err := c.Unlink(ctx, "big"); err != nil {
		t.Fatal(err)
	}
	spill("removed, the supervisor", d.pid, 0)
	spill("removed, the serving process", inf.PID, 0)
	d.Stop(t)
}
