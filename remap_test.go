package gpushm_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testdaemon"
)

// nextVersionChild makes the next version of $NAME, $SIZE bytes of
// pattern($SEED), and commits it unless $DIE is set: then it exits with
// the version written and not made current.
func nextVersionChild(ctx context.Context, c *gpushm.Client) error {
	size, _ := strconv.ParseInt(os.Getenv("SIZE"), 10, 64)
	seed, _ := strconv.ParseUint(os.Getenv("SEED"), 10, 64)
	seg, err := c.Create(ctx, os.Getenv("NAME"), size, &gpushm.CreateOptions{NextVersion: true})
	if err != nil {
		return err
	}
	m, err := seg.Map()
	if err != nil {
		return err
	}
	if _, err := m.WriteAt(pattern(seed, size), 0); err != nil {
		return err
	}
	if os.Getenv("DIE") != "" {
		os.Exit(0) // no commit, no close: as a crash leaves it
	}
	return seg.Commit(ctx)
}

func nextVersion(t *testing.T, socket, name string, size int64, seed uint64, env ...string) {
	t.Helper()
	env = append(env, "NAME="+name, fmt.Sprint("SIZE=", size), fmt.Sprint("SEED=", seed))
	cmd := child(t, socket, "next-version", env...)
	cmd.Stderr = nil
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("writer of version %d: %v\n%s", seed, err, out)
	}
}

// addr is where m's memory is in this process.
func addr(m *gpushm.Mapping) uintptr {
	if m.OnDevice() {
		return uintptr(m.DevicePtr())
	}
	return uintptr(unsafe.Pointer(unsafe.SliceData(m.Bytes())))
}

