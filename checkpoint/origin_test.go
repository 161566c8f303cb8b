package checkpoint_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/checkpoint"
	"github.com/gpushm/gpushm/internal/testdaemon"
)

// record is an identity record as docs/protocol.md spells it.
type record struct {
	Name    string `json:"name"`
	Size    int64  `json:"size"`
	MtimeNS int64  `json:"mtime_ns"`
	CtimeNS int64  `json:"ctime_ns"`
	Dev     uint64 `json:"dev"`
	Ino     uint64 `json:"ino"`
	CRC32C  string `json:"crc32c"`
}

// wantRecord is what put should record of path: os.Stat's identity
// (following links) and the CRC-32C of the file's bytes.
func wantRecord(t *testing.T, path string) record {
	t.Helper()
	f := testdaemon.StatFile(t, path)
	return record{Size: f.Size, MtimeNS: f.MtimeNS, CtimeNS: f.CtimeNS, Dev: f.Dev, Ino: f.Ino, CRC32C: hex8(f.CRC32C)}
}

func hex8(v uint32) string { return fmt.Sprintf("%08x", v) }

// TestPutRecordsOrigin puts a checkpoint directory reached through a link,
// one of whose shards is a link into a blob directory (a Hugging Face
// snapshot), with either copier, and checks the meta's origin and each
// shard table entry's record against the files.
func TestPutRecordsOrigin(t *testing.T) {
	for _, backend := range testdaemon.Backends() {
		t.Run(backend, func(t *testing.T) {
			ctx := context.Background()
			c := startClient(t, backend)
			root := t.TempDir()
			snap := filepath.Join(root, "snapshots", "0123")
			blobs := filepath.Join(root, "blobs")
			os.MkdirAll(snap, 0o755)
			os.MkdirAll(blobs, 0o755)
			writeSafetensors(t, filepath.Join(snap, "model-00001-of-00002.safetensors"), 1, []string{"a", "b"}, []int{3<<20 + 1, 77})
			writeSafetensors(t, filepath.Join(blobs, "9f3c"), 2, []string{"c"}, []int{1<<20 + 5})
			if err := os.Symlink("../../blobs/9f3c", filepath.Join(snap, "model-00002-of-00002.safetensors")); err != nil {
				t.Fatal(err)
			}
			os.WriteFile(filepath.Join(snap, "config.json"), []byte(`{}`), 0o644)
			link := filepath.Join(root, "current")
			if err := os.Symlink(snap, link); err != nil {
				t.Fatal(err)
			}
			realDir, _ := filepath.EvalSymlinks(snap)

			for _, inDaemon := range []bool{false, true} {
				name := "client"
				if inDaemon {
					name = "daemon"
				}
				t.Run(name, func(t *testing.T) {
					ck, err := checkpoint.Open(link)
					if err != nil {
						t.Fatal(err)
					}
					defer ck.Close()
					st, err := checkpoint.Put(ctx, c, name, ck, &checkpoint.PutOptions{InDaemon: inDaemon, Copy: gpushm.CopyOptions{Chunk: 1 << 20, Workers: 3}})
					if err != nil {
						t.Fatal(err)
					}
					seg, err := c.Open(ctx, name, &gpushm.OpenOptions{ReadOnly: true})
					if err != nil {
						t.Fatal(err)
					}
					defer seg.Close()
					var meta struct {
						Source string `json:"source"`
						Shards struct {
							At   int64 `json:"offset"`
							Size int64 `json:"size"`
						} `json:"shards"`
						Origin struct {
							Dir   string   `json:"dir"`
							Files []record `json:"files"`
						} `json:"origin"`
					}
					if err := json.Unmarshal(seg.Info().Meta, &meta); err != nil {
						t.Fatal(err)
					}
					if meta.Source != "dir" || meta.Origin.Dir != realDir || meta.Origin.Files != nil {
						t.Errorf("meta %s: want source dir, origin {dir: %s} without files", seg.Info().Meta, realDir)
					}
					m, err := seg.Map()
					if err != nil {
						t.Fatal(err)
					}
					raw := make([]byte, meta.Shards.Size)
					if _, err := m.ReadAt(raw, meta.Shards.At); err != nil {
						t.Fatal(err)
					}
					var tab struct {
						Version int `json:"version"`
						Shards  []struct {
							Name   string  `json:"name"`
							Origin *record `json:"origin"`
						} `json:"shards"`
					}
					if err := json.Unmarshal(raw, &tab); err != nil {
						t.Fatalf("shard table %q: %v", raw, err)
					}
					if tab.Version != 1 || len(tab.Shards) != 2 || len(st.CRC32C) != 2 {
						t.Fatalf("table %s; stats' checksums %v", raw, st.CRC32C)
					}
					for i, s := range tab.Shards {
						want := wantRecord(t, filepath.Join(realDir, s.Name))
						if s.Origin == nil || *s.Origin != want {
							t.Errorf("shard %s: recorded %+v, want %+v", s.Name, s.Origin, want)
						}
						if hex8(st.CRC32C[i]) != want.CRC32C {
							t.Errorf("shard %s: Put's CRC32C %08x, want %s", s.Name, st.CRC32C[i], want.CRC32C)
						}
					}
					checkSources(t, c, name, realDir, tab.Shards[0].Name, tab.Shards[1].Name, inDaemon)
				})
			}
		})
	}
}

// checkSources: the daemon records each shard's data range it filled, by
// the file's own identity (what loaders trust, docs/security.md, "Files
// served from bundles"); a copy made by the client leaves no record.
func checkSources(t *testing.T, c *gpushm.Client, name, dir, shard0, shard1 string, inDaemon bool) {
	t.Helper()
	inf, err := c.Stat(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	if !inDaemon {
		if len(inf.Sources) != 0 {
			t.Errorf("a bundle copied by the client has sources %+v", inf.Sources)
		}
		return
	}
	for _, shard := range []string{shard0, shard1} {
		f := testdaemon.StatFile(t, filepath.Join(dir, shard))
		found := false
		for _, src := range inf.Sources {
			if src.Dev == f.Dev && src.Ino == f.Ino {
				found = true
				if src.Size != f.Size || src.MtimeNS != f.MtimeNS || src.CtimeNS != f.CtimeNS || src.Offset+src.Len != f.Size || src.Offset <= 8 {
					t.Errorf("shard %s: source %+v, want the data range of %+v", shard, src, f)
				}
			}
		}
		if !found {
			t.Errorf("shard %s: no source among %+v", shard, inf.Sources)
		}
	}
}
