package cli

import (
	"bytes"
	"context"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/progress"
	"github.com/gpushm/gpushm/internal/safetensors"
	"github.com/gpushm/gpushm/internal/testutil"
)

const goodHeader = `{"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]},"e":{"dtype":"F4","shape":[0],"data_offsets":[22,22]}}   `

func TestPutSafetensors(t *testing.T) {
	dir, _ := cliDaemon(t)

	data := make([]byte, 22)
	for i := range data {
		data[i] = byte(i)
	}
	file := testutil.SafetensorsFile(goodHeader, data)
	good := filepath.Join(dir, "model.safetensors")
	os.WriteFile(good, file, 0o644)
	mustRun(t, nil, "put", "model", good)
	want := `meta:        {"kind":"bundle","format":"safetensors","header_bytes":` + strconv.Itoa(len(goodHeader)) + `,"tensors":3,"origin":{"dir":`
	if out := mustRun(t, nil, "stat", "model"); !strings.Contains(out, want) {
		t.Fatalf("stat lacks %q:\n%s", want, out)
	}
	// The segment is the file, byte for byte.
	if got := mustRun(t, nil, "get", "model", "-"); got != string(file) {
		t.Fatalf("get returned %d bytes that differ from the %d-byte file", len(got), len(file))
	}
	// From a pipe the name says nothing; the content does.
	mustRun(t, file, "put", "piped", "-")
	if out := mustRun(t, nil, "stat", "piped"); !strings.Contains(out, `"kind":"bundle"`) {
		t.Fatalf("stat of a piped safetensors file lacks the bundle meta:\n%s", out)
	}
	// Other files keep no meta.
	plain := filepath.Join(dir, "plain.bin")
	os.WriteFile(plain, []byte("plain bytes"), 0o644)
	mustRun(t, nil, "put", "plain", plain)
	if out := mustRun(t, nil, "stat", "plain"); strings.Contains(out, "meta:") {
		t.Fatalf("a plain file got meta:\n%s", out)
	}

	// A malformed header fails before anything is allocated.
	bad := filepath.Join(dir, "bad.safetensors")
	os.WriteFile(bad, testutil.SafetensorsFile(`{"w":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}}`, make([]byte, 16)), 0o644)
	mustFail(t, "bad.safetensors is not a valid safetensors file: tensor \"w\": data_offsets [0, 32] are outside the 16 data bytes", "put", "bad", bad)
	mustFail(t, "no such segment", "stat", "bad")
	if out := mustRun(t, nil, "info"); !strings.Contains(out, "3 named") {
		t.Fatalf("info after the failed put:\n%s", out)
	}
}

// pt is the metadata PyTorch's safetensors writer leaves in a shard.
var pt = map[string]string{"format": "pt"}

// checkpointDir is a small sharded checkpoint with an index and the files
// that come with one, plus things put leaves out.
func checkpointDir(t *testing.T, root string) string {
	dir := filepath.Join(root, "ckpt")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	testutil.WriteShard(t, filepath.Join(dir, "model-00001-of-00002.safetensors"), pt, testutil.NewTensor("a.weight", "U8", 300000), testutil.NewTensor("b.bias", "U8", 13))
	testutil.WriteShard(t, filepath.Join(dir, "model-00002-of-00002.safetensors"), pt, testutil.NewTensor("c.weight", "U8", 70000))
	os.WriteFile(filepath.Join(dir, "model.safetensors.index.json"), []byte(`{"metadata":{"total_size":370013},"weight_map":{"a.weight":"model-00001-of-00002.safetensors","b.bias":"model-00001-of-00002.safetensors","c.weight":"model-00002-of-00002.safetensors"}}`), 0o644)
	os.WriteFile(filepath.Join(dir, "config.json"), []byte(`{"model_type":"llama","hidden_size":8}`), 0o644)
	os.WriteFile(filepath.Join(dir, "generation_config.json"), []byte(`{"do_sample":false}`), 0o644)
	os.WriteFile(filepath.Join(dir, "tokenizer.json"), bytes.Repeat([]byte("tok "), 5000), 0o644)
	os.WriteFile(filepath.Join(dir, "special_tokens_map.json"), []byte(`{}`), 0o644)
	testutil.WriteShard(t, filepath.Join(dir, "consolidated.safetensors"), pt, testutil.NewTensor("x", "U8", 10))
	os.Mkdir(filepath.Join(dir, "original"), 0o755)
	return dir
}

