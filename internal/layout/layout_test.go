package layout

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/gpushm/gpushm/internal/crc32c"
	"github.com/gpushm/gpushm/internal/safetensors"
	"github.com/gpushm/gpushm/internal/testutil"
)

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

func writeIndex(t *testing.T, dir string, wm map[string]string) {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"metadata": map[string]int{"total_size": 1}, "weight_map": wm})
	writeFile(t, filepath.Join(dir, "model.safetensors.index.json"), string(b))
}

// fixture is a sharded checkpoint directory with an index, small files and
// things that are not kept. It returns every tensor's bytes.
func fixture(t *testing.T) (string, map[string][]byte) {
	dir := t.TempDir()
	all := map[string][]byte{}
	add := func(m map[string][]byte) {
		for k, v := range m {
			all[k] = v
		}
	}
	add(testutil.WriteShard(t, filepath.Join(dir, "model-00001-of-00002.safetensors"), map[string]string{"format": "pt"},
		testutil.NewTensor("model.embed_tokens.weight", "BF16", 33, 16),
		testutil.NewTensor("model.norm.weight", "F32", 16),
		testutil.NewTensor("odd", "U8", 7), // leaves the shard's data a length that is not a multiple of 64
	))
	add(testutil.WriteShard(t, filepath.Join(dir, "model-00002-of-00002.safetensors"), map[string]string{"format": "pt"},
		testutil.NewTensor("model.layers.0.mlp.up_proj.weight", "F16", 24, 16),
		testutil.NewTensor("model.layers.0.mlp.down_proj.weight", "F16", 16, 24),
		testutil.NewTensor("scalar", "I64"),
		testutil.NewTensor("empty", "F32", 0, 4),
	))
	wm := map[string]string{}
	for _, n := range []string{"model.embed_tokens.weight", "model.norm.weight", "odd"} {
		wm[n] = "model-00001-of-00002.safetensors"
	}
	for _, n := range []string{"model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight", "scalar", "empty"} {
		wm[n] = "model-00002-of-00002.safetensors"
	}
	writeIndex(t, dir, wm)
	writeFile(t, filepath.Join(dir, "config.json"), `{"model_type": "llama"}`)
	writeFile(t, filepath.Join(dir, "tokenizer.model"), "\x00\x01binary tokenizer")
	writeFile(t, filepath.Join(dir, "empty.txt"), "")
	// Not kept: an unindexed safetensors file, a directory, a big file.
	testutil.WriteShard(t, filepath.Join(dir, "consolidated.safetensors"), nil, testutil.NewTensor("x", "U8", 3))
	os.Mkdir(filepath.Join(dir, "original"), 0o755)
	big, _ := os.Create(filepath.Join(dir, "pytorch_model.bin"))
	big.Truncate(MaxFileSize + 1) // sparse: no disk used
	big.Close()
	// A link, as in a Hugging Face cache snapshot, is followed.
	blob := filepath.Join(t.TempDir(), "blob")
	writeFile(t, blob, "linked")
	if err := os.Symlink(blob, filepath.Join(dir, "tokenizer_config.json")); err != nil {
		t.Fatal(err)
	}
	return dir, all
}

// segment does what a loader does with a plan, in memory.
func segment(t *testing.T, p *Plan) []byte {
	t.Helper()
	seg := make([]byte, p.Size)
	for _, pc := range p.Pieces() {
		copy(seg[pc.At:], pc.Data)
	}
	var sums []uint32
	for i, r := range p.Ranges() {
		if _, err := r.File.ReadAt(seg[r.At:r.At+r.Len], r.Off); err != nil && r.Len > 0 {
			t.Fatal(err)
		}
		if i < len(p.Shards) {
			sums = append(sums, crc32c.Checksum(seg[r.At:r.At+r.Len]))
		}
	}
	tab, _, err := p.Table(sums)
	if err != nil {
		t.Fatal(err)
	}
	copy(seg[tab.At:], tab.Data)
	return seg
}

