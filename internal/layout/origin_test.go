package layout

import (
	"encoding/json"
	"github.com/gpushm/gpushm/internal/testutil"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/testdaemon"
)

// checkIdentity compares a record with what os.Stat (following links)
// says of path now, and with the CRC-32C of its bytes.
func checkIdentity(t *testing.T, path string, id Identity) {
	t.Helper()
	f := testdaemon.StatFile(t, path)
	want := Identity{Name: id.Name, Size: f.Size, MtimeNS: f.MtimeNS, CtimeNS: f.CtimeNS, Dev: f.Dev, Ino: f.Ino}.Sealed(f.CRC32C)
	if id != want {
		t.Errorf("%s: recorded %+v, want %+v", path, id, want)
	}
}

// TestTableRecordsOrigin scans a directory reached through a link, one of
// whose shards is a link to a blob elsewhere (a Hugging Face snapshot),
// and checks the shard table's records against the files.
func TestTableRecordsOrigin(t *testing.T) {
	root := t.TempDir()
	dir := filepath.Join(root, "snapshot")
	os.Mkdir(dir, 0o755)
	blobs := filepath.Join(root, "blobs")
	os.Mkdir(blobs, 0o755)
	testutil.WriteShard(t, filepath.Join(blobs, "3f9a"), nil, testutil.NewTensor("a", "F32", 1000, 3))
	if err := os.Symlink(filepath.Join(blobs, "3f9a"), filepath.Join(dir, "a.safetensors")); err != nil {
		t.Fatal(err)
	}
	testutil.WriteShard(t, filepath.Join(dir, "b.safetensors"), nil, testutil.NewTensor("b", "BF16", 7))
	writeFile(t, filepath.Join(dir, "config.json"), "{}")
	link := filepath.Join(root, "current")
	if err := os.Symlink("snapshot", link); err != nil {
		t.Fatal(err)
	}

	p, err := Scan(link)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	real, _ := filepath.EvalSymlinks(dir)
	raw, _ := p.Meta(false)
	meta, _, err := ParseMeta(raw, p.Size)
	if err != nil || meta.Origin == nil || meta.Origin.Dir != real {
		t.Fatalf("meta %s (%v), want origin dir %s", raw, err, real)
	}
	seg := segment(t, p)
	var tab struct {
		Version int `json:"version"`
		Shards  []struct {
			Name   string    `json:"name"`
			Origin *Identity `json:"origin"`
		} `json:"shards"`
	}
	if err := json.Unmarshal(seg[meta.Shards.At:meta.Shards.At+meta.Shards.Size], &tab); err != nil {
		t.Fatal(err)
	}
	if tab.Version != 1 || len(tab.Shards) != 2 {
		t.Fatalf("table %+v", tab)
	}
	for _, s := range tab.Shards {
		if s.Origin == nil || s.Origin.Name != "" {
			t.Fatalf("shard %s: origin %+v, want a record without a name", s.Name, s.Origin)
		}
		checkIdentity(t, filepath.Join(dir, s.Name), *s.Origin)
	}

	// Without checksums (an old daemon's fill), no records, and the table
	// keeps its room.
	tp, crcs, err := p.Table(nil)
	if err != nil || crcs != nil || int64(len(tp.Data)) != meta.Shards.Size || strings.Contains(string(tp.Data), "origin") {
		t.Fatalf("Table(nil) = %q, %v, %v", tp.Data, crcs, err)
	}
	if _, err := meta.Outputs(tp.Data, p.Size); err != nil {
		t.Fatalf("the padded table does not read back: %v", err)
	}
}

// TestTableRefusesChangedShard: a shard written between Scan and the end
// of the copy fails the put.
func TestTableRefusesChangedShard(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "a.safetensors")
	testutil.WriteShard(t, path, nil, testutil.NewTensor("a", "F32", 16))
	for _, tc := range []struct {
		name   string
		change func()
	}{
		{"appended", func() {
			f, _ := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
			f.Write([]byte{1})
			f.Close()
		}},
		{"rewritten in place", func() {
			f, _ := os.OpenFile(path, os.O_WRONLY, 0)
			f.WriteAt([]byte{9}, 100)
			f.Close()
			// Timestamps are coarse: make the change show whatever the
			// clock's grain.
			old := time.Unix(1, 0)
			os.Chtimes(path, old, old)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := Scan(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer p.Close()
			tc.change()
			if _, _, err := p.Table(make([]uint32, len(p.Shards))); err == nil || !strings.Contains(err.Error(), "changed while it was copied") {
				t.Fatalf("Table after the shard changed = %v, want an error saying so", err)
			}
		})
	}
}

func TestIdentitySame(t *testing.T) {
	id := Identity{Size: 10, MtimeNS: 5, CtimeNS: 6, Dev: 1, Ino: 2}
	for _, tc := range []struct {
		name string
		now  Identity
		ok   bool
	}{
		{"same", id, true},
		{"size", Identity{Size: 11, MtimeNS: 5, CtimeNS: 6, Dev: 1, Ino: 2}, false},
		{"mtime", Identity{Size: 10, MtimeNS: 7, CtimeNS: 6, Dev: 1, Ino: 2}, false},
		{"ctime", Identity{Size: 10, MtimeNS: 5, CtimeNS: 8, Dev: 1, Ino: 2}, false},
	} {
		if err := id.same("f", tc.now); (err == nil) != tc.ok {
			t.Errorf("%s: same = %v, want ok %v", tc.name, err, tc.ok)
		}
	}
}

func TestWithOrigin(t *testing.T) {
	id := Identity{Name: "m.safetensors", Size: 10, MtimeNS: 5, CtimeNS: 6, Dev: 1, Ino: 2}.Sealed(0xe3069283)
	raw, err := WithOrigin(json.RawMessage(`{"kind":"bundle","format":"safetensors","header_bytes":10,"tensors":1,"readonly":true}`), &Origin{Dir: "/m", Files: []Identity{id}})
	if err != nil {
		t.Fatal(err)
	}
	const want = `{"kind":"bundle","format":"safetensors","header_bytes":10,"tensors":1,"readonly":true,"origin":{"dir":"/m","files":[{"name":"m.safetensors","size":10,"mtime_ns":5,"ctime_ns":6,"dev":1,"ino":2,"crc32c":"e3069283"}]}}`
	if string(raw) != want {
		t.Errorf("WithOrigin = %s, want %s", raw, want)
	}
}