func TestPutGetDir(t *testing.T) {
	root := testutil.SocketDir(t)
	sock := filepath.Join(root, "gpushm.sock")
	startDaemonProc(t, sock)
	t.Setenv("GPUSHM_SOCKET", sock)
	dir := checkpointDir(t, root)

	r := cli(t, nil, "put", "llama", dir)
	if r.code != 0 {
		t.Fatalf("put: %s", r.stderr)
	}
	if want := "put llama: not kept: consolidated.safetensors (a safetensors file the index does not name), original/ (a directory)"; !strings.HasPrefix(r.stderr, want) {
		// A notice, not an error: it does not start "gpushm: " as they do.
		t.Errorf("put said %q, want %q first", r.stderr, want)
	}
	out := mustRun(t, nil, "stat", "llama")
	for _, want := range []string{`"kind":"bundle","format":"safetensors"`, `"tensors":3`, `"source":"dir"`, `{"name":"config.json","offset":`, `"shards":{"offset":`} {
		if !strings.Contains(out, want) {
			t.Errorf("stat lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "readonly") {
		t.Errorf("meta says readonly without --readonly-default:\n%s", out)
	}

	// Back as a directory: every kept file byte for byte, nothing else.
	back := filepath.Join(root, "back")
	mustRun(t, nil, "get", "llama", back)
	kept := []string{"config.json", "generation_config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json", "special_tokens_map.json", "tokenizer.json"}
	ents, _ := os.ReadDir(back)
	var got []string
	for _, e := range ents {
		got = append(got, e.Name())
	}
	if !slices.Equal(got, kept) {
		t.Fatalf("get wrote %v, want %v", got, kept)
	}
	for _, name := range kept {
		a, _ := os.ReadFile(filepath.Join(dir, name))
		b, _ := os.ReadFile(filepath.Join(back, name))
		if !bytes.Equal(a, b) {
			t.Errorf("%s: %d bytes back differ from the %d-byte original", name, len(b), len(a))
		}
	}
	mustFail(t, "is not empty", "get", "llama", back)

	// The raw bytes start with a safetensors file naming every tensor.
	raw := []byte(mustRun(t, nil, "get", "llama", "-"))
	h, err := safetensors.Read(bytes.NewReader(raw), int64(len(raw)))
	if err != nil || len(h.Tensors) != 3 || h.Tensors[2].Name != "c.weight" {
		t.Fatalf("the bundle's header: %+v, %v", h, err)
	}
	rawPath := filepath.Join(root, "raw.bin")
	mustRun(t, nil, "get", "--raw", "llama", rawPath)
	if b, _ := os.ReadFile(rawPath); !bytes.Equal(b, raw) {
		t.Error("get --raw differs from get -")
	}

	// Tuning flags, O_DIRECT, and the read-only mark.
	r = cli(t, nil, "put", "-v", "--readonly-default", "--direct", "always", "--workers", "2", "--chunk", "64KiB", "llama2", dir)
	if r.code != 0 || !strings.Contains(r.stderr, "2 copiers, 64 KiB chunks") || !strings.Contains(r.stderr, "3 tensors in 2 shards, 5 small files") {
		t.Fatalf("put -v: exit %d: %s", r.code, r.stderr)
	}
	if out := mustRun(t, nil, "stat", "llama2"); !strings.Contains(out, `"readonly":true`) {
		t.Errorf("--readonly-default left no mark:\n%s", out)
	}
	back2 := filepath.Join(root, "back2")
	mustRun(t, nil, "get", "llama2", back2)
	for _, name := range kept {
		a, _ := os.ReadFile(filepath.Join(dir, name))
		b, _ := os.ReadFile(filepath.Join(back2, name))
		if !bytes.Equal(a, b) {
			t.Errorf("%s (O_DIRECT put): differs", name)
		}
	}
	mustFail(t, "--chunk 1000: want a positive multiple of 64KiB", "put", "x", dir, "--chunk", "1000")
	mustFail(t, `--direct "sometimes"`, "put", "x", dir, "--direct", "sometimes")
	plain := filepath.Join(root, "plain.bin")
	os.WriteFile(plain, []byte("plain"), 0o644)
	mustFail(t, "--readonly-default is for tensor bundles", "put", "x", plain, "--readonly-default")
	mustFail(t, "exists", "put", "llama", dir)
}

// TestPutDirBadInput: each bad checkpoint fails naming the file, before
// anything is allocated, and leaves no segment.
func TestPutDirBadInput(t *testing.T) {
	root := testutil.SocketDir(t)
	sock := filepath.Join(root, "gpushm.sock")
	startDaemonProc(t, sock)
	t.Setenv("GPUSHM_SOCKET", sock)
	tests := []struct {
		name  string
		setup func(dir string)
		want  string
	}{
		{"shard missing from the index", func(dir string) {
			os.Remove(filepath.Join(dir, "model-00002-of-00002.safetensors"))
		}, "model.safetensors.index.json names shard model-00002-of-00002.safetensors, which is not in"},
		{"corrupt header", func(dir string) {
			os.WriteFile(filepath.Join(dir, "model-00002-of-00002.safetensors"), testutil.SafetensorsFile(`{"c.weight":{"dtype":"U8","shape":[7],"data_offsets":[0,7]`, make([]byte, 7)), 0o644)
		}, "model-00002-of-00002.safetensors is not a valid safetensors file"},
		{"two shards name the same tensor", func(dir string) {
			testutil.WriteShard(t, filepath.Join(dir, "model-00002-of-00002.safetensors"), pt, testutil.NewTensor("a.weight", "U8", 10), testutil.NewTensor("c.weight", "U8", 10))
		}, `tensor "a.weight" is in both`},
		{"unknown dtype", func(dir string) {
			os.WriteFile(filepath.Join(dir, "model-00002-of-00002.safetensors"), testutil.SafetensorsFile(`{"c.weight":{"dtype":"Q4_K","shape":[7],"data_offsets":[0,7]}}`, make([]byte, 7)), 0o644)
		}, `model-00002-of-00002.safetensors is not a valid safetensors file: tensor "c.weight": unknown dtype "Q4_K"`},
		{"no safetensors", func(dir string) {
			for _, n := range []string{"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "consolidated.safetensors", "model.safetensors.index.json"} {
				os.Remove(filepath.Join(dir, n))
			}
		}, "has no *.safetensors files"},
		{"data past the end", func(dir string) {
			os.WriteFile(filepath.Join(dir, "model-00002-of-00002.safetensors"), testutil.SafetensorsFile(`{"c.weight":{"dtype":"U8","shape":[70],"data_offsets":[0,70]}}`, make([]byte, 7)), 0o644)
		}, "model-00002-of-00002.safetensors is not a valid safetensors file: tensor \"c.weight\": data_offsets [0, 70] are outside the 7 data bytes"},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := checkpointDir(t, filepath.Join(root, strconv.Itoa(i)))
			tc.setup(dir)
			mustFail(t, tc.want, "put", "m", dir)
			mustFail(t, "no such segment", "stat", "m")
			if out := mustRun(t, nil, "info"); !strings.Contains(out, "0 named") {
				t.Fatalf("info after the failed put:\n%s", out)
			}
		})
	}
}

