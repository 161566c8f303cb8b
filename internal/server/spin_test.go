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

// watchSpin samples how many of s's workers poll, for d, while this
// process's clients sleep, and says the most it saw and the CPU time the
// process spent meanwhile (the workers', the clients asking nothing).
// The poll is timed by the clock, so a busy machine shortens it in CPU
// time, never in the count.
func watchSpin(t *testing.T, s *server.Server, d time.Duration) (most int32, cpu time.Duration) {
	t.Helper()
	before := cpuTime(t)
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(time.Millisecond) {
		most = max(most, s.Spinning())
	}
	return most, cpuTime(t) - before
}

func dialN(t *testing.T, socket string, n int) []*gpushm.Client {
	t.Helper()
	var cs []*gpushm.Client
	for range n {
		c, err := gpushm.Dial(context.Background(), socket)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		cs = append(cs, c)
	}
	return cs
}

func info(t *testing.T, c *gpushm.Client) {
	t.Helper()
	if _, err := c.Info(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// A worker polls for a connection's next request only when the client
// asked again within the spin: a client that asks now and then costs no
// spin after each request, and one that asks back to back finds its
// worker awake.
func TestSpinOnlyForQuickClients(t *testing.T) {
	const spin = 100 * time.Millisecond
	var srv *server.Server
	d := testdaemon.StartWith(t, "host", func(s *server.Server, _ backend.Backend) { s.SetSpin(spin); srv = s })
	c := dialN(t, d.Socket, 1)[0]

	time.Sleep(spin * 3 / 2) // the hello's spin, if any, is over
	info(t, c)               // after a pause: no spin
	slow, slowCPU := watchSpin(t, srv, spin*3/2)
	info(t, c)
	info(t, c) // back to back: its worker polls for the next
	quick, quickCPU := watchSpin(t, srv, spin*3/2)
	t.Logf("after a request that came after a pause: %d polling, %s of CPU; after one back to back: %d polling, %s of CPU (spin %s)",
		slow, slowCPU, quick, quickCPU, spin)
	if slow != 0 || slowCPU > spin/2 {
		t.Errorf("after a request that came after a pause, %d worker(s) polled, and the process spent %s of CPU: want no poll", slow, slowCPU)
	}
	if quick != 1 {
		t.Errorf("after a request back to back, %d workers polled, want 1", quick)
	}
}

// Workers poll for at most maxSpinners connections at once, however many
// clients ask back to back: two such clients here, room for one poller.
func TestSpinnersAreBounded(t *testing.T) {
	const spin = 100 * time.Millisecond
	var srv *server.Server
	d := testdaemon.StartWith(t, "host", func(s *server.Server, _ backend.Backend) {
		s.SetSpin(spin)
		s.SetMaxSpinners(1)
		srv = s
	})
	clients := dialN(t, d.Socket, 2)
	time.Sleep(spin * 3 / 2) // the hellos' spins, if any, are over
	for _, c := range clients {
		info(t, c)
		info(t, c) // back to back: its worker would poll for the next
	}
	most, used := watchSpin(t, srv, spin*3/2)
	t.Logf("after two clients' requests back to back, one poller allowed: %d polling at most, %s of CPU (spin %s)", most, used, spin)
	if most != 1 {
		t.Errorf("%d workers polled at once, want 1", most)
	}
	// Only one poll's worth of CPU: a second poller would have doubled it
	// (on a busy machine both take less, and this says nothing).
	if used > spin*3/2 {
		t.Errorf("two clients' workers spent %s of CPU after their replies: both polled (want one, %s at most)", used, spin*3/2)
	}
}

// The workers that poll are shared among users: one user asking back to
// back on more connections than there are pollers leaves the last one
// free, and another user's worker takes it.
func TestSpinnersAreShared(t *testing.T) {
	const spin = 5 * time.Second // longer than the test: each poll ends when its client goes
	const userA, userB = 4242, 4343
	var srv *server.Server
	d := testdaemon.StartWith(t, "host", func(s *server.Server, _ backend.Backend) {
		s.SetSpin(spin)
		s.SetMaxSpinners(2)
		srv = s
	})
	quickClientAs(t, d.Socket, userA, 3)
	var mostA int32
	for end := time.Now().Add(300 * time.Millisecond); time.Now().Before(end); time.Sleep(time.Millisecond) {
		mostA = max(mostA, srv.SpinningFor(userA))
	}
	quickClientAs(t, d.Socket, userB, 1)
	var mostB int32
	for end := time.Now().Add(300 * time.Millisecond); time.Now().Before(end); time.Sleep(time.Millisecond) {
		mostA, mostB = max(mostA, srv.SpinningFor(userA)), max(mostB, srv.SpinningFor(userB))
	}
	t.Logf("two pollers allowed; user A asked back to back on 3 connections, then user B on 1: A's polled at most %d at once, B's %d", mostA, mostB)
	if mostA != 1 {
		t.Errorf("user A's workers polled %d at once, want 1 (the other poller is kept for a user polling for none)", mostA)
	}
	if mostB != 1 {
		t.Errorf("user B's worker polled %d times at once, want 1", mostB)
	}
}
