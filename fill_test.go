package gpushm_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/gpushm/gpushm/internal/testdaemon"
)

// TestFillDump has the daemon copy a file into a segment and back, at odd
// offsets and lengths across the engine's chunks, the descriptor crossing
// the socket; and refuses what it must.
func TestFillDump(t *testing.T) {
	for _, backend := range testdaemon.Backends() {
		t.Run(backend, func(t *testing.T) {
			ctx := context.Background()
			d := testdaemon.Start(t, backend)
			c := dial(t, d.Socket)
			dir := t.TempDir()
			const size = 20<<20 + 4321
			data := pattern(7, size)
			src := filepath.Join(dir, "src")
			if err := os.WriteFile(src, data, 0o644); err != nil {
				t.Fatal(err)
			}
			f, err := os.Open(src)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			seg, err := c.Create(ctx, "f", size+100, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer seg.Close()
			const off, at = 999, 77
			n := int64(size - off)
			st, err := seg.Fill(ctx, f, off, at, n)
			if err != nil {
				t.Fatal(err)
			}
			if st.Bytes != n || st.Workers < 1 {
				t.Fatalf("fill stats %+v, want %d bytes", st, n)
			}
			m, err := seg.Map()
			if err != nil {
				t.Fatal(err)
			}
			got := make([]byte, n)
			if _, err := m.ReadAt(got, at); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, data[off:]) {
				t.Fatal("the segment does not hold the file's bytes")
			}

			out, err := os.Create(filepath.Join(dir, "out"))
			if err != nil {
				t.Fatal(err)
			}
			defer out.Close()
			if _, err := seg.Dump(ctx, out, 5, at, n); err != nil {
				t.Fatal(err)
			}
			back, err := os.ReadFile(out.Name())
			if err != nil {
				t.Fatal(err)
			}
			if int64(len(back)) != 5+n || !bytes.Equal(back[5:], data[off:]) {
				t.Fatalf("dump wrote %d bytes, not the segment's", len(back))
			}
			null, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer null.Close()
			if _, err := seg.Dump(ctx, null, 0, 0, size); err != nil {
				t.Fatalf("dump to %s: %v", os.DevNull, err)
			}

			// What must be refused, each with EINVAL, the segment intact.
			r, w, err := os.Pipe()
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			defer w.Close()
			for what, try := range map[string]func() error{
				"past the file's end": func() error { _, err := seg.Fill(ctx, f, off, 0, size); return err },
				"past the segment":    func() error { _, err := seg.Fill(ctx, f, 0, 200, size); return err },
				"a pipe":              func() error { _, err := seg.Fill(ctx, r, 0, 0, 10); return err },
				"a device, to fill":   func() error { _, err := seg.Fill(ctx, null, 0, 0, 10); return err },
				"a negative offset":   func() error { _, err := seg.Dump(ctx, out, -1, 0, 10); return err },
			} {
				if err := try(); !errors.Is(err, syscall.EINVAL) {
					t.Errorf("%s: %v, want EINVAL", what, err)
				}
			}
			if _, err := m.ReadAt(got, at); err != nil || !bytes.Equal(got, data[off:]) {
				t.Fatal("a refused fill changed the segment")
			}
		})
	}
}