// TestProgressNeverWaits runs put and get of copies big enough for a
// progress bar with standard error sent where no bar belongs (/dev/null, a
// pipe, a file): each must finish, with the bytes intact. /dev/null is a
// character device, which once passed for a terminal and left get waiting
// for a bar that was never drawn.
func TestProgressNeverWaits(t *testing.T) {
	root := testutil.SocketDir(t)
	sock := filepath.Join(root, "gpushm.sock")
	startDaemonProc(t, sock)
	t.Setenv("GPUSHM_SOCKET", sock)

	// A sparse file past the bar's threshold, with marks to compare.
	size := int64(progress.Min + 4<<20)
	file := filepath.Join(root, "big.bin")
	f, err := os.Create(file)
	if err != nil {
		t.Fatal(err)
	}
	for _, off := range []int64{0, size / 2, size - 8} {
		f.WriteAt([]byte("gpushm!!"), off)
	}
	f.Close()
	dir := filepath.Join(root, "ckpt")
	os.Mkdir(dir, 0o755)
	n := (size / 4) &^ 7
	hdr := `{"w":{"dtype":"F32","shape":[` + strconv.FormatInt(n, 10) + `],"data_offsets":[0,` + strconv.FormatInt(4*n, 10) + `]}}`
	hdr += strings.Repeat(" ", (8-len(hdr)%8)%8)
	shard := filepath.Join(dir, "model.safetensors")
	if err := os.WriteFile(shard, testutil.SafetensorsFile(hdr, nil), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(shard, int64(8+len(hdr))+4*n); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(dir, "config.json"), []byte(`{"model_type":"llama"}`), 0o644)

	sinks := map[string]func(t *testing.T) (io.Writer, *os.File){
		"devnull": func(t *testing.T) (io.Writer, *os.File) {
			f, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			return nil, f
		},
		"pipe": func(t *testing.T) (io.Writer, *os.File) { return new(bytes.Buffer), nil },
		"file": func(t *testing.T) (io.Writer, *os.File) {
			f, err := os.Create(filepath.Join(t.TempDir(), "stderr"))
			if err != nil {
				t.Fatal(err)
			}
			return nil, f
		},
	}
	for sink, open := range sinks {
		t.Run(sink, func(t *testing.T) {
			run := func(stdin string, args ...string) {
				t.Helper()
				ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
				defer cancel()
				cmd := exec.CommandContext(ctx, os.Args[0], args...)
				w, f := open(t)
				if f != nil {
					defer f.Close()
					cmd.Stderr = f
				} else {
					cmd.Stderr = w
				}
				if stdin != "" {
					in, err := os.Open(stdin)
					if err != nil {
						t.Fatal(err)
					}
					defer in.Close()
					cmd.Stdin = in
				}
				if err := cmd.Run(); err != nil {
					t.Fatalf("gpushm %v with stderr to %s: %v (a wait on a progress bar?)", args, sink, err)
				}
			}
			out := t.TempDir()
			run("", "put", "file-"+sink, file)
			run(file, "put", "stdin-"+sink, "-")
			run("", "put", "dir-"+sink, dir)
			run("", "get", "file-"+sink, filepath.Join(out, "file"))
			run("", "get", "stdin-"+sink, filepath.Join(out, "stdin"))
			run("", "get", "dir-"+sink, filepath.Join(out, "dir"))
			for _, p := range [][2]string{{file, "file"}, {file, "stdin"}, {shard, "dir/model.safetensors"}} {
				if !sameFile(t, p[0], filepath.Join(out, p[1])) {
					t.Errorf("get %s: the bytes differ from %s", p[1], p[0])
				}
			}
			mustRun(t, nil, "rm", "file-"+sink, "stdin-"+sink, "dir-"+sink)
		})
	}
}

