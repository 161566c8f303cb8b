package cli

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/layout"
	"github.com/gpushm/gpushm/internal/testdaemon"
	"github.com/gpushm/gpushm/internal/testutil"
)

// stated is what stat says of name (list leaves meta out).
func stated(t *testing.T, name string) gpushm.SegmentInfo {
	t.Helper()
	c := dialOnce(t, os.Getenv("GPUSHM_SOCKET"))
	defer c.Close()
	st, err := c.Stat(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	return *st
}

// bundleOrigin reads a bundle meta's origin.
func bundleOrigin(t *testing.T, meta json.RawMessage) *layout.Origin {
	t.Helper()
	var m layout.Meta
	if err := json.Unmarshal(meta, &m); err != nil {
		t.Fatalf("meta %s: %v", meta, err)
	}
	return m.Origin
}

// identityOf is what put should record of path, as os.Stat (following
// links) and the file's bytes say.
func identityOf(t *testing.T, path string) layout.Identity {
	t.Helper()
	f := testdaemon.StatFile(t, path)
	return layout.Identity{Name: filepath.Base(path), Size: f.Size, MtimeNS: f.MtimeNS, CtimeNS: f.CtimeNS, Dev: f.Dev, Ino: f.Ino}.
		Sealed(f.CRC32C)
}

// TestPutRecordsOrigin puts a safetensors file reached through a linked
// directory, itself a link to a blob (a Hugging Face snapshot), with each
// copier, and checks the origin the meta records against the file.
func TestPutRecordsOrigin(t *testing.T) {
	root := testutil.SocketDir(t)
	sock := filepath.Join(root, "gpushm.sock")
	startDaemonProc(t, sock)
	t.Setenv("GPUSHM_SOCKET", sock)
	snap := filepath.Join(root, "snapshots", "0123")
	os.MkdirAll(snap, 0o755)
	os.MkdirAll(filepath.Join(root, "blobs"), 0o755)
	data := make([]byte, 22)
	os.WriteFile(filepath.Join(root, "blobs", "9f3c"), testutil.SafetensorsFile(goodHeader, data), 0o644)
	if err := os.Symlink("../../blobs/9f3c", filepath.Join(snap, "model.safetensors")); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(root, "current")
	os.Symlink(snap, link)
	realDir, _ := filepath.EvalSymlinks(snap)
	path := filepath.Join(link, "model.safetensors")

	for _, copier := range []string{"daemon", "client"} {
		r := cli(t, nil, "put", "--copier", copier, copier, path)
		if r.code != 0 || strings.Contains(r.stderr, "records no origin") {
			t.Fatalf("put --copier %s: exit %d: %s", copier, r.code, r.stderr)
		}
		o := bundleOrigin(t, stated(t, copier).Meta)
		if o == nil || o.Dir != realDir || len(o.Files) != 1 {
			t.Fatalf("put --copier %s: origin %+v, want dir %s and one file", copier, o, realDir)
		}
		if want := identityOf(t, path); o.Files[0] != want {
			t.Errorf("put --copier %s: recorded %+v, want %+v", copier, o.Files[0], want)
		}
		if out := mustRun(t, nil, "stat", copier); !strings.Contains(out, `"origin":{"dir":`) {
			t.Errorf("stat shows no origin:\n%s", out)
		}
	}
	// A pipe has no origin, nor does a file that is not a bundle.
	mustRun(t, testutil.SafetensorsFile(goodHeader, data), "put", "piped", "-")
	if o := bundleOrigin(t, stated(t, "piped").Meta); o != nil {
		t.Errorf("a piped bundle records origin %+v", o)
	}
	// A directory's bundle names its directory; its shard table has the
	// records (checkpoint's tests read them).
	dir := checkpointDir(t, root)
	if r := cli(t, nil, "put", "llama", dir); r.code != 0 || strings.Contains(r.stderr, "records no origin") {
		t.Fatalf("put of a directory: exit %d: %s", r.code, r.stderr)
	}
	realCk, _ := filepath.EvalSymlinks(dir)
	if o := bundleOrigin(t, stated(t, "llama").Meta); o == nil || o.Dir != realCk || o.Files != nil {
		t.Errorf("a directory's bundle: origin %+v, want dir %s", o, realCk)
	}
}

// dialOnce connects to sock with a client that does not reconnect: one
// that checks what survived a restart must not ride a restart itself.
func dialOnce(t *testing.T, sock string) *gpushm.Client {
	t.Helper()
	c, err := gpushm.Dial(context.Background(), sock)
	if err != nil {
		t.Fatal(err)
	}
	c.SetReconnect(0)
	return c
}