func mapped(t *testing.T, m *gpushm.Mapping) []byte {
	t.Helper()
	b := make([]byte, m.Size())
	if _, err := m.ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestReleaseReacquireAndVersions: a reader releases its mapping, the
// daemon evicts the segment, and reacquire maps it back at the same
// addresses; a writer in another process makes version 2 current and the
// reader, told by the epoch and by a wait, refreshes onto it at the same
// addresses while the old version goes once nobody holds it.
func TestReleaseReacquireAndVersions(t *testing.T) {
	for _, backend := range testdaemon.Backends() {
		t.Run(backend, func(t *testing.T) {
			d := testdaemon.Start(t, backend)
			ctx := context.Background()
			const size = 3<<20 + 17
			w := dial(t, d.Socket)
			seg, err := w.Create(ctx, "model", size, nil)
			if err != nil {
				t.Fatal(err)
			}
			wm, err := seg.Map()
			if err != nil {
				t.Fatal(err)
			}
			if _, err := wm.WriteAt(pattern(1, size), 0); err != nil {
				t.Fatal(err)
			}
			seg.Close()

			r := dial(t, d.Socket)
			rs, err := r.Open(ctx, "model", &gpushm.OpenOptions{ReadOnly: true})
			if err != nil {
				t.Fatal(err)
			}
			defer rs.Close()
			m, err := rs.Map()
			if err != nil {
				t.Fatal(err)
			}
			at := checkReleaseReacquire(t, w, rs, m, size)

			// Version 2, while a second reader keeps version 1.
			keep, err := dial(t, d.Socket).Open(ctx, "model", nil)
			if err != nil {
				t.Fatal(err)
			}
			if stale, err := rs.Stale(ctx); err != nil || stale {
				t.Fatalf("stale before any new version: %v, %v", stale, err)
			}
			waited := make(chan *gpushm.SegmentInfo, 1)
			go func() {
				inf, err := rs.WaitVersion(ctx, 30*time.Second)
				if err != nil {
					t.Error(err)
				}
				waited <- inf
			}()
			nextVersion(t, d.Socket, "model", size, 2)
			got := <-waited
			if got == nil || got.Version != 2 {
				t.Fatalf("wait for a version: %+v", got)
			}
			if stale, err := rs.Stale(ctx); err != nil || !stale {
				t.Fatalf("stale after version 2: %v, %v", stale, err)
			}
			if !bytes.Equal(mapped(t, m), pattern(1, size)) {
				t.Fatal("a reader that has not refreshed saw the new version")
			}
			st, err := w.Stat(ctx, "model")
			if err != nil {
				t.Fatal(err)
			}
			if st.Version != 2 || len(st.Versions) != 1 || st.Versions[0].Version != 1 || st.Versions[0].Opens != 2 ||
				len(st.Versions[0].PIDs) != 1 || st.Versions[0].PIDs[0] != os.Getpid() {
				t.Fatalf("stat after version 2 with two readers of version 1: version %d, versions %+v", st.Version, st.Versions)
			}
			changed, err := rs.Refresh(ctx)
			if err != nil || !changed {
				t.Fatalf("refresh: %v, %v", changed, err)
			}
			if addr(m) != at || rs.Version() != 2 {
				t.Fatalf("refreshed at %#x (was %#x), version %d", addr(m), at, rs.Version())
			}
			if !bytes.Equal(mapped(t, m), pattern(2, size)) {
				t.Fatal("refreshed mapping does not hold version 2")
			}
			if changed, err := rs.Refresh(ctx); err != nil || changed {
				t.Fatalf("second refresh: %v, %v", changed, err)
			}
			keep.Close()
			if u := usage(t, w); u.Segments != 1 {
				t.Fatalf("version 1 outlived its last reader: %+v", u)
			}
			if st, _ := w.Stat(ctx, "model"); len(st.Versions) != 0 || st.Opens != 1 {
				t.Fatalf("stat after the last reader of version 1 left: %+v", st)
			}

			checkFailedVersions(t, d.Socket, w, rs, m, at, size)
		})
	}
}

// checkReleaseReacquire: the reader rs releases its mapping m, the writer
// w evicts the segment, and reacquire maps it back at the same address,
// which it returns.
func checkReleaseReacquire(t *testing.T, w *gpushm.Client, rs *gpushm.Segment, m *gpushm.Mapping, size int64) uintptr {
	t.Helper()
	ctx := context.Background()
	at := addr(m)
	if err := rs.Release(ctx); err != nil {
		t.Fatal(err)
	}
	if !rs.Released() || !m.Released() {
		t.Fatal("not released after Release")
	}
	if _, err := m.ReadAt(make([]byte, 1), 0); err == nil {
		t.Fatal("read of a released mapping succeeded")
	}
	inf, err := w.Evict(ctx, "model")
	if err != nil {
		t.Fatalf("evict after release (nobody holds it): %v", err)
	}
	if inf.Tier != "host" || inf.Opens != 0 {
		t.Fatalf("after release and evict: tier %q, opens %d", inf.Tier, inf.Opens)
	}
	if err := rs.Reacquire(ctx); err != nil {
		t.Fatal(err)
	}
	if addr(m) != at {
		t.Fatalf("reacquired at %#x, was %#x", addr(m), at)
	}
	if !bytes.Equal(mapped(t, m), pattern(1, size)) {
		t.Fatal("reacquired mapping does not hold the segment's bytes")
	}
	if st, _ := w.Stat(ctx, "model"); st.Tier != "gpu" || st.Opens != 1 || st.Version != 1 {
		t.Fatalf("after reacquire: tier %q, opens %d, version %d", st.Tier, st.Opens, st.Version)
	}
	return at
}

// checkFailedVersions: after version 2, a writer that dies before its
// commit leaves it; a reader released across version 3 reacquires stale
// and refreshes onto it at the same address at; versions larger than the
// kept addresses or smaller than what was taken are refused, the mapping
// kept.
func checkFailedVersions(t *testing.T, socket string, w *gpushm.Client, rs *gpushm.Segment, m *gpushm.Mapping, at uintptr, size int64) {
	t.Helper()
	ctx := context.Background()
	// A writer that dies before its commit leaves version 2.
	nextVersion(t, socket, "model", size, 9, "DIE=1")
	if _, err := rs.WaitVersion(ctx, 200*time.Millisecond); !errors.Is(err, syscall.ETIMEDOUT) {
		t.Fatalf("wait after a writer died before committing: %v, want ETIMEDOUT", err)
	}
	waitSegments(t, w, 1)
	if !bytes.Equal(mapped(t, m), pattern(2, size)) {
		t.Fatal("a writer that died changed version 2")
	}

	// Released across a new version: reacquire is stale, refresh
	// maps version 3.
	if err := m.Release(ctx); err != nil { // as Segment.Release
		t.Fatal(err)
	}
	nextVersion(t, socket, "model", size, 3)
	if err := m.Reacquire(ctx); !errors.Is(err, gpushm.ErrStale) {
		t.Fatalf("reacquire of a replaced version: %v, want ErrStale", err)
	}
	if changed, err := rs.Refresh(ctx); err != nil || !changed || addr(m) != at {
		t.Fatalf("refresh of a released segment: %v, %v, at %#x", changed, err, addr(m))
	}
	if !bytes.Equal(mapped(t, m), pattern(3, size)) || rs.Version() != 3 {
		t.Fatal("refreshed released mapping does not hold version 3")
	}
	waitSegments(t, w, 1)

	// A version larger than the kept addresses: EFBIG, and the
	// reader keeps what it has.
	nextVersion(t, socket, "model", 2*size+(64<<20), 4)
	if _, err := rs.Refresh(ctx); !errors.Is(err, syscall.EFBIG) {
		t.Fatalf("refresh onto a larger version: %v, want EFBIG", err)
	}
	if !bytes.Equal(mapped(t, m), pattern(3, size)) {
		t.Fatal("a refused refresh changed the mapping")
	}
	// A smaller version: what was taken of the mapping would reach
	// past its end. EINVAL, and the mapping is kept.
	nextVersion(t, socket, "model", size/2, 5)
	if _, err := rs.Refresh(ctx); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("refresh onto a smaller version: %v, want EINVAL", err)
	}
	if !bytes.Equal(mapped(t, m), pattern(3, size)) || addr(m) != at {
		t.Fatal("a refused refresh changed the mapping")
	}
}

func waitSegments(t *testing.T, c *gpushm.Client, n int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; {
		u := usage(t, c)
		if u.Segments == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d segments held, want %d", u.Segments, n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