// sameFile compares two files a chunk at a time.
func sameFile(t *testing.T, a, b string) bool {
	t.Helper()
	fa, err := os.Open(a)
	if err != nil {
		t.Fatal(err)
	}
	defer fa.Close()
	fb, err := os.Open(b)
	if err != nil {
		t.Fatal(err)
	}
	defer fb.Close()
	ba, bb := make([]byte, 1<<20), make([]byte, 1<<20)
	for {
		na, ea := io.ReadFull(fa, ba)
		nb, eb := io.ReadFull(fb, bb)
		if na != nb || !bytes.Equal(ba[:na], bb[:nb]) {
			return false
		}
		if ea != nil || eb != nil {
			return ea == eb || (ea == io.ErrUnexpectedEOF && eb == io.ErrUnexpectedEOF && na == nb)
		}
	}
}

// TestGetToFIFO: get into a FIFO (a shell's process substitution, say) is
// copied by the client, since the daemon writes only regular files and
// /dev/null, /dev/zero and /dev/full; the reader gets every byte.
func TestGetToFIFO(t *testing.T) {
	root := testutil.SocketDir(t)
	sock := filepath.Join(root, "gpushm.sock")
	startDaemonProc(t, sock)
	t.Setenv("GPUSHM_SOCKET", sock)
	data := make([]byte, 3<<20+5)
	rand.NewChaCha8([32]byte{9}).Read(data)
	in := filepath.Join(root, "in")
	os.WriteFile(in, data, 0o644)
	mustRun(t, nil, "put", "f", in)
	fifo := filepath.Join(root, "fifo")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	got := make(chan []byte)
	go func() {
		b, _ := os.ReadFile(fifo)
		got <- b
	}()
	mustRun(t, nil, "get", "f", fifo)
	if b := <-got; !bytes.Equal(b, data) {
		t.Fatalf("get into a FIFO: the reader got %d bytes, want the segment's %d", len(b), len(data))
	}
}