func TestScanLayout(t *testing.T) {
	dir, tensors := fixture(t)
	os.Symlink(filepath.Join(dir, "nowhere"), filepath.Join(dir, "dangling"))
	p, err := Scan(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if got := []string{p.Shards[0].Name, p.Shards[1].Name}; len(p.Shards) != 2 || got[0] != "model-00001-of-00002.safetensors" {
		t.Fatalf("shards %v", p.Shards)
	}
	var files []string
	for _, f := range p.Files {
		files = append(files, f.Name)
	}
	if want := []string{"config.json", "empty.txt", "model.safetensors.index.json", "tokenizer.model", "tokenizer_config.json"}; !slices.Equal(files, want) {
		t.Errorf("files %v, want %v", files, want)
	}
	skipped := strings.Join(p.Skipped, "; ")
	for _, want := range []string{"consolidated.safetensors (a safetensors file the index does not name)", "original/ (a directory)", "pytorch_model.bin (67108865 bytes, over the 64 MiB limit", "dangling (unreadable"} {
		if !strings.Contains(skipped, want) {
			t.Errorf("skipped %q lacks %q", skipped, want)
		}
	}
	if p.Tensors != len(tensors) {
		t.Errorf("%d tensors, want %d", p.Tensors, len(tensors))
	}

	seg := segment(t, p)
	raw, err := p.Meta(true)
	if err != nil {
		t.Fatal(err)
	}
	meta, ok, err := ParseMeta(raw, p.Size)
	if !ok || err != nil {
		t.Fatalf("ParseMeta(%s) = %v, %v", raw, ok, err)
	}
	if !meta.ReadOnly || meta.Source != "dir" || meta.Tensors != len(tensors) {
		t.Errorf("meta %s", raw)
	}
	if real, _ := filepath.EvalSymlinks(dir); meta.Origin == nil || meta.Origin.Dir != real || len(meta.Origin.Files) != 0 {
		t.Errorf("meta's origin %+v, want the directory %s", meta.Origin, real)
	}
	// The segment's start is a safetensors file of every tensor.
	end := 8 + meta.HeaderBytes + p.DataBytes
	h, err := safetensors.Read(bytes.NewReader(seg[:end]), end)
	if err != nil {
		t.Fatalf("the bundle's safetensors part: %v", err)
	}
	if (8+h.Len)%Align != 0 || h.Metadata["format"] != "pt" {
		t.Errorf("data starts at %d; metadata %v", 8+h.Len, h.Metadata)
	}
	for _, x := range h.Tensors {
		b := int64(8+h.Len) + int64(x.Begin)
		if !bytes.Equal(seg[b:b+int64(x.End-x.Begin)], tensors[x.Name]) {
			t.Errorf("tensor %s: bytes differ", x.Name)
		}
		delete(tensors, x.Name)
	}
	if len(tensors) > 0 {
		t.Errorf("tensors missing from the bundle: %v", tensors)
	}
	for _, s := range p.Shards {
		if s.DataAt%Align != 0 {
			t.Errorf("shard %s data at %d", s.Name, s.DataAt)
		}
	}
	// The files come back byte for byte.
	outs, err := meta.Outputs(seg[meta.Shards.At:meta.Shards.At+meta.Shards.Size], p.Size)
	if err != nil {
		t.Fatal(err)
	}
	if len(outs) != 7 {
		t.Errorf("%d files to write back, want 7", len(outs))
	}
	for _, o := range outs {
		var got []byte
		for _, r := range o.Pieces {
			got = append(got, seg[r.At:r.At+r.Size]...)
		}
		want, err := os.ReadFile(filepath.Join(dir, o.Name))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, want) || o.Size() != int64(len(want)) {
			t.Errorf("%s: %d bytes back, differing from the %d-byte original", o.Name, len(got), len(want))
		}
	}
}

