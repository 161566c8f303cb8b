package server_test

import (
	"context"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/backend"
	"github.com/gpushm/gpushm/internal/server"
	"github.com/gpushm/gpushm/internal/testdaemon"
)

// cpuTime is what this process has spent on its cores so far.
func cpuTime(t *testing.T) time.Duration {
	t.Helper()
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// A worker polls for a connection's next request only when the client
// asked again within the spin: a client that asks now and then costs no
// spin after each request, and one that asks back to back finds its
// worker awake. The client here sleeps while the CPU time is taken, so
// what the process spends then is the worker's.
func TestSpinOnlyForQuickClients(t *testing.T) {
	const spin = 100 * time.Millisecond
	d := testdaemon.StartWith(t, "host", func(s *server.Server, _ backend.Backend) { s.SetSpin(spin) })
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, d.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	after := func() time.Duration {
		t.Helper()
		before := cpuTime(t)
		time.Sleep(spin * 3 / 2)
		return cpuTime(t) - before
	}
	ask := func() {
		t.Helper()
		if _, err := c.Info(ctx); err != nil {
			t.Fatal(err)
		}
	}

	time.Sleep(spin * 3 / 2) // the hello's spin, if any, is over
	ask()                    // after a pause: no spin
	slow := after()
	ask()
	ask() // back to back: its worker polls for the next
	quick := after()
	t.Logf("CPU time after a request that came after a pause: %s; after one back to back: %s (spin %s)", slow, quick, spin)
	if slow > spin/10 {
		t.Errorf("a request after a pause cost %s of CPU after its reply: its worker spun (want no spin)", slow)
	}
	if quick < spin/4 {
		t.Errorf("a request back to back cost only %s of CPU after its reply: its worker did not spin for %s", quick, spin)
	}
}

// Workers poll for at most maxSpinners connections at once, however many
// clients ask back to back: two such clients here, room for one poller.
func TestSpinnersAreBounded(t *testing.T) {
	const spin = 100 * time.Millisecond
	d := testdaemon.StartWith(t, "host", func(s *server.Server, _ backend.Backend) {
		s.SetSpin(spin)
		s.SetMaxSpinners(1)
	})
	ctx := context.Background()
	var clients []*gpushm.Client
	for range 2 {
		c, err := gpushm.Dial(ctx, d.Socket)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		clients = append(clients, c)
	}
	time.Sleep(spin * 3 / 2) // the hellos' spins, if any, are over
	before := cpuTime(t)
	for _, c := range clients {
		for range 2 { // back to back: its worker would poll for the next
			if _, err := c.Info(ctx); err != nil {
				t.Fatal(err)
			}
		}
	}
	time.Sleep(spin * 3 / 2)
	used := cpuTime(t) - before
	t.Logf("CPU time after two clients' requests back to back, one poller allowed: %s (spin %s)", used, spin)
	if used > spin*3/2 {
		t.Errorf("two clients' workers spent %s of CPU after their replies: both polled (want one, %s at most)", used, spin*3/2)
	}
	if used < spin/4 {
		t.Errorf("two clients' workers spent only %s of CPU after their replies: neither polled for %s", used, spin)
	}
}
