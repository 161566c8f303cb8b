package checkpoint_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"testing"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/checkpoint"
	"github.com/gpushm/gpushm/internal/testdaemon"
)

// A checkpoint directory, as Hugging Face lays one out, goes into one
// bundle segment with Put, and comes back out, byte for byte, with Get.
// (The tests run the examples against a daemon on the host backend, at
// $GPUSHM_SOCKET.)
func Example() {
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, "") // $GPUSHM_SOCKET, else gpushm.SocketCandidates
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	// Safetensors shards, an index maybe, config.json and the tokenizer's
	// files: here a tiny stand-in for a model.
	dir := tinyModel()
	defer os.RemoveAll(dir)

	// Open checks every shard's header before anything is allocated.
	ck, err := checkpoint.Open(filepath.Join(dir, "model"))
	if err != nil {
		log.Fatal(err)
	}
	defer ck.Close()
	fmt.Println("shards:", ck.Shards(), "tensors:", ck.Tensors(), "files:", ck.Files())

	// Put copies it into the segment "tiny-model", committed once full.
	if _, err := checkpoint.Put(ctx, c, "tiny-model", ck, nil); err != nil {
		log.Fatal(err)
	}
	defer c.Unlink(ctx, "tiny-model")

	// Get writes the directory back.
	if _, err := checkpoint.Get(ctx, c, "tiny-model", filepath.Join(dir, "copy"), nil); err != nil {
		log.Fatal(err)
	}
	got, _ := os.ReadDir(filepath.Join(dir, "copy"))
	for _, e := range got {
		fmt.Println("got back:", e.Name())
	}
	// Output:
	// shards: [model.safetensors] tensors: 1 files: [config.json]
	// got back: config.json
	// got back: model.safetensors
}

// One file goes into a segment of its size with PutFile, and back out
// with GetFile. (A safetensors file would become a tensor bundle that
// records where it came from.)
func ExamplePutFile() {
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, "")
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	dir, err := os.MkdirTemp("", "gpushm-example-")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "notes.txt")
	if err := os.WriteFile(path, []byte("hello, segment\n"), 0o644); err != nil {
		log.Fatal(err)
	}

	// OpenFile learns the size (spooling standard input, for "-").
	f, err := checkpoint.OpenFile(ctx, path)
	if err != nil {
		log.Fatal(err)
	}
	defer f.Close()
	// PutFile makes the segment "notes", committed once full.
	if _, err := checkpoint.PutFile(ctx, c, "notes", f, nil); err != nil {
		log.Fatal(err)
	}
	defer c.Unlink(ctx, "notes")

	// GetFile writes it into a directory, as cp would.
	got, err := checkpoint.GetFile(ctx, c, "notes", dir+"/", nil)
	if err != nil {
		log.Fatal(err)
	}
	b, _ := os.ReadFile(got.File)
	fmt.Printf("%s, %d bytes: %s", filepath.Base(got.File), got.Bytes, b)
	// Output:
	// notes, 15 bytes: hello, segment
}

// tinyModel writes DIR/model: one safetensors shard of one tensor, and a
// config.json. It returns DIR.
func tinyModel() string {
	dir, err := os.MkdirTemp("", "gpushm-example-")
	if err != nil {
		log.Fatal(err)
	}
	model := filepath.Join(dir, "model")
	if err := os.Mkdir(model, 0o755); err != nil {
		log.Fatal(err)
	}
	header := `{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}}  ` // padded to 8 bytes
	shard := binary.LittleEndian.AppendUint64(nil, uint64(len(header)))
	shard = append(append(shard, header...), make([]byte, 16)...)
	for name, b := range map[string][]byte{"model.safetensors": shard, "config.json": []byte(`{"model_type":"tiny"}`)} {
		if err := os.WriteFile(filepath.Join(model, name), b, 0o644); err != nil {
			log.Fatal(err)
		}
	}
	return dir
}

// TestMain starts the daemon the examples find at $GPUSHM_SOCKET, one on
// the host backend in this process; the tests start their own.
func TestMain(m *testing.M) {
	testdaemon.RunExamples(m)
}