func TestScanWithoutIndexTakesEveryShard(t *testing.T) {
	dir := t.TempDir()
	testutil.WriteShard(t, filepath.Join(dir, "b.safetensors"), nil, testutil.NewTensor("b", "F32", 2))
	testutil.WriteShard(t, filepath.Join(dir, "a.safetensors"), nil, testutil.NewTensor("a", "F32", 2))
	p, err := Scan(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if len(p.Shards) != 2 || p.Shards[0].Name != "a.safetensors" || len(p.Files) != 0 {
		t.Fatalf("shards %+v, files %+v", p.Shards, p.Files)
	}
}

func TestScanErrors(t *testing.T) {
	good := testutil.NewTensor("w", "F32", 4)
	tests := []struct {
		name    string
		setup   func(t *testing.T, dir string)
		wantErr string
	}{
		{"no safetensors", func(t *testing.T, dir string) {
			writeFile(t, filepath.Join(dir, "config.json"), "{}")
		}, "has no *.safetensors files"},
		{"only other weights", func(t *testing.T, dir string) {
			writeFile(t, filepath.Join(dir, "pytorch_model.bin"), "x")
		}, "only safetensors checkpoints are read; convert pytorch_model.bin first"},
		{"shard missing from the index", func(t *testing.T, dir string) {
			testutil.WriteShard(t, filepath.Join(dir, "model-00001-of-00002.safetensors"), nil, good)
			writeIndex(t, dir, map[string]string{"w": "model-00001-of-00002.safetensors", "v": "model-00002-of-00002.safetensors"})
		}, "model.safetensors.index.json names shard model-00002-of-00002.safetensors, which is not in"},
		{"corrupt header", func(t *testing.T, dir string) {
			b := binary.LittleEndian.AppendUint64(nil, 9)
			writeFile(t, filepath.Join(dir, "model.safetensors"), string(append(b, `{"w":{"dt`...)))
		}, "model.safetensors is not a valid safetensors file: tensor \"w\": the JSON ends early"},
		{"unknown dtype", func(t *testing.T, dir string) {
			h := `{"w":{"dtype":"Q4","shape":[4],"data_offsets":[0,2]}}`
			writeFile(t, filepath.Join(dir, "model.safetensors"), string(binary.LittleEndian.AppendUint64(nil, uint64(len(h))))+h+"xx")
		}, `model.safetensors is not a valid safetensors file: tensor "w": unknown dtype "Q4"`},
		{"offsets out of range", func(t *testing.T, dir string) {
			h := `{"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}`
			writeFile(t, filepath.Join(dir, "model.safetensors"), string(binary.LittleEndian.AppendUint64(nil, uint64(len(h))))+h+"xx")
		}, "are outside the 2 data bytes"},
		{"tensor in two shards", func(t *testing.T, dir string) {
			testutil.WriteShard(t, filepath.Join(dir, "a.safetensors"), nil, good)
			testutil.WriteShard(t, filepath.Join(dir, "b.safetensors"), nil, good)
		}, `tensor "w" is in both`},
		{"index names a tensor its shard lacks", func(t *testing.T, dir string) {
			testutil.WriteShard(t, filepath.Join(dir, "a.safetensors"), nil, good)
			writeIndex(t, dir, map[string]string{"w": "a.safetensors", "gone": "a.safetensors"})
		}, `says tensor "gone" is in`},
		{"index names the wrong shard", func(t *testing.T, dir string) {
			testutil.WriteShard(t, filepath.Join(dir, "a.safetensors"), nil, good)
			testutil.WriteShard(t, filepath.Join(dir, "b.safetensors"), nil, testutil.NewTensor("v", "U8", 1))
			writeIndex(t, dir, map[string]string{"w": "b.safetensors", "v": "b.safetensors"})
		}, `b.safetensors, which has no such tensor`},
		{"index points outside the directory", func(t *testing.T, dir string) {
			writeIndex(t, dir, map[string]string{"w": "../a.safetensors"})
		}, "which is not a .safetensors file in the same directory"},
		{"index is not JSON", func(t *testing.T, dir string) {
			writeFile(t, filepath.Join(dir, "model.safetensors.index.json"), "{")
		}, "is not a safetensors index"},
		{"index too big", func(t *testing.T, dir string) {
			f, _ := os.Create(filepath.Join(dir, "model.safetensors.index.json"))
			f.Truncate(MaxFileSize + 1)
			f.Close()
		}, "is over 64 MiB: not an index"},
		{"two indexes", func(t *testing.T, dir string) {
			writeIndex(t, dir, map[string]string{"w": "a.safetensors"})
			writeFile(t, filepath.Join(dir, "other.safetensors.index.json"), "{}")
		}, "has 2 safetensors indexes"},
		{"a shard that is not a file", func(t *testing.T, dir string) {
			os.Mkdir(filepath.Join(dir, "a.safetensors"), 0o755)
			testutil.WriteShard(t, filepath.Join(dir, "b.safetensors"), nil, good)
			writeIndex(t, dir, map[string]string{"w": "a.safetensors"})
		}, "names shard a.safetensors, which is not in"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			tc.setup(t, dir)
			p, err := Scan(dir)
			if err == nil {
				p.Close()
				t.Fatalf("Scan succeeded; want error mentioning %q", tc.wantErr)
			}
			if !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("Scan: %v\nwant error mentioning %q", err, tc.wantErr)
			}
		})
	}
	if _, err := Scan(filepath.Join(t.TempDir(), "missing")); err == nil {
		t.Error("Scan of a missing directory succeeded")
	}
}

func TestTooManyFilesForMeta(t *testing.T) {
	dir := t.TempDir()
	testutil.WriteShard(t, filepath.Join(dir, "a.safetensors"), nil, testutil.NewTensor("w", "U8", 1))
	for i := range 200 {
		writeFile(t, filepath.Join(dir, strings.Repeat("n", 150)+string(rune('a'+i%26))+strings.Repeat("x", i/26)), "")
	}
	if _, err := Scan(dir); err == nil || !strings.Contains(err.Error(), "over the limit of 32768") {
		t.Fatalf("Scan = %v, want the meta limit", err)
	}
}

