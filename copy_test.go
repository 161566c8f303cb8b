package gpushm_test

import (
	"bytes"
	"context"
	"hash/crc32"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/testdaemon"
)

// directWorks reports whether the file system under dir serves O_DIRECT
// reads at 4 KiB alignment.
func directWorks(t *testing.T, dir string) bool {
	t.Helper()
	path := filepath.Join(dir, "probe")
	if err := os.WriteFile(path, make([]byte, 8192), 0o644); err != nil {
		t.Fatal(err)
	}
	defer os.Remove(path)
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECT, 0)
	if err != nil {
		return false
	}
	defer unix.Close(fd)
	b, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(b)
	n, err := unix.Pread(fd, b, 4096)
	return err == nil && n == 4096
}

// TestLoadStoreFiles copies ranges at odd offsets and lengths, across many
// chunk boundaries and up to a file end that is not block-aligned, into a
// segment and back, through the page cache and with O_DIRECT.
func TestLoadStoreFiles(t *testing.T) {
	for _, backend := range testdaemon.Backends() {
		t.Run(backend, func(t *testing.T) {
			ctx := context.Background()
			d := testdaemon.Start(t, backend)
			c := dial(t, d.Socket)
			dir := t.TempDir()
			direct := directWorks(t, dir)
			t.Logf("O_DIRECT in %s: %v", dir, direct)
			const fileSize = 3<<20 + 12345
			data := pattern(11, fileSize)
			path := filepath.Join(dir, "src")
			if err := os.WriteFile(path, data, 0o644); err != nil {
				t.Fatal(err)
			}
			f, err := os.Open(path)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			const segSize = 4 << 20
			ranges := []gpushm.FileRange{
				{File: f, Off: 0, Len: 1, At: segSize - 1},                  // one byte, at the segment's end
				{File: f, Off: 4097, Len: 1<<20 + 3, At: 7},                 // unaligned both sides, many chunks
				{File: f, Off: 2 << 20, Len: fileSize - 2<<20, At: 2 << 20}, // to the file's unaligned end
				{File: f, Off: 100, Len: 0, At: 5},                          // nothing
				{File: f, Off: 65536, Len: 65536, At: 1<<20 + 4096},         // exactly one aligned chunk
			}
			want := make([]byte, segSize)
			var total int64
			for _, r := range ranges {
				copy(want[r.At:], data[r.Off:r.Off+r.Len])
				total += r.Len
			}
			seg, err := c.Create(ctx, "load", segSize, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer seg.Close()
			m, err := seg.Map()
			if err != nil {
				t.Fatal(err)
			}
			// Dropped from the page cache, the file is read with O_DIRECT
			// by auto; read back in, it is read through the cache.
			var fs unix.Statfs_t
			unix.Statfs(dir, &fs)
			evictable := fs.Type != unix.TMPFS_MAGIC
			// Chunks of 1 MiB are hashed in several pieces each.
			for _, mode := range []struct {
				name  string
				d     gpushm.Direct
				evict bool
				chunk int64
			}{
				{"never, evicted", gpushm.DirectNever, true, 64 << 10},
				{"always", gpushm.DirectAlways, false, 64 << 10},
				{"always, 1 MiB chunks", gpushm.DirectAlways, false, 1 << 20},
				{"auto, evicted", gpushm.DirectAuto, true, 64 << 10},
				{"auto, cached", gpushm.DirectAuto, false, 64 << 10},
				{"auto, cached, 1 MiB chunks", gpushm.DirectAuto, false, 1 << 20},
			} {
				if _, err := m.WriteAt(make([]byte, segSize), 0); err != nil {
					t.Fatal(err)
				}
				if mode.evict {
					f.Sync()
					unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
				} else {
					f.ReadAt(make([]byte, fileSize), 0)
				}
				var progress atomic.Int64
				st, err := m.LoadFiles(ranges, &gpushm.CopyOptions{Chunk: mode.chunk, Workers: 3, Direct: mode.d,
					Progress: func(n int64) { progress.Add(n) }, CRC32C: true})
				if err != nil {
					t.Fatalf("%s: LoadFiles: %v", mode.name, err)
				}
				got := make([]byte, segSize)
				if _, err := m.ReadAt(got, 0); err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got, want) {
					t.Fatalf("%s: the segment differs from the file ranges", mode.name)
				}
				// Each range's CRC-32C, hashed chunk by chunk as the copiers
				// read (out of order), combined by offset.
				if len(st.CRC32C) != len(ranges) {
					t.Fatalf("%s: %d checksums for %d ranges", mode.name, len(st.CRC32C), len(ranges))
				}
				for i, r := range ranges {
					if w := crc32.Checksum(data[r.Off:r.Off+r.Len], crc32.MakeTable(crc32.Castagnoli)); st.CRC32C[i] != w {
						t.Errorf("%s: range %d's CRC-32C = %08x, want %08x", mode.name, i, st.CRC32C[i], w)
					}
				}
				if st.Bytes != total || progress.Load() != total || st.Workers != 3 {
					t.Errorf("%s: stats %+v, progress %d; want %d bytes", mode.name, st, progress.Load(), total)
				}
				switch {
				case mode.d == gpushm.DirectNever && st.Direct != 0,
					mode.d == gpushm.DirectAlways && direct && st.Direct != total,
					!direct && st.Direct != 0,
					mode.d == gpushm.DirectAuto && mode.evict && direct && evictable && st.Direct == 0,
					mode.d == gpushm.DirectAuto && !mode.evict && st.Direct != 0:
					t.Errorf("%s: %d of %d bytes read with O_DIRECT (file system serves it: %v)", mode.name, st.Direct, total, direct)
				}
				t.Logf("%s: %+v", mode.name, st)
			}

			checkStoreFiles(t, m, dir, data, ranges)
			checkBadLoads(t, c, m, f, ranges, fileSize, segSize)
		})
	}
}

