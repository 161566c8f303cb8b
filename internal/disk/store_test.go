package disk

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
)

// pattern is n bytes of seed's own.
func pattern(n int64, seed uint64) mem {
	b := make(mem, n)
	r := rand.New(rand.NewPCG(seed, uint64(n)))
	for i := 0; i+8 <= len(b); i += 8 {
		v := r.Uint64()
		for k := range 8 {
			b[i+k] = byte(v >> (8 * k))
		}
	}
	for i := len(b) / 8 * 8; i < len(b); i++ {
		b[i] = byte(r.Uint32())
	}
	return b
}

// quiet is a logger for stores the test does not read the log of.
var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// tempDirs makes n directories for a store under root (a file system's
// mount point), removed when the test ends.
func tempDirs(t *testing.T, root string, n int) []string {
	t.Helper()
	if st, err := os.Stat(root); err != nil || !st.IsDir() {
		t.Skipf("no %s here: %v", root, err)
	}
	base, err := os.MkdirTemp(root, "gpushm-disk-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	var dirs []string
	for i := range n {
		dirs = append(dirs, filepath.Join(base, fmt.Sprintf("drive%d", i)))
	}
	return dirs
}

// fileSystems are where stores are tested: ext4 (or whatever /var/tmp is
// on) with O_DIRECT, and tmpfs.
var fileSystems = []struct{ name, root string }{
	{"vartmp", "/var/tmp"},
	{"tmpfs", "/dev/shm"},
}

func open(t *testing.T, dirs []string, o Options) *Store {
	t.Helper()
	if o.Log == nil {
		o.Log = quiet
	}
	s, err := Open(dirs, o)
	if err != nil {
		t.Fatalf("Open(%q) = %v", dirs, err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func write(t *testing.T, s *Store, key string, b mem, meta string) Entry {
	t.Helper()
	e, err := s.Write(context.Background(), key, int64(len(b)), []byte(meta), b)
	if err != nil {
		t.Fatalf("Write(%q, %d bytes) = %v", key, len(b), err)
	}
	return e
}

// readBack reads key and fails the test unless it holds want.
func readBack(t *testing.T, s *Store, key string, want mem) Entry {
	t.Helper()
	got := make(mem, len(want))
	e, err := s.Read(context.Background(), key, got)
	if err != nil {
		t.Fatalf("Read(%q) = %v", key, err)
	}
	if e.Size != int64(len(want)) {
		t.Fatalf("Read(%q): size %d, want %d", key, e.Size, len(want))
	}
	if i := firstDiff(got, want); i >= 0 {
		t.Fatalf("Read(%q): byte %d is %#x, want %#x", key, i, got[i], want[i])
	}
	return e
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	if len(a) != len(b) {
		return min(len(a), len(b))
	}
	return -1
}

const testChunk = 1 << 20

func TestRoundTrip(t *testing.T) {
	sizes := []int64{0, 1, 4095, 4096, testChunk, testChunk + 1, 3*testChunk - 512, 7*testChunk + 12345}
	for _, fsys := range fileSystems {
		for ndirs := 1; ndirs <= 3; ndirs++ {
			for _, buffered := range []bool{false, true} {
				t.Run(fmt.Sprintf("%s/%ddirs/buffered=%v", fsys.name, ndirs, buffered), func(t *testing.T) {
					s := open(t, tempDirs(t, fsys.root, ndirs), Options{Chunk: testChunk, buffered: buffered})
					if buffered && s.Direct() {
						t.Fatal("Direct() = true for a store told to write through the page cache")
					}
					for i, n := range sizes {
						want := pattern(n, uint64(i))
						key := fmt.Sprintf("segment/%d", n)
						e := write(t, s, key, want, "meta "+key)
						if e.Key != key || e.Size != n || string(e.Meta) != "meta "+key {
							t.Errorf("Write(%q) = %+v", key, e)
						}
						readBack(t, s, key, want)
					}
				})
			}
		}
	}
}

// TestStripes checks where the bytes go: chunk i in directory i mod n (from
// the key's first), each data file as long as its chunks, padded.
func TestStripes(t *testing.T) {
	dirs := tempDirs(t, "/var/tmp", 3)
	s := open(t, dirs, Options{Chunk: testChunk})
	size := int64(4*testChunk + 100)
	e := write(t, s, "k", pattern(size, 1), "")
	if len(e.Files) != 6 {
		t.Fatalf("Files = %q, want 3 data files and 3 manifests", e.Files)
	}
	var total int64
	lens := map[int64]int{}
	for _, f := range e.Files[:3] {
		st, err := os.Stat(f)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %v, want 0600", f, st.Mode())
		}
		total += st.Size()
		lens[st.Size()]++
	}
	if want := int64(4*testChunk + 4096); total != int64(want) || lens[2*testChunk] != 1 || lens[testChunk+4096] != 1 {
		t.Errorf("data files' lengths %v, %d in all; want 2 MiB, 1 MiB, 1 MiB + 4096", lens, total)
	}
	for _, d := range dirs {
		st, err := os.Stat(d)
		if err != nil {
			t.Fatal(err)
		}
		if st.Mode().Perm() != 0o700 {
			t.Errorf("%s: mode %v, want 0700", d, st.Mode())
		}
	}
}

func TestReopen(t *testing.T) {
	dirs := tempDirs(t, "/var/tmp", 3)
	s := open(t, dirs, Options{Chunk: testChunk})
	data := map[string]mem{}
	for i, n := range []int64{0, 10, 5*testChunk + 3} {
		key := fmt.Sprintf("key %d\x00with/slashes/../and nul", i)
		data[key] = pattern(n, uint64(i))
		write(t, s, key, data[key], "meta of "+key)
	}
	old := write(t, s, "replaced", pattern(3*testChunk, 9), "first")
	data["replaced"] = pattern(2*testChunk+7, 10)
	e := write(t, s, "replaced", data["replaced"], "second")
	if e.Gen <= old.Gen {
		t.Errorf("second Write's generation %d, first's %d", e.Gen, old.Gen)
	}
	for _, f := range old.Files {
		if _, err := os.Lstat(f); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("the replaced copy's %s: Lstat = %v, want it gone", f, err)
		}
	}
	write(t, s, "removed", pattern(100, 3), "")
	if err := s.Remove("removed"); err != nil {
		t.Fatal(err)
	}
	if err := s.Remove("removed"); !errors.Is(err, ErrNotExist) || !errors.Is(err, os.ErrNotExist) {
		t.Errorf("second Remove = %v, want ErrNotExist", err)
	}
	used, _ := s.Usage()
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	// Given in another order: the directories are known by their ids.
	s = open(t, []string{dirs[2], dirs[0], dirs[1]}, Options{Chunk: 4 * testChunk})
	if u, _ := s.Usage(); u != used {
		t.Errorf("Usage after reopen = %d, before Close %d", u, used)
	}
	var keys []string
	for _, e := range s.List() {
		keys = append(keys, e.Key)
		if want := "meta of " + e.Key; e.Key != "replaced" && string(e.Meta) != want || e.Key == "replaced" && string(e.Meta) != "second" {
			t.Errorf("List: %q has meta %q", e.Key, e.Meta)
		}
	}
	if want := slices.Sorted(maps.Keys(data)); !slices.Equal(keys, want) {
		t.Errorf("List after reopen = %q, want %q", keys, want)
	}
	for key, want := range data {
		readBack(t, s, key, want)
	}
	if _, err := s.Stat("removed"); !errors.Is(err, ErrNotExist) {
		t.Errorf("Stat of a removed key = %v, want ErrNotExist", err)
	}
}

// TestMissingDirectory: a copy striped over a directory not given to Open
// is kept but not served, and served again once it is given.
func TestMissingDirectory(t *testing.T) {
	dirs := tempDirs(t, "/var/tmp", 2)
	s := open(t, dirs, Options{Chunk: testChunk})
	want := pattern(3*testChunk, 1)
	write(t, s, "striped", want, "")
	s.Close()
	s = open(t, dirs[:1], Options{Chunk: testChunk})
	if _, err := s.Stat("striped"); !errors.Is(err, ErrNotExist) {
		t.Errorf("Stat of a copy half in a directory not given = %v, want ErrNotExist", err)
	}
	// A write meanwhile is newer than the copy kept.
	newer := pattern(100, 2)
	write(t, s, "striped", newer, "")
	s.Close()
	s = open(t, dirs, Options{Chunk: testChunk})
	readBack(t, s, "striped", newer)
	s.Close()
	names := 0
	for _, d := range dirs {
		ns, _ := os.ReadDir(d)
		names += len(ns)
	}
	if names != 4 { // an id file each, one manifest and one data file
		t.Errorf("%d files left in the directories, want 4: the older copy removed", names)
	}
}

func TestConcurrent(t *testing.T) {
	s := open(t, tempDirs(t, "/var/tmp", 2), Options{Chunk: testChunk})
	var wg sync.WaitGroup
	for i := range 6 {
		wg.Go(func() {
			key := fmt.Sprintf("k%d", i%3) // two writers a key
			for round := range 3 {
				b := pattern(int64(1+i)*testChunk/2+int64(round), uint64(i))
				if _, err := s.Write(context.Background(), key, int64(len(b)), nil, b); err != nil {
					t.Error(err)
					return
				}
				e, err := s.Stat(key)
				if err != nil {
					t.Error(err)
					return
				}
				// Another writer may replace it meanwhile, with a copy of
				// another size (the key's other writer's, up to three
				// chunks and a bit): whatever copy is read must be whole.
				got := make(mem, max(e.Size, 4*testChunk))
				if e, err = s.Read(context.Background(), key, got); err != nil && !errors.Is(err, ErrNotExist) {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	if n := len(s.List()); n != 3 {
		t.Errorf("List has %d copies, want 3", n)
	}
}

func TestBudget(t *testing.T) {
	s := open(t, tempDirs(t, "/var/tmp", 2), Options{Chunk: testChunk, Budget: 5 * testChunk})
	write(t, s, "a", pattern(2*testChunk, 1), "")
	// Replacing a counts both while the new copy is written.
	_, err := s.Write(context.Background(), "a", 3*testChunk, nil, pattern(3*testChunk, 2))
	if !errors.Is(err, ErrBudget) || !strings.Contains(err.Error(), "budget") {
		t.Fatalf("Write over the budget = %v, want ErrBudget", err)
	}
	if used, budget := s.Usage(); used > budget || used < 2*testChunk {
		t.Errorf("Usage = %d, %d", used, budget)
	}
	readBack(t, s, "a", pattern(2*testChunk, 1))
	write(t, s, "a", pattern(2*testChunk, 3), "")
}

func TestBadWrites(t *testing.T) {
	s := open(t, tempDirs(t, "/var/tmp", 1), Options{Chunk: testChunk})
	for _, tc := range []struct {
		name string
		key  string
		size int64
		meta []byte
	}{
		{"empty key", "", 1, nil},
		{"long key", strings.Repeat("k", MaxKey+1), 1, nil},
		{"negative size", "k", -1, nil},
		{"big meta", "k", 1, make([]byte, MaxMeta+1)},
	} {
		if _, err := s.Write(context.Background(), tc.key, tc.size, tc.meta, mem(make([]byte, 1))); err == nil {
			t.Errorf("%s: Write succeeded", tc.name)
		}
	}
	failing := errors.New("the GPU went away")
	_, err := s.Write(context.Background(), "k", 3*testChunk, nil, sourceFunc(func(p []byte, off int64) error {
		if off > 0 {
			return failing
		}
		return nil
	}))
	if !errors.Is(err, failing) {
		t.Errorf("Write from a failing source = %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := s.Write(ctx, "k", 3*testChunk, nil, pattern(3*testChunk, 1)); !errors.Is(err, context.Canceled) {
		t.Errorf("Write with a done context = %v", err)
	}
	assertOnly(t, s.dirs[0].path)
	if u, _ := s.Usage(); u != 0 {
		t.Errorf("Usage after failed writes = %d", u)
	}
}

type sourceFunc func(p []byte, off int64) error

func (f sourceFunc) ReadAt(p []byte, off int64) error { return f(p, off) }

// assertOnly fails the test if dir holds other files than its id and
// those of the copies given.
func assertOnly(t *testing.T, dir string, copies ...Entry) {
	t.Helper()
	want := []string{idFile}
	for _, e := range copies {
		for _, f := range e.Files {
			if filepath.Dir(f) == filepath.Clean(dir) {
				want = append(want, filepath.Base(f))
			}
		}
	}
	ns, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, n := range ns {
		got = append(got, n.Name())
	}
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("%s holds %q, want %q", dir, got, want)
	}
}