// TestPutTakesCreateFlags: put takes what create takes, --ttl, --meta,
// --pin and --mode; --meta only where the segment's meta is not a bundle's
// layout.
func TestPutTakesCreateFlags(t *testing.T) {
	dir, _ := cliDaemon(t)
	src := filepath.Join(dir, "src")
	os.WriteFile(src, []byte("some bytes"), 0o644)

	mustRun(t, nil, "put", "p", src, "--ttl", "1h", "--meta", `{"k":1}`, "--pin", "--mode", "0640")
	var seg map[string]any
	decode(t, mustRun(t, nil, "stat", "p", "-o", "json"), &seg)
	want := map[string]any{"ttl_seconds": float64(3600), "meta": map[string]any{"k": float64(1)}, "pinned": true, "mode": "0640", "size": float64(10)}
	for k, v := range want {
		if !equalJSON(map[string]any{k: seg[k]}, map[string]any{k: v}) {
			t.Errorf("put --ttl 1h --meta {\"k\":1} --pin --mode 0640: %s is %v, want %v", k, seg[k], v)
		}
	}
	st := filepath.Join(dir, "model.safetensors")
	os.WriteFile(st, testutil.SafetensorsFile(goodHeader, make([]byte, 22)), 0o644)
	mustFail(t, "--meta: "+st+" is a safetensors file", "put", "s", st, "--meta", `{"k":1}`)
	ck := filepath.Join(dir, "ck")
	os.Mkdir(ck, 0o755)
	mustFail(t, "--meta: "+ck+" is a checkpoint directory", "put", "d", ck, "--meta", `{"k":1}`)
	if r := cli(t, nil, "put", "x", src, "--meta", "{"); r.code != exitcode.Usage {
		t.Errorf("put --meta {: exit %d, want %d", r.code, exitcode.Usage)
	}
	if out := mustRun(t, nil, "ls", "-o", "name"); out != "p\n" {
		t.Errorf("after the refused puts, ls says %q", out)
	}
}

// TestPutForce: --force replaces a name in one step, as --new-version
// does (both spellings work), and makes a name that is not there.
func TestPutForce(t *testing.T) {
	dir, _ := cliDaemon(t)
	v := func(i uint64) string {
		p := filepath.Join(dir, "v"+strconv.FormatUint(i, 10))
		os.WriteFile(p, remapBytes(i, 5000), 0o644)
		return p
	}
	check := func(what string, version int, seed uint64) {
		t.Helper()
		out := mustRun(t, nil, "stat", "w")
		if got := mustRun(t, nil, "cat", "w"); got != string(remapBytes(seed, 5000)) || !strings.Contains(out, "version:     "+strconv.Itoa(version)+"\n") {
			t.Fatalf("after %s: version or bytes not the copy's:\n%s", what, out)
		}
	}
	mustRun(t, nil, "put", "--force", "w", v(1)) // no w yet
	check("put --force of a new name", 1, 1)
	r := cli(t, nil, "put", "w", v(2))
	if r.code != exitcode.Exists || r.stderr != "gpushm: put w: segment exists ('gpushm put --force w ...' replaces it)\n" {
		t.Errorf("put of a name there: exit %d, %q", r.code, r.stderr)
	}
	mustRun(t, nil, "put", "-f", "w", v(2))
	check("put -f", 2, 2)
	mustRun(t, nil, "put", "--new-version", "w", v(3))
	check("put --new-version", 3, 3)
}