// checkStoreFiles is TestLoadStoreFiles's way back: the segment's ranges
// into a file, at other offsets.
func checkStoreFiles(t *testing.T, m *gpushm.Mapping, dir string, data []byte, ranges []gpushm.FileRange) {
	t.Helper()
	out, err := os.Create(filepath.Join(dir, "out"))
	if err != nil {
		t.Fatal(err)
	}
	defer out.Close()
	var back []gpushm.FileRange
	var off int64
	for _, r := range ranges {
		back = append(back, gpushm.FileRange{File: out, Off: off, Len: r.Len, At: r.At})
		off += r.Len + 1
	}
	if _, err := m.StoreFiles(back, &gpushm.CopyOptions{Chunk: 64 << 10}); err != nil {
		t.Fatal(err)
	}
	for i, r := range back {
		got := make([]byte, r.Len)
		if _, err := out.ReadAt(got, r.Off); err != nil && r.Len > 0 {
			t.Fatal(err)
		}
		if !bytes.Equal(got, data[ranges[i].Off:ranges[i].Off+r.Len]) {
			t.Errorf("StoreFiles range %d differs", i)
		}
	}
}

// checkBadLoads: TestLoadStoreFiles's bad requests fail without copying,
// and so does a load into a read-only mapping of the segment "load".
func checkBadLoads(t *testing.T, c *gpushm.Client, m *gpushm.Mapping, f *os.File, ranges []gpushm.FileRange, fileSize, segSize int64) {
	t.Helper()
	bad := []struct {
		name   string
		ranges []gpushm.FileRange
		o      *gpushm.CopyOptions
		want   string
	}{
		{"past the segment", []gpushm.FileRange{{File: f, Len: 10, At: segSize - 5}}, nil, "outside the segment"},
		{"negative", []gpushm.FileRange{{File: f, Off: -1, Len: 1}}, nil, "outside the segment"},
		{"no file", []gpushm.FileRange{{Len: 1}}, nil, "outside the segment"},
		{"odd chunk", ranges, &gpushm.CopyOptions{Chunk: 1000}, "not a positive multiple of 65536"},
		{"past the file", []gpushm.FileRange{{File: f, Off: fileSize - 10, Len: 20}}, nil, "got 10"},
		{"past the file, direct", []gpushm.FileRange{{File: f, Off: fileSize - 10, Len: 20}}, &gpushm.CopyOptions{Direct: gpushm.DirectAlways}, "got 10"},
	}
	for _, tc := range bad {
		if _, err := m.LoadFiles(tc.ranges, tc.o); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("LoadFiles (%s) = %v, want an error mentioning %q", tc.name, err, tc.want)
		}
	}
	ro, err := c.Open(context.Background(), "load", &gpushm.OpenOptions{ReadOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	rm, err := ro.Map()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rm.LoadFiles(ranges, nil); err == nil || !strings.Contains(err.Error(), "read-only") {
		t.Errorf("LoadFiles into a read-only mapping = %v", err)
	}
}
