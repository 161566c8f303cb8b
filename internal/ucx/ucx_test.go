package ucx

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// requireUCX skips the test, saying why, where libucp.so.0 cannot be
// loaded; scripts/test installs it (Debian's libucx0).
func requireUCX(tb testing.TB) {
	tb.Helper()
	if err := Load(); err != nil {
		tb.Skipf("UCX not usable: %v", err)
	}
}

// forceTCP makes the contexts the test creates use UCX's tcp transport on
// the loopback device, as two nodes would use tcp between them.
func forceTCP(tb testing.TB) {
	tb.Helper()
	tb.Setenv("UCX_TLS", "tcp")
	tb.Setenv("UCX_NET_DEVICES", "lo")
}

const childEnv = "GPUSHM_UCX_TEST_CHILD"

// TestNoLibrary checks the behaviour without a loadable libucp.so.0. Load
// runs once per process, so the checks run in a child process that points
// the loader at a library that does not exist.
func TestNoLibrary(t *testing.T) {
	if os.Getenv(childEnv) == "nolibrary" {
		library = "libucp-gpushm-test-missing.so.0"
		checkNoLibrary(t)
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestNoLibrary$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), childEnv+"=nolibrary")
	out, err := cmd.CombinedOutput()
	if err != nil || !bytes.Contains(out, []byte("--- PASS: TestNoLibrary")) {
		t.Fatalf("child process failed: %v\n%s", err, out)
	}
}

func checkNoLibrary(t *testing.T) {
	err := Load()
	if !errors.Is(err, ErrNoLibrary) {
		t.Fatalf("Load() = %v, want ErrNoLibrary", err)
	}
	t.Logf("Load: %v", err)
	for _, want := range []string{"libucp.so.0", "apt-get install libucx0"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Load error %q does not say %q", err, want)
		}
	}
	if cgoBuild && !strings.Contains(err.Error(), "libucp-gpushm-test-missing.so.0") {
		t.Errorf("Load error %q does not carry dlerror's text", err)
	}
	if again := Load(); again != err {
		t.Errorf("second Load = %v, want the remembered %v", again, err)
	}
	if c, err := NewContext(); c != nil || !errors.Is(err, ErrNoLibrary) {
		t.Errorf("NewContext() = %v, %v; want nil, ErrNoLibrary", c, err)
	}
	if v := Version(); v != "" {
		t.Errorf("Version() = %q without a library, want \"\"", v)
	}
	if got := StatusCanceled.Error(); got != "UCX status -16" {
		t.Errorf("StatusCanceled.Error() = %q before loading, want %q", got, "UCX status -16")
	}
}

func TestLoaderErrors(t *testing.T) {
	err := probeLibrary("libucp-gpushm-test-missing.so.0")
	if !errors.Is(err, ErrNoLibrary) {
		t.Fatalf("probe of a missing library: %v, want ErrNoLibrary", err)
	}
	if !cgoBuild {
		return
	}
	// libc loads everywhere and exports none of UCP's symbols.
	err = probeLibrary("libc.so.6")
	if err == nil || errors.Is(err, ErrNoLibrary) || !strings.Contains(err.Error(), "ucp_get_version") {
		t.Errorf("probe of libc.so.6 = %v, want an error naming ucp_get_version", err)
	}
}

func TestVersionAndStatus(t *testing.T) {
	requireUCX(t)
	v := Version()
	f := strings.Split(v, ".")
	if len(f) != 3 {
		t.Fatalf("Version() = %q, want major.minor.release", v)
	}
	if minor, _ := strconv.Atoi(f[1]); f[0] == "1" && minor < 10 {
		t.Errorf("Version() = %q: the package needs UCX 1.10 or later (ucp_get_nbx)", v)
	}
	t.Logf("UCX %s", v)
	if got := StatusCanceled.Error(); !strings.Contains(got, "canceled") || !strings.Contains(got, "-16") {
		t.Errorf("StatusCanceled.Error() = %q, want UCX's description and the code", got)
	}
}

// TestABIMatchesUCXHeaders compiles testdata/abi_check.c against UCX's
// headers and compares every layout and constant with the copies in
// ucp.h. It runs wherever the headers (Debian's libucx-dev) and a C
// compiler are installed.
func TestABIMatchesUCXHeaders(t *testing.T) {
	facts := abiFacts()
	if facts == nil {
		t.Skip("not a cgo build")
	}
	var inc string
	for _, dir := range []string{os.Getenv("UCX_HOME"), "/usr", "/usr/local", "/opt/ucx"} {
		if dir == "" {
			continue
		}
		if _, err := os.Stat(filepath.Join(dir, "include", "ucp", "api", "ucp.h")); err == nil {
			inc = filepath.Join(dir, "include")
			break
		}
	}
	if inc == "" {
		t.Skip("no ucp/api/ucp.h under $UCX_HOME, /usr, /usr/local or /opt/ucx (Debian: apt-get install libucx-dev)")
	}
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "cc"
	}
	if _, err := exec.LookPath(cc); err != nil {
		t.Skipf("no C compiler: %v", err)
	}
	bin := filepath.Join(t.TempDir(), "abi_check")
	if out, err := exec.Command(cc, "-I", inc, "-o", bin, filepath.Join("testdata", "abi_check.c")).CombinedOutput(); err != nil {
		t.Fatalf("compiling abi_check.c against %s: %v\n%s", inc, err, out)
	}
	out, err := exec.Command(bin).Output()
	if err != nil {
		t.Fatalf("abi_check: %v", err)
	}
	header := map[string]int64{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), " ")
		n, err := strconv.ParseInt(v, 10, 64)
		if !ok || err != nil {
			t.Fatalf("bad abi_check line %q", sc.Text())
		}
		header[k] = n
	}
	for k, want := range header {
		got, ok := facts[k]
		switch {
		case !ok:
			t.Errorf("%s: the headers have %d, the package does not check it", k, want)
		case got != want:
			t.Errorf("%s: package has %d, the headers in %s have %d", k, got, inc, want)
		}
	}
	for k := range facts {
		if _, ok := header[k]; !ok {
			t.Errorf("%s: not printed by abi_check.c", k)
		}
	}
	t.Logf("%d layout facts match %s/ucp/api", len(header), inc)
}

// TestInProcessGet reads a region through two workers of one process,
// the serving one progressed by Serve.
func TestInProcessGet(t *testing.T) {
	requireUCX(t)
	forceTCP(t)
	c, err := NewContext()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	src := make([]byte, 3<<20+123)
	for i := range src {
		src[i] = byte(i * 7)
	}
	r, err := c.Map(src)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Free()
	key, err := r.PackKey()
	if err != nil {
		t.Fatal(err)
	}
	server, err := c.NewWorker()
	if err != nil {
		t.Fatal(err)
	}
	defer server.Close()
	ctx, stop := context.WithCancel(context.Background())
	served := make(chan error, 1)
	go func() { served <- server.Serve(ctx) }()
	defer func() {
		stop()
		if err := <-served; err != nil {
			t.Errorf("Serve = %v", err)
		}
	}()
	addr, err := server.Address()
	if err != nil {
		t.Fatal(err)
	}
	client, err := c.NewWorker()
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	ep, err := client.Connect(addr)
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()
	dst := make([]byte, len(src))
	if err := ep.Get(context.Background(), dst, r.Addr(), key); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(dst, src) {
		t.Fatal("got bytes that differ from the region's")
	}
}
