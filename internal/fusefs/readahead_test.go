package fusefs_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/fusefs"
	"github.com/gpushm/gpushm/internal/testdaemon"
)

// forEachRead runs fn on each backend, with reads of host memory lent
// (the view's way) and read ahead (GPU memory's way, tried here on host
// memory too); GPU memory reads ahead either way.
func forEachRead(t *testing.T, fn func(t *testing.T, e *env, ahead bool)) {
	for _, b := range testdaemon.Backends() {
		for _, lend := range []bool{true, false} {
			name := b + "/readahead"
			if lend {
				name = b + "/lend"
			}
			t.Run(name, func(t *testing.T) {
				was := fusefs.SetLendReads(lend)
				e := mount(t, b)
				fusefs.SetLendReads(was)
				fn(t, e, !lend || b != "host")
			})
		}
	}
}

// readAt reads n bytes at off through f, as one request where it can.
func readAt(t *testing.T, f *os.File, n int, off int64) []byte {
	t.Helper()
	b := make([]byte, n)
	k, err := f.ReadAt(b, off)
	if err != nil && !errors.Is(err, io.EOF) {
		t.Fatalf("read %d bytes at %d: %v", n, off, err)
	}
	return b[:k]
}

// TestSequentialRead reads a file through the view as cp does (1 MiB at a
// time, from the start), then at random places, then past its end.
func TestSequentialRead(t *testing.T) {
	forEachRead(t, func(t *testing.T, e *env, ahead bool) {
		data := random(20, 24<<20+12345)
		if err := os.WriteFile(e.path("seq"), data, 0o600); err != nil {
			t.Fatal(err)
		}
		f, err := os.Open(e.path("seq"))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		h := sha256.New()
		if n, err := io.CopyBuffer(h, struct{ io.Reader }{f}, make([]byte, 1<<20)); err != nil || n != int64(len(data)) {
			t.Fatalf("read %d bytes: %v", n, err)
		}
		if got, want := h.Sum(nil), sha256.Sum256(data); !bytes.Equal(got, want[:]) {
			t.Fatalf("sha256 of the file read sequentially %x, want %x", got, want)
		}
		if served := fusefs.ReadAheadServed(e.srv); ahead && served == 0 {
			t.Fatal("nothing was served from read-ahead")
		} else if !ahead && served != 0 {
			t.Fatalf("%d requests served from read-ahead where reads are lent", served)
		}
		// A sequential run, then reads anywhere.
		for off := int64(0); off < 6<<20; off += 1 << 20 {
			if got := readAt(t, f, 1<<20, off); !bytes.Equal(got, data[off:off+1<<20]) {
				t.Fatalf("sequential read at %d differs", off)
			}
		}
		rng := rand.New(rand.NewPCG(1, 2))
		for range 200 {
			off := rng.Int64N(int64(len(data)))
			n := 1 + rng.IntN(2<<20)
			want := data[off:min(off+int64(n), int64(len(data)))]
			if got := readAt(t, f, n, off); !bytes.Equal(got, want) {
				t.Fatalf("read of %d bytes at %d: %d bytes, equal %v", n, off, len(got), bytes.Equal(got, want))
			}
		}
		// Past the end: the rest, then nothing.
		end := int64(len(data))
		for off := end - 3<<20; off < end; off += 1 << 20 {
			readAt(t, f, 1<<20, off)
		}
		if got := readAt(t, f, 1<<20, end-100); !bytes.Equal(got, data[end-100:]) {
			t.Fatalf("read across the end: %d bytes", len(got))
		}
		for _, off := range []int64{end, end + 1, end + 5<<20} {
			if got := readAt(t, f, 1<<20, off); len(got) != 0 {
				t.Fatalf("read at %d, past the end at %d: %d bytes", off, end, len(got))
			}
		}
	})
}