// TestEmptyFiles: an empty file puts as an empty segment, which gets
// back as an empty file, cats as nothing, and is replaced (--force) in one
// step too.
func TestEmptyFiles(t *testing.T) {
	dir, _ := cliDaemon(t)
	empty, full := filepath.Join(dir, "empty"), filepath.Join(dir, "full")
	os.WriteFile(empty, nil, 0o644)
	os.WriteFile(full, []byte("not empty"), 0o644)

	mustRun(t, nil, "put", "e", empty)
	mustRun(t, []byte{}, "put", "e2", "-")
	var segs []map[string]any
	decode(t, mustRun(t, nil, "ls", "-o", "json"), &segs)
	if len(segs) != 2 || segs[0]["size"] != float64(0) || segs[0]["alloc_size"] != float64(0) || segs[1]["size"] != float64(0) {
		t.Fatalf("ls after putting an empty file and empty standard input: %v", segs)
	}
	out := filepath.Join(dir, "out")
	os.WriteFile(out, []byte("old contents"), 0o640)
	mustRun(t, nil, "get", "e", out)
	if b, err := os.ReadFile(out); err != nil || len(b) != 0 {
		t.Errorf("get of an empty segment over a file: %q, %v; want an empty file", b, err)
	}
	if got := mustRun(t, nil, "get", "e", "-"); got != "" {
		t.Errorf("get e - said %q", got)
	}
	if got := mustRun(t, nil, "cat", "e", "e2"); got != "" {
		t.Errorf("cat of empty segments said %q", got)
	}
	mustFail(t, "segment exists", "put", "e", empty)

	// Replaced: by a copy, then by an empty file again, keeping the mode.
	mustRun(t, nil, "chmod", "0640", "e")
	mustRun(t, nil, "put", "--force", "e", full)
	if got := mustRun(t, nil, "cat", "e"); got != "not empty" {
		t.Errorf("cat after put --force of a file over an empty segment: %q", got)
	}
	mustRun(t, nil, "put", "--force", "e", empty)
	segs = nil
	decode(t, mustRun(t, nil, "ls", "-o", "json"), &segs)
	if len(segs) != 2 || segs[0]["name"] != "e" || segs[0]["size"] != float64(0) || segs[0]["mode"] != "0640" {
		t.Errorf("ls after put --force of an empty file: %v; want e empty, mode 0640, and nothing else made", segs)
	}
	mustRun(t, nil, "put", "--force", "e3", empty) // not there yet
	if got := mustRun(t, nil, "ls", "-o", "name"); got != "e\ne2\ne3\n" {
		t.Errorf("ls -o name: %q", got)
	}
}

// TestGetIntoDirectory: get NAME DIR writes DIR/NAME, as cp writes a file
// into a directory; DIR/ must be one.
func TestGetIntoDirectory(t *testing.T) {
	dir, _ := cliDaemon(t)
	src := filepath.Join(dir, "src")
	os.WriteFile(src, []byte("some bytes"), 0o644)
	mustRun(t, nil, "put", "w", src)
	d := filepath.Join(dir, "d")
	os.Mkdir(d, 0o755)

	for _, to := range []string{d, d + "/"} {
		os.Remove(filepath.Join(d, "w"))
		var res map[string]any
		decode(t, mustRun(t, nil, "get", "w", to, "-o", "json"), &res)
		if b, _ := os.ReadFile(filepath.Join(d, "w")); string(b) != "some bytes" || res["file"] != filepath.Join(d, "w") {
			t.Errorf("get w %s: wrote %q, said %v; want %s/w", to, b, res, d)
		}
	}
	if r := cli(t, nil, "get", "w", filepath.Join(dir, "none")+"/"); r.code != exitcode.NotFound || !strings.Contains(r.stderr, "none/: no such file or directory") {
		t.Errorf("get into a directory that is not there: exit %d, %q", r.code, r.stderr)
	}
	if r := cli(t, nil, "get", "w", src+"/"); r.code == 0 || !strings.Contains(r.stderr, "src/: not a directory") {
		t.Errorf("get into a file as a directory: exit %d, %q", r.code, r.stderr)
	}
	if b, _ := os.ReadFile(src); string(b) != "some bytes" {
		t.Errorf("the file named as a directory was written: %q", b)
	}
}

func remapBytes(seed uint64, n int64) []byte {
	b := make([]byte, n)
	rand.NewChaCha8([32]byte{byte(seed)}).Read(b)
	return b
}
