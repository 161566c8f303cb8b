package cli

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/exitcode"
)

// TestCat: cat writes segments' bytes to standard output, one after
// another; on a terminal it refuses binary output unless --force.
func TestCat(t *testing.T) {
	dir, sock := cliDaemon(t)
	text, bin := filepath.Join(dir, "text"), filepath.Join(dir, "bin")
	os.WriteFile(text, []byte("hello\nworld\n"), 0o644)
	binary := append(bytes.Repeat([]byte("text first, "), 10), 0, 1, 2, 0xff)
	os.WriteFile(bin, binary, 0o644)
	mustRun(t, nil, "put", "text", text)
	mustRun(t, nil, "put", "bin", bin)

	if out := mustRun(t, nil, "cat", "text"); out != "hello\nworld\n" {
		t.Errorf("cat text said %q", out)
	}
	if out := mustRun(t, nil, "cat", "text", "bin", "text"); out != "hello\nworld\n"+string(binary)+"hello\nworld\n" {
		t.Errorf("cat text bin text said %q", out)
	}
	if r := cli(t, nil, "cat", "nope", "text"); r.code != exitcode.NotFound || r.stdout != "hello\nworld\n" || r.stderr != "gpushm: cat nope: no such segment\n" {
		t.Errorf("cat nope text: exit %d, stdout %q, stderr %q; want the second written and the first said missing", r.code, r.stdout, r.stderr)
	}

	// Still being written: refused, as get refuses it.
	ctx := context.Background()
	c, err := gpushm.Dial(ctx, sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	half, err := c.Create(ctx, "half", 4096, &gpushm.CreateOptions{Uncommitted: true})
	if err != nil {
		t.Fatal(err)
	}
	defer half.Close()
	if r := cli(t, nil, "cat", "half"); r.code != exitcode.Busy || !strings.HasPrefix(r.stderr, "gpushm: cat half: ") {
		t.Errorf("cat of a segment being written: exit %d, %q; want %d", r.code, r.stderr, exitcode.Busy)
	}

	out, code := onTerminal(t, "cat", "text")
	if code != 0 || !strings.Contains(out, "hello\r\nworld\r\n") {
		t.Errorf("cat text on a terminal: exit %d, %q", code, out)
	}
	out, code = onTerminal(t, "cat", "bin")
	if code != exitcode.Failure || !strings.Contains(out, "gpushm: cat bin: binary output can mess up your terminal: 'gpushm cat --force bin' writes it here anyway") || strings.Contains(out, "\x00") {
		t.Errorf("cat of binary on a terminal: exit %d, %q; want it refused, and no NUL written", code, out)
	}
	// No NUL, but not text either: random bytes often hold no NUL.
	latin := filepath.Join(dir, "latin")
	os.WriteFile(latin, []byte{0xe9, 0x74, 0xe9, 0x0a, 0xff, 0xfe, 0x01}, 0o644)
	mustRun(t, nil, "put", "latin", latin)
	out, code = onTerminal(t, "cat", "latin")
	if code != exitcode.Failure || !strings.Contains(out, "gpushm: cat latin: binary output can mess up your terminal") || strings.Contains(out, "\xff") {
		t.Errorf("cat of bytes that are not UTF-8 on a terminal: exit %d, %q; want it refused", code, out)
	}
	out, code = onTerminal(t, "cat", "--force", "bin")
	if code != 0 || !strings.Contains(out, "text first, ") {
		t.Errorf("cat --force of binary on a terminal: exit %d, %q", code, out)
	}
}

// TestCatPieces: cat writes a mapping a piece at a time, however large
// the write it is given, so that nothing holds more than a piece.
func TestCatPieces(t *testing.T) {
	var w recordWriter
	b := bytes.Repeat([]byte{7}, 2*catPiece+3)
	if n, err := (pieces{&w}).Write(b); n != len(b) || err != nil {
		t.Fatalf("Write(%d bytes) = %d, %v", len(b), n, err)
	}
	if len(w.sizes) != 3 || w.sizes[0] != catPiece || w.sizes[1] != catPiece || w.sizes[2] != 3 {
		t.Fatalf("a write of %d bytes was written as %v, want pieces of at most %d", len(b), w.sizes, catPiece)
	}
}

type recordWriter struct{ sizes []int }

func (w *recordWriter) Write(b []byte) (int, error) {
	w.sizes = append(w.sizes, len(b))
	return len(b), nil
}