func TestParseMetaAndOutputsRefuseHostileNames(t *testing.T) {
	const size = 1000
	tests := []struct {
		name, meta, table, wantErr string
	}{
		{"file escapes", `{"kind":"bundle","format":"safetensors","header_bytes":10,"tensors":0,"source":"dir","files":[{"name":"../x","offset":0,"size":1}],"shards":{"offset":0,"size":2}}`, "", `file name "../x" is not a plain file name`},
		{"file outside the segment", `{"kind":"bundle","format":"safetensors","header_bytes":10,"tensors":0,"source":"dir","files":[{"name":"x","offset":999,"size":2}],"shards":{"offset":0,"size":2}}`, "", "lies outside the segment"},
		{"table outside the segment", `{"kind":"bundle","format":"safetensors","header_bytes":10,"tensors":0,"source":"dir","shards":{"offset":-1,"size":2}}`, "", "shard table"},
		{"header_bytes too big", `{"kind":"bundle","format":"safetensors","header_bytes":1000,"tensors":0}`, "", "does not fit"},
		{"shard name escapes", `{"kind":"bundle","format":"safetensors","header_bytes":10,"tensors":0,"source":"dir","shards":{"offset":0,"size":2}}`, `{"version":1,"shards":[{"name":"/etc/passwd","header":[0,8],"data":[8,8]}]}`, "not a plain file name"},
		{"shard outside", `{"kind":"bundle","format":"safetensors","header_bytes":10,"tensors":0,"source":"dir","shards":{"offset":0,"size":2}}`, `{"version":1,"shards":[{"name":"a","header":[0,8],"data":[8,5000]}]}`, "lies outside"},
		{"twice", `{"kind":"bundle","format":"safetensors","header_bytes":10,"tensors":0,"source":"dir","files":[{"name":"a","offset":0,"size":1}],"shards":{"offset":0,"size":2}}`, `{"version":1,"shards":[{"name":"a","header":[0,8],"data":[8,8]}]}`, "listed twice"},
		{"unknown version", `{"kind":"bundle","format":"safetensors","header_bytes":10,"tensors":0,"source":"dir","shards":{"offset":0,"size":2}}`, `{"version":2,"shards":[]}`, "version 2"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m, ok, err := ParseMeta(json.RawMessage(tc.meta), size)
			if !ok {
				t.Fatal("not recognized as a bundle")
			}
			if err == nil {
				_, err = m.Outputs([]byte(tc.table), size)
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Fatalf("err = %v, want one mentioning %q", err, tc.wantErr)
			}
		})
	}
	if _, ok, _ := ParseMeta(json.RawMessage(`{"kind":"tensor"}`), size); ok {
		t.Error("tensor meta taken for a bundle")
	}
}

// safetensorsFile lays out header JSON and data as a safetensors file.
func safetensorsFile(header string, data []byte) []byte {
	b := binary.LittleEndian.AppendUint64(nil, uint64(len(header)))
	return append(append(b, header...), data...)
}

func TestFileMeta(t *testing.T) {
	const good = `{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}`
	dir := t.TempDir()
	tests := []struct {
		name     string
		file     string
		content  []byte
		readOnly bool
		wantMeta string // "" for none
		wantErr  string
	}{
		{"named", "m.safetensors", safetensorsFile(good, make([]byte, 16)), false, `{"kind":"bundle","format":"safetensors","header_bytes":57,"tensors":1}`, ""},
		{"read-only default", "r.safetensors", safetensorsFile(good, make([]byte, 16)), true, `{"kind":"bundle","format":"safetensors","header_bytes":57,"tensors":1,"readonly":true}`, ""},
		{"by content", "m.bin", safetensorsFile(good, make([]byte, 16)), false, `{"kind":"bundle","format":"safetensors","header_bytes":57,"tensors":1}`, ""},
		{"other bytes", "x.bin", []byte("just some bytes, not a header"), false, "", ""},
		{"broken, other extension", "y.bin", safetensorsFile(`{"a":1}`, nil), false, "", ""},
		{"broken, named", "b.safetensors", safetensorsFile(`{"w":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}}`, make([]byte, 16)), false, "", `b.safetensors is not a valid safetensors file: tensor "w": data_offsets [0, 32] are outside the 16 data bytes`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(dir, tc.file)
			if err := os.WriteFile(path, tc.content, 0o644); err != nil {
				t.Fatal(err)
			}
			f, err := os.Open(path)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			meta, err := FileMeta(f, int64(len(tc.content)), tc.readOnly)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("FileMeta = %s, %v; want error mentioning %q", meta, err, tc.wantErr)
				}
				return
			}
			if err != nil || string(meta) != tc.wantMeta {
				t.Fatalf("FileMeta = %s, %v; want %s", meta, err, tc.wantMeta)
			}
			if off, _ := f.Seek(0, 1); off != 0 {
				t.Fatalf("file offset moved to %d", off)
			}
		})
	}
}
