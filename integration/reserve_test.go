package integration

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/testutil"
)

// TestSupervisorHoldsTheReserve: the supervisor holds the host reserve's
// memory too (supervisor.Link.Hold), so that a serving process killed with
// a reserve of many GiB does not free it on its way out, which kept its
// successor from serving for seconds (2.2 to 3.3 s for 16 GiB on an H200
// machine); once the successor serves, the supervisor lets the old reserve
// go and holds the successor's.
func TestSupervisorHoldsTheReserve(t *testing.T) {
	dir := testutil.SocketDir(t)
	sock := filepath.Join(dir, "gpushm.sock")
	// 64 MiB: five pieces (backend.reserveLayout: 50, 6, 4, 2 and 2 MiB).
	const pieces = 5
	d := Start(t, Options{Socket: sock, Args: []string{"--host-reserve", "64MiB"}})
	held := func(serving int) {
		t.Helper()
		deadline := time.Now().Add(60 * time.Second)
		for {
			s, sup := spillFDs(serving), spillFDs(d.pid)
			if s == pieces && sup == pieces {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("after 60s: the serving process has %d memfds of its reserve, the supervisor %d; want %d each\n%s",
					s, sup, pieces, d.log.String())
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	inf, err := d.info()
	if err != nil {
		t.Fatal(err)
	}
	held(inf.PID)
	syscall.Kill(inf.PID, syscall.SIGKILL)
	next := d.waitServing(t, inf.PID)
	// The old reserve is let go of, the new one held: five, not ten.
	held(next.PID)
	d.Stop(t)
}

// spillFDs counts pid's descriptors of spill memory (the host reserve's
// memfds and evicted segments'), or -1 when it cannot read them.
func spillFDs(pid int) int {
	dir := filepath.Join("/proc", strconv.Itoa(pid), "fd")
	ents, err := os.ReadDir(dir)
	if err != nil {
		return -1
	}
	n := 0
	for _, e := range ents {
		if l, _ := os.Readlink(filepath.Join(dir, e.Name())); strings.HasPrefix(l, "/memfd:gpushm-spill") {
			n++
		}
	}
	return n
}
