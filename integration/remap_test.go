package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testutil"
)

func remapBytes(seed uint64, n int64) []byte {
	b := make([]byte, n)
	rand.NewChaCha8([32]byte{byte(seed)}).Read(b)
	return b
}

func remapAddr(m *gpushm.Mapping) uintptr {
	if m.OnDevice() {
		return uintptr(m.DevicePtr())
	}
	return uintptr(unsafe.Pointer(unsafe.SliceData(m.Bytes())))
}

func remapRead(t *testing.T, m *gpushm.Mapping) []byte {
	t.Helper()
	b := make([]byte, m.Size())
	if _, err := m.ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestSurviveReleaseAndVersions: a reader releases a segment and the
// serving process is killed; the reader reacquires it at the same
// addresses. A writer's next version outlives a kill before its commit,
// its writer commits it afterwards, and the reader refreshes onto it at
// the same addresses; the version number survives a kill too.
func TestSurviveReleaseAndVersions(t *testing.T) {
	sock := filepath.Join(testutil.SocketDir(t), "gpushm.sock")
	d := Start(t, Options{Socket: sock, Args: append([]string{"--grace", "1s"}, testBackend()...)})
	ctx := context.Background()
	const size = 1<<20 + 5
	dial := func() *gpushm.Client {
		c, err := gpushm.Dial(ctx, sock)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	w := dial()
	seg, err := w.Create(ctx, "m", size, nil)
	if err != nil {
		t.Fatal(err)
	}
	wm, err := seg.Map()
	if err != nil {
		t.Fatal(err)
	}
	wm.WriteAt(remapBytes(1, size), 0)
	seg.Close()

	r := dial()
	rs, err := r.Open(ctx, "m", &gpushm.OpenOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	m, err := rs.Map()
	if err != nil {
		t.Fatal(err)
	}
	at := remapAddr(m)
	if err := rs.Release(ctx); err != nil {
		t.Fatal(err)
	}
	d.Crash(t)
	if err := rs.Reacquire(ctx); err != nil {
		t.Fatalf("reacquire after a kill of the serving process: %v", err)
	}
	if remapAddr(m) != at || !bytes.Equal(remapRead(t, m), remapBytes(1, size)) {
		t.Fatal("reacquired after a kill: not the same addresses and bytes")
	}

	next, err := w.Create(ctx, "m", size, &gpushm.CreateOptions{NextVersion: true})
	if err != nil {
		t.Fatal(err)
	}
	nm, err := next.Map()
	if err != nil {
		t.Fatal(err)
	}
	nm.WriteAt(remapBytes(2, size), 0)
	d.Crash(t)
	if stale, err := rs.Stale(ctx); err != nil || stale {
		t.Fatalf("stale before the commit: %v, %v", stale, err)
	}
	if err := next.Commit(ctx); err != nil {
		t.Fatalf("commit of a next version after a kill: %v", err)
	}
	next.Close()
	if stale, err := rs.Stale(ctx); err != nil || !stale {
		t.Fatalf("stale after the commit: %v, %v", stale, err)
	}
	d.Crash(t)
	if changed, err := rs.Refresh(ctx); err != nil || !changed {
		t.Fatalf("refresh after a kill: %v, %v", changed, err)
	}
	if remapAddr(m) != at || rs.Version() != 2 || !bytes.Equal(remapRead(t, m), remapBytes(2, size)) {
		t.Fatalf("refreshed: at %#x (was %#x), version %d", remapAddr(m), at, rs.Version())
	}
	rs.Close()
	d.waitGraceOver(t)
	inf, err := d.info()
	if err != nil {
		t.Fatal(err)
	}
	if inf.Usage.Segments != 1 {
		t.Fatalf("%d segments hold memory, want 1 (version 2)", inf.Usage.Segments)
	}

	// What a next version was made to replace outlives a kill too: one
	// made while its name named nothing is refused over a segment made
	// before the kill, as it would have been without one.
	fresh, err := w.Create(ctx, "fresh", size, &gpushm.CreateOptions{NextVersion: true})
	if err != nil {
		t.Fatal(err)
	}
	defer fresh.Close()
	if _, _, err := r.CreateOnly(ctx, "fresh", size, nil); err != nil {
		t.Fatal(err)
	}
	d.Crash(t)
	if err := fresh.Commit(ctx); !errors.Is(err, syscall.EEXIST) {
		t.Fatalf("commit over a segment made after the next version, across a kill = %v, want EEXIST", err)
	}
}

// TestPutNewVersion: put of an existing name fails and says how to
// replace it; put --new-version replaces it, and stat shows the version
// and who still holds the old one.
func TestPutNewVersion(t *testing.T) {
	d := Start(t, Options{})
	dir, sock := filepath.Dir(d.Socket()), d.Socket()
	v1, v2 := filepath.Join(dir, "v1"), filepath.Join(dir, "v2")
	os.WriteFile(v1, remapBytes(1, 70000), 0o644)
	os.WriteFile(v2, remapBytes(2, 70000), 0o644)
	mustRun(t, nil, "put", "w", v1)
	mustFail(t, "put --force w", "put", "w", v2)
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	old, err := c.Open(ctx, "w", nil)
	if err != nil {
		t.Fatal(err)
	}
	mustRun(t, nil, "put", "--new-version", "w", v2)
	out := mustRun(t, nil, "stat", "w")
	if !strings.Contains(out, "version:     2\n") || !strings.Contains(out, fmt.Sprintf("held:        version 1 (segment %d): 1 opens by pid %d\n", old.ID(), os.Getpid())) {
		t.Fatalf("stat after put --new-version with version 1 held:\n%s", out)
	}
	got := filepath.Join(dir, "got")
	mustRun(t, nil, "get", "w", got)
	if b, _ := os.ReadFile(got); !bytes.Equal(b, remapBytes(2, 70000)) {
		t.Fatal("get after put --new-version does not give the new version")
	}
	old.Close()
	if out := mustRun(t, nil, "stat", "w"); strings.Contains(out, "held:") {
		t.Fatalf("stat still shows version 1 after its last reader closed:\n%s", out)
	}
}
