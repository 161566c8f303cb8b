package gpushm_test

import (
	"context"
	"errors"
	"os"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/testdaemon"
)

// missingCalls records the server's calls of a pull-missing hook.
type missingCalls struct {
	mu    sync.Mutex
	calls []string
	uids  []uint32
	ro    []bool
}

func (m *missingCalls) hook(c segment.Cred, name string, readOnly bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.calls, m.uids, m.ro = append(m.calls, name), append(m.uids, c.UID), append(m.ro, readOnly)
}

func (m *missingCalls) count() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.calls)
}

func waitCalls(t *testing.T, m *missingCalls, n int) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); m.count() < n; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the pull-missing hook was called %d times, want %d", m.count(), n)
		}
	}
}

// TestWaitForMissing: with a pull-missing hook (the daemon's
// --pull-missing), an open that waits for a missing name calls it, with
// the waiter's uid and access, and keeps calling it while the name stays
// missing; never while a writer fills the name. A writer that gives up
// leaves the name missing again: the wait goes on (it would end with
// ENOENT without the hook) and the hook is called again; the next
// writer's commit ends it.
func TestWaitForMissing(t *testing.T) {
	d := testdaemon.Start(t, "host")
	ctx := context.Background()
	m := &missingCalls{}
	d.Server.SetPullMissing(m.hook)
	w, r := dial(t, d.Socket), dial(t, d.Socket)
	data := pattern(9, 64<<10+3)

	got := make(chan error, 1)
	go func() {
		rs, err := r.Open(ctx, "m", &gpushm.OpenOptions{ReadOnly: true, Wait: time.Minute})
		if err == nil {
			if b := readAll(t, rs); string(b) != string(data) {
				err = errors.New("the waiting reader got other bytes")
			}
			rs.Close()
		}
		got <- err
	}()
	waitCalls(t, m, 1)
	m.mu.Lock()
	if m.calls[0] != "m" || m.uids[0] != uint32(os.Getuid()) || !m.ro[0] {
		t.Fatalf("hook called for %q, uid %d, read-only %v; want m, %d, true", m.calls[0], m.uids[0], m.ro[0], os.Getuid())
	}
	m.mu.Unlock()
	// Asked again at its looks (every 200 ms) while the name is missing.
	waitCalls(t, m, 3)

	// A writer fills the name: no call while it does.
	seg, err := w.Create(ctx, "m", int64(len(data)), &gpushm.CreateOptions{Uncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	waitWaiting(t, d, 1)
	before := m.count()
	time.Sleep(500 * time.Millisecond) // two looks at least
	if n := m.count(); n > before+1 {
		// One call may have been on its way as the segment was made.
		t.Fatalf("hook called %d times while a writer filled the name", n-before)
	}
	// It gives up: the wait goes on, and the name is asked for again.
	seg.Close()
	after := m.count()
	waitCalls(t, m, after+1)
	select {
	case err := <-got:
		t.Fatalf("the wait ended when the writer gave up: %v", err)
	default:
	}
	seg, err = w.Create(ctx, "m", int64(len(data)), &gpushm.CreateOptions{Uncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	mp, err := seg.Map()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := mp.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	if err := seg.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-got; err != nil {
		t.Fatal(err)
	}
	seg.Close()

	// Without the hook, as before: the writer's giving up ends the wait.
	d.Server.SetPullMissing(nil)
	seg, err = w.Create(ctx, "n", 4096, &gpushm.CreateOptions{Uncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		_, err := r.Open(ctx, "n", &gpushm.OpenOptions{ReadOnly: true, Wait: time.Minute})
		got <- err
	}()
	waitWaiting(t, d, 1)
	seg.Close()
	if err := <-got; !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("without the hook, a wait whose writer gave up: %v, want ENOENT", err)
	}
}
