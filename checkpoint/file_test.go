package checkpoint_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/checkpoint"
	"github.com/gpushm/gpushm/internal/testdaemon"
)

// counted is a Progress that counts what it is told.
type counted struct {
	total, added atomic.Int64
	done         atomic.Bool
	err          error
}

func (p *counted) Add(n int64) { p.added.Add(n) }

func (p *counted) Done(err error) {
	p.err = err
	p.done.Store(true)
}

func (p *counted) start(total int64) checkpoint.Progress {
	p.total.Store(total)
	return p
}

// putFile opens path and puts it as name.
func putFile(t *testing.T, c *gpushm.Client, name, path string, o *checkpoint.PutFileOptions) (checkpoint.Copied, error) {
	t.Helper()
	f, err := checkpoint.OpenFile(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	return checkpoint.PutFile(context.Background(), c, name, f, o)
}

// TestPutGetFile: a file goes into a segment of its size and back out,
// whoever copies, into a file, a directory, or a file it replaces (whose
// permission bits stay); progress is told of every byte.
func TestPutGetFile(t *testing.T) {
	for _, backend := range testdaemon.Backends() {
		t.Run(backend, func(t *testing.T) {
			ctx := context.Background()
			c := startClient(t, backend)
			dir := t.TempDir()
			src := filepath.Join(dir, "data.bin")
			data := pattern(7, 3<<20+11)
			os.WriteFile(src, data, 0o644)
			for _, inDaemon := range []bool{false, true} {
				name := fmt.Sprintf("data-%v", inDaemon)
				var p counted
				res, err := putFile(t, c, name, src, &checkpoint.PutFileOptions{
					PutOptions: checkpoint.PutOptions{InDaemon: inDaemon}, Meta: json.RawMessage(`{"k":1}`), Progress: p.start})
				if err != nil {
					t.Fatal(err)
				}
				want := map[bool]string{false: "client", true: "daemon"}[inDaemon]
				if res.Bytes != int64(len(data)) || res.Copier != want || res.CRC32C != "" || res.File != src {
					t.Errorf("PutFile (InDaemon %v) = %+v; want %d bytes copied by the %s, no checksum", inDaemon, res, len(data), want)
				}
				if p.total.Load() != int64(len(data)) || p.added.Load() != int64(len(data)) || !p.done.Load() || p.err != nil {
					t.Errorf("PutFile's progress: total %d, added %d, done %v (%v); want %d", p.total.Load(), p.added.Load(), p.done.Load(), p.err, len(data))
				}
				if s, err := c.Stat(ctx, name); err != nil || string(s.Meta) != `{"k":1}` || s.Uncommitted {
					t.Errorf("Stat(%s) = %+v, %v; want the meta given, committed", name, s, err)
				}

				into := t.TempDir()
				old := filepath.Join(into, "old")
				os.WriteFile(old, []byte("old"), 0o640)
				for _, path := range []string{old, into + "/", filepath.Join(into, "new")} {
					var p counted
					res, err := checkpoint.GetFile(ctx, c, name, path, &checkpoint.GetFileOptions{InDaemon: inDaemon, Progress: p.start})
					if err != nil {
						t.Fatalf("GetFile(%s, %s): %v", name, path, err)
					}
					got, _ := os.ReadFile(res.File)
					if !bytes.Equal(got, data) || res.Copier != want || p.added.Load() != int64(len(data)) || !p.done.Load() {
						t.Errorf("GetFile(%s, %s) = %+v: %d bytes, progress %d; want the file's %d, copied by the %s",
							name, path, res, len(got), p.added.Load(), len(data), want)
					}
				}
				if res, _ := checkpoint.GetFile(ctx, c, name, into+"/", nil); res.File != filepath.Join(into, name) {
					t.Errorf("GetFile into a directory wrote %s, want %s", res.File, filepath.Join(into, name))
				}
				if st, err := os.Stat(old); err != nil || st.Mode().Perm() != 0o640 {
					t.Errorf("a file GetFile replaced: %v, %v; want mode 0640 kept", st.Mode(), err)
				}
			}
			if _, err := checkpoint.GetFile(ctx, c, "data-true", filepath.Join(dir, "none", "x"), nil); err == nil {
				t.Error("GetFile into a directory that is not there succeeded")
			}
			if ents, _ := os.ReadDir(dir); len(ents) != 1 {
				t.Errorf("GetFile left files behind: %v", ents)
			}
		})
	}
}

// TestPutFileBundle: a safetensors file becomes a tensor bundle that
// records where it came from, its checksum included, marked read-only by
// default if asked; meta of its own is refused, as is read-only by
// default for a file that is not a bundle.
func TestPutFileBundle(t *testing.T) {
	ctx := context.Background()
	c := startClient(t, "host")
	dir := t.TempDir()
	src := filepath.Join(dir, "model.safetensors")
	writeSafetensors(t, src, 3, []string{"w"}, []int{1 << 20})
	want := testdaemon.StatFile(t, src)
	for _, inDaemon := range []bool{false, true} {
		name := fmt.Sprintf("m-%v", inDaemon)
		res, err := putFile(t, c, name, src, &checkpoint.PutFileOptions{PutOptions: checkpoint.PutOptions{InDaemon: inDaemon, ReadOnlyDefault: true}})
		if err != nil {
			t.Fatal(err)
		}
		if res.CRC32C != fmt.Sprintf("%08x", want.CRC32C) {
			t.Errorf("PutFile (InDaemon %v): CRC-32C %q, want %08x", inDaemon, res.CRC32C, want.CRC32C)
		}
		s, err := c.Stat(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		var meta struct {
			Kind     string
			ReadOnly bool `json:"readonly"`
			Origin   struct {
				Dir   string
				Files []struct {
					Name   string
					Ino    uint64
					CRC32C string
				}
			}
		}
		json.Unmarshal(s.Meta, &meta)
		if f := meta.Origin.Files; meta.Kind != "bundle" || !meta.ReadOnly || meta.Origin.Dir == "" || len(f) != 1 ||
			f[0].Name != "model.safetensors" || f[0].Ino != want.Ino || f[0].CRC32C != res.CRC32C {
			t.Errorf("meta of a put safetensors file: %s", s.Meta)
		}
	}
	if _, err := putFile(t, c, "x", src, &checkpoint.PutFileOptions{Meta: json.RawMessage(`1`)}); err == nil {
		t.Error("PutFile of a bundle with meta of its own succeeded")
	}
	plain := filepath.Join(dir, "plain.bin")
	os.WriteFile(plain, []byte("plain"), 0o644)
	if _, err := putFile(t, c, "y", plain, &checkpoint.PutFileOptions{PutOptions: checkpoint.PutOptions{ReadOnlyDefault: true}}); err == nil {
		t.Error("PutFile of a plain file, read-only by default, succeeded")
	}
	bad := filepath.Join(dir, "bad.safetensors")
	os.WriteFile(bad, []byte("not a header"), 0o644)
	if _, err := checkpoint.OpenFile(ctx, bad); err == nil || !strings.Contains(err.Error(), "not a valid safetensors file") {
		t.Errorf("OpenFile of a broken safetensors file: %v", err)
	}
	if names, _ := c.List(ctx); len(names) != 2 {
		t.Errorf("after refused puts: %d segments, want the 2 put", len(names))
	}
}

// TestEmptyFile: an empty file puts as an empty segment, which reads as
// an empty file, and replaces a segment in one step with NextVersion,
// keeping its mode.
func TestEmptyFile(t *testing.T) {
	ctx := context.Background()
	c := startClient(t, "host")
	dir := t.TempDir()
	empty := filepath.Join(dir, "empty")
	os.WriteFile(empty, nil, 0o644)
	if _, err := putFile(t, c, "e", empty, nil); err != nil {
		t.Fatal(err)
	}
	if seg, err := checkpoint.OpenRead(ctx, c, "e", 0); seg != nil || err != nil {
		t.Errorf("OpenRead of an empty segment = %v, %v; want nil, nil", seg, err)
	}
	out := filepath.Join(dir, "out")
	if res, err := checkpoint.GetFile(ctx, c, "e", out, nil); err != nil || res.Bytes != 0 {
		t.Fatalf("GetFile of an empty segment = %+v, %v", res, err)
	}
	if st, err := os.Stat(out); err != nil || st.Size() != 0 {
		t.Errorf("GetFile of an empty segment wrote %v, %v; want an empty file", st, err)
	}

	mode := uint32(0o640)
	if _, _, err := c.CreateOnly(ctx, "r", 4096, &gpushm.CreateOptions{Mode: &mode}); err != nil {
		t.Fatal(err)
	}
	if _, err := putFile(t, c, "r", empty, nil); err == nil {
		t.Error("PutFile over an existing name succeeded")
	}
	o := &checkpoint.PutFileOptions{PutOptions: checkpoint.PutOptions{NextVersion: true}}
	if _, err := putFile(t, c, "r", empty, o); err != nil {
		t.Fatal(err)
	}
	segs, _ := c.List(ctx)
	if s, err := c.Stat(ctx, "r"); err != nil || s.Size != 0 || s.Mode != 0o640 || len(segs) != 2 {
		t.Errorf("r replaced by an empty file: %+v, %v, %d segments; want empty, mode 0640, and nothing beside", s, err, len(segs))
	}
}

// TestGetFileDir: a bundle put from a directory is written back as the
// directory, or as one file with Raw.
func TestGetFileDir(t *testing.T) {
	ctx := context.Background()
	c := startClient(t, "host")
	dir := t.TempDir()
	writeSafetensors(t, filepath.Join(dir, "model.safetensors"), 4, []string{"w"}, []int{4096})
	os.WriteFile(filepath.Join(dir, "config.json"), []byte(`{}`), 0o644)
	ck, err := checkpoint.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	if _, err := checkpoint.Put(ctx, c, "k", ck, nil); err != nil {
		t.Fatal(err)
	}
	back := filepath.Join(t.TempDir(), "back")
	res, err := checkpoint.GetFile(ctx, c, "k", back, nil)
	if err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(filepath.Join(dir, "model.safetensors"))
	b, _ := os.ReadFile(filepath.Join(back, "model.safetensors"))
	if res.File != back || !bytes.Equal(a, b) {
		t.Errorf("GetFile of a directory's bundle = %+v; the shard written back differs: %v", res, !bytes.Equal(a, b))
	}
	raw := filepath.Join(t.TempDir(), "raw")
	res, err = checkpoint.GetFile(ctx, c, "k", raw, &checkpoint.GetFileOptions{Raw: true})
	if st, serr := os.Stat(raw); err != nil || serr != nil || !st.Mode().IsRegular() || st.Size() != ck.Size() || res.Bytes != ck.Size() {
		t.Errorf("GetFile, Raw, of a directory's bundle = %+v, %v; want one file of %d bytes", res, err, ck.Size())
	}
}
