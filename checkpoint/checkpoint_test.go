package checkpoint_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/checkpoint"
	"github.com/gpushm/gpushm/internal/testdaemon"
)

// startClient starts a daemon on backend for the test and returns a
// client of it, closed when the test ends.
func startClient(t *testing.T, backend string) *gpushm.Client {
	t.Helper()
	d := testdaemon.Start(t, backend)
	c, err := gpushm.Dial(context.Background(), d.Socket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func pattern(seed uint64, n int64) []byte {
	b := make([]byte, n)
	rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8)}).Read(b)
	return b
}

// writeSafetensors writes U8 tensors of the given sizes, filled from
// pattern, as the safetensors library lays a file out.
func writeSafetensors(t *testing.T, path string, seed uint64, names []string, sizes []int) {
	t.Helper()
	var hdr strings.Builder
	hdr.WriteString("{")
	off := 0
	for i, n := range names {
		if i > 0 {
			hdr.WriteString(",")
		}
		hdr.WriteString(`"` + n + `":{"dtype":"U8","shape":[` + strconv.Itoa(sizes[i]) + `],"data_offsets":[` + strconv.Itoa(off) + `,` + strconv.Itoa(off+sizes[i]) + `]}`)
		off += sizes[i]
	}
	hdr.WriteString("}")
	for hdr.Len()%8 != 0 {
		hdr.WriteString(" ")
	}
	b := binary.LittleEndian.AppendUint64(nil, uint64(hdr.Len()))
	b = append(append(b, hdr.String()...), pattern(seed, int64(off))...)
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestCheckpoint puts a sharded checkpoint directory through the Go API,
// reads its small files and tensors back, and writes the directory again.
func TestCheckpoint(t *testing.T) {
	for _, backend := range testdaemon.Backends() {
		t.Run(backend, func(t *testing.T) {
			ctx := context.Background()
			c := startClient(t, backend)
			dir := t.TempDir()
			writeSafetensors(t, filepath.Join(dir, "model-00001-of-00002.safetensors"), 1, []string{"a", "b"}, []int{3 << 20, 77})
			writeSafetensors(t, filepath.Join(dir, "model-00002-of-00002.safetensors"), 2, []string{"c"}, []int{1<<20 + 5})
			os.WriteFile(filepath.Join(dir, "model.safetensors.index.json"), []byte(`{"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00001-of-00002.safetensors","c":"model-00002-of-00002.safetensors"}}`), 0o644)
			os.WriteFile(filepath.Join(dir, "config.json"), []byte(`{"model_type":"llama"}`), 0o644)

			ck, err := checkpoint.Open(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer ck.Close()
			if ck.Tensors() != 3 || !slices.Equal(ck.Files(), []string{"config.json", "model.safetensors.index.json"}) || len(ck.Shards()) != 2 {
				t.Fatalf("checkpoint: %d tensors, files %v, shards %v", ck.Tensors(), ck.Files(), ck.Shards())
			}
			st, err := checkpoint.Put(ctx, c, "m", ck, &checkpoint.PutOptions{ReadOnlyDefault: true, Copy: gpushm.CopyOptions{Chunk: 1 << 20}})
			if err != nil {
				t.Fatal(err)
			}
			if want := int64(3<<20+77+1<<20+5) + ck.FileBytes(); st.Bytes != want {
				t.Errorf("copied %d bytes, want %d", st.Bytes, want)
			}
			seg, err := c.Open(ctx, "m", &gpushm.OpenOptions{ReadOnly: true})
			if err != nil {
				t.Fatal(err)
			}
			defer seg.Close()
			if !strings.Contains(string(seg.Info().Meta), `"readonly":true`) || seg.Size() != ck.Size() {
				t.Errorf("segment of %d bytes, meta %s", seg.Size(), seg.Info().Meta)
			}
			files, err := seg.Files()
			if err != nil {
				t.Fatal(err)
			}
			if string(files["config.json"]) != `{"model_type":"llama"}` || len(files) != 2 {
				t.Errorf("Files() = %q", files)
			}
			// Tensor c: the second shard's data, after the first's (3145805
			// bytes), 64-aligned.
			m, _ := seg.Map()
			var n [8]byte
			m.ReadAt(n[:], 0)
			hdr := make([]byte, binary.LittleEndian.Uint64(n[:]))
			m.ReadAt(hdr, 8)
			if !strings.Contains(string(hdr), `"c":{"dtype":"U8","shape":[1048581],"data_offsets":[3145856,4194437]}`) {
				t.Errorf("combined header: %s", hdr)
			}
			got := make([]byte, 1<<20+5)
			m.ReadAt(got, 8+int64(len(hdr))+3145856)
			if !bytes.Equal(got, pattern(2, 1<<20+5)) {
				t.Error("tensor c's bytes differ")
			}

			back := filepath.Join(t.TempDir(), "back")
			if _, err := checkpoint.Get(ctx, c, "m", back, &gpushm.CopyOptions{Workers: 2}); err != nil {
				t.Fatal(err)
			}
			ents, _ := os.ReadDir(dir)
			for _, e := range ents {
				a, _ := os.ReadFile(filepath.Join(dir, e.Name()))
				b, err := os.ReadFile(filepath.Join(back, e.Name()))
				if err != nil || !bytes.Equal(a, b) {
					t.Errorf("%s written back differs (%v)", e.Name(), err)
				}
			}
			if _, err := checkpoint.Get(ctx, c, "m", back, nil); err == nil || !strings.Contains(err.Error(), "not empty") {
				t.Errorf("GetCheckpoint into a full directory: %v", err)
			}
			if _, err := checkpoint.Put(ctx, c, "m", ck, nil); err == nil {
				t.Error("PutCheckpoint over an existing name succeeded")
			}
			c.Create(ctx, "plain", 10, nil)
			if _, err := checkpoint.Get(ctx, c, "plain", filepath.Join(t.TempDir(), "x"), nil); err == nil || !strings.Contains(err.Error(), "not a checkpoint directory's bundle") {
				t.Errorf("GetCheckpoint of a plain segment: %v", err)
			}
		})
	}
}