// TestReadAheadSeesWrites: a reader reading sequentially sees every write
// made before its request, through the view (a write, a mapping, a
// truncate) or by a socket client through its own mapping, whatever the
// daemon read ahead before it.
func TestReadAheadSeesWrites(t *testing.T) {
	forEachRead(t, func(t *testing.T, e *env, ahead bool) {
		ctx := context.Background()
		const mib = 1 << 20
		data := random(21, 32*mib)
		if err := os.WriteFile(e.path("w"), data, 0o600); err != nil {
			t.Fatal(err)
		}
		r, err := os.Open(e.path("w"))
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		next := int64(0)
		// reads reads sequentially up to end, checking each MiB, then
		// gives the daemon time to read ahead of it.
		reads := func(end int64) {
			t.Helper()
			for ; next < end; next += mib {
				want := data[next:min(next+mib, int64(len(data)))]
				if got := readAt(t, r, mib, next); !bytes.Equal(got, want) {
					t.Fatalf("read at %d MiB: %d bytes, equal %v", next/mib, len(got), bytes.Equal(got, want))
				}
			}
			time.Sleep(20 * time.Millisecond)
		}
		reads(4 * mib)

		// Through the view, ahead of the reader.
		w, err := os.OpenFile(e.path("w"), os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		patch := random(22, 5000)
		if _, err := w.WriteAt(patch, 5*mib-1000); err != nil {
			t.Fatal(err)
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		copy(data[5*mib-1000:], patch)
		reads(9 * mib)

		// By a socket client, through its mapping: while it holds the
		// segment open, and after it let go.
		seg, err := e.c.Open(ctx, "w", nil)
		if err != nil {
			t.Fatal(err)
		}
		m, err := seg.Map()
		if err != nil {
			t.Fatal(err)
		}
		patch = random(23, 3000)
		if _, err := m.WriteAt(patch, 10*mib+7); err != nil {
			t.Fatal(err)
		}
		copy(data[10*mib+7:], patch)
		reads(12 * mib)
		patch = random(24, 3000)
		if _, err := m.WriteAt(patch, 14*mib+7); err != nil {
			t.Fatal(err)
		}
		copy(data[14*mib+7:], patch)
		seg.Close()
		reads(16 * mib)

		// Through a mapping of the view, written back by msync, in a
		// process of its own (mmapChild).
		patch = random(25, 6000)
		if runMmapChild(t, "PATH_TO_MAP="+e.path("w"), "OFF="+strconv.Itoa(18*mib+11),
			"DATA="+hex.EncodeToString(patch), "MSYNC=1", "ENODEV_OK=1") == "enodev" {
			t.Log("this kernel maps no file opened for direct I/O (Linux 6.6 and later do): no mapping written")
		} else {
			copy(data[18*mib+11:], patch)
		}
		reads(21 * mib)

		// Truncated ahead of the reader, then grown back with zeros.
		if err := os.Truncate(e.path("w"), 23*mib+5); err != nil {
			t.Fatal(err)
		}
		data = data[:23*mib+5]
		reads(22 * mib)
		if err := os.Truncate(e.path("w"), 26*mib); err != nil {
			t.Fatal(err)
		}
		data = append(data, make([]byte, 26*mib-len(data))...)
		reads(26 * mib)
		if got := readAt(t, r, mib, next); len(got) != 0 {
			t.Fatalf("%d bytes past the end", len(got))
		}
	})
}

// TestGrowByAppends: a file grown by many appends has the right bytes and
// size, fits its allocation once closed, takes appends again after a
// socket client opened it (its memory then fixed in size, on host), and
// gives back all of its memory when removed.
func TestGrowByAppends(t *testing.T) {
	forEachBackend(t, func(t *testing.T, e *env) {
		ctx := context.Background()
		inf, err := e.c.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		start := inf.Usage
		var want []byte
		rng := rand.New(rand.NewPCG(3, 4))
		appends := func(n int, seed uint64) {
			t.Helper()
			f, err := os.OpenFile(e.path("a"), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
			if err != nil {
				t.Fatal(err)
			}
			for i := range n {
				b := random(seed+uint64(i), 1+rng.IntN(40000))
				if _, err := f.Write(b); err != nil {
					t.Fatalf("append %d: %v", i, err)
				}
				want = append(want, b...)
			}
			if err := f.Close(); err != nil {
				t.Fatal(err)
			}
		}
		check := func(what string) {
			t.Helper()
			st, err := os.Stat(e.path("a"))
			if err != nil || st.Size() != int64(len(want)) {
				t.Fatalf("%s: stat %v, size %d, want %d", what, err, st.Size(), len(want))
			}
			got, err := os.ReadFile(e.path("a"))
			if err != nil || !bytes.Equal(got, want) {
				t.Fatalf("%s: read through the view: equal %v, %v", what, bytes.Equal(got, want), err)
			}
			if got := e.segmentBytes(t, "a"); !bytes.Equal(got[:len(want)], want) || bytes.Count(got[len(want):], []byte{0}) != len(got)-len(want) {
				t.Fatalf("%s: the socket client reads other bytes", what)
			}
		}
		appends(1500, 100)
		check("grown by appends")
		// The slack of growing is given back once the last writer has
		// closed; the kernel releases the file a moment after close.
		seg, err := e.c.Stat(ctx, "a")
		if err != nil {
			t.Fatal(err)
		}
		gran := int64(4096)
		if inf.Backend == "cuda" {
			gran = 2 << 20
		}
		if fit := (seg.Size + gran - 1) / gran * gran; seg.AllocSize != fit {
			t.Fatalf("alloc_size %d for size %d, want %d", seg.AllocSize, seg.Size, fit)
		}
		xa := make([]byte, 32)
		if n, err := unix.Getxattr(e.path("a"), "user.gpushm.alloc_size", xa); err != nil || string(xa[:n]) != strconv.FormatInt(seg.AllocSize, 10) {
			t.Fatalf("user.gpushm.alloc_size %q, %v", xa[:max(n, 0)], err)
		}
		// A socket client opened it (check, above): appends go on.
		appends(300, 5000)
		check("after a socket client's open, more appends")

		if err := os.Remove(e.path("a")); err != nil {
			t.Fatal(err)
		}
		var now gpushm.Usage
		waitFor(t, "the daemon to give the file's memory back", func() bool {
			inf, err := e.c.Info(ctx)
			if err != nil {
				t.Fatal(err)
			}
			now = inf.Usage
			return now.Bytes == start.Bytes && now.Segments == start.Segments
		})
	})
}
