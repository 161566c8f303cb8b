package main

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestForbidden(t *testing.T) {
	for _, tc := range []struct {
		from, to string
		test     bool
		bad      bool
	}{
		{"cmd/gpushm", "internal/server", false, true},
		{"cmd/gpushm", "internal/supervisor", true, false},
		{"cmd/gpushm", "internal/daemon", false, false},
		{"internal/daemon", "internal/supervisor", false, false},
		{"internal/testdaemon", "internal/backend", false, false},
		{"internal/fusefs", "internal/backend", false, true},
		{"internal/bench", "internal/server", false, true},
		{"internal/server", "internal/backend", false, true},
		{"internal/server", "internal/backend", true, false},
		{"internal/server", "internal/memfd", false, false},
		{"internal/backend", "internal/memfd", false, false},
		{"internal/supervisor", "internal/server", false, true},
		{".", "internal/segment", false, true},
		{".", "internal/server", false, true},
		{".", "internal/wire", false, false},
		{".", "internal/testdaemon", true, false},
		{".", "internal/testdaemon", false, true},
		{"internal/bench", "cmd/gpushm", false, true},
		{"internal/bench", "cmd/gpushm", true, true},
		{"checkpoint", ".", false, false},
		{"checkpoint", "internal/layout", false, false},
		{"checkpoint", "internal/segment", false, true},
		{"internal/report", "internal/wire", false, false},
		{"internal/report", "internal/segment", false, true},
		{"internal/complete", "internal/daemon", false, true},
		{"cmd/gpushm", "internal/wire", false, true},
		{"cmd/gpushm", "internal/segment", false, true},
		{"cmd/gpushm", "internal/xfer", false, true},
		{"cmd/gpushm", "internal/layout", true, false},
		{"cmd/gpushm", "internal/exitcode", false, false},
		{"cmd/gpushm", "checkpoint", false, false},
		{"cmd/gpushm", "internal/cli", false, false},
		{"internal/cli", "internal/daemon", false, false},
		{"internal/cli", "internal/wire", false, true},
		{"internal/cli", "internal/segment", false, true},
		{"internal/bench", "internal/cli", false, true},
		{"integration", "internal/cli", true, true},
	} {
		if got := forbidden(tc.from, tc.to, tc.test) != ""; got != tc.bad {
			t.Errorf("forbidden(%q, %q, test %v) = %q, want forbidden %v", tc.from, tc.to, tc.test, forbidden(tc.from, tc.to, tc.test), tc.bad)
		}
	}
}

func TestLengthExempt(t *testing.T) {
	for _, tc := range []struct {
		rel  string
		want bool
	}{
		{"client.go", false},
		{"e2e_test.go", false},
		{"internal/server/copylimits_test.go", false},
		{"cmd/gpushm/main.go", false},
		{"integration/tiers_test.go", false},
		{"cmd/gpushm/sub/x_test.go", false},
	} {
		if got := lengthExempt(tc.rel); got != tc.want {
			t.Errorf("lengthExempt(%q) = %v, want %v", tc.rel, got, tc.want)
		}
	}
}

func TestCheckUnsafe(t *testing.T) {
	root := t.TempDir()
	write := func(rel, src string) {
		t.Helper()
		path := filepath.Join(root, rel)
		if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	const uses = "package p\n\nimport \"unsafe\"\n\nvar _ = unsafe.Sizeof(0)\n"
	for k := range unsafeAllowed {
		if strings.HasSuffix(k, "/") {
			write(k+"a.go", uses)
		} else {
			write(k, uses)
		}
	}
	write("internal/other/x_test.go", uses)
	write("internal/other/y.go", "package p\n")
	got, err := checkUnsafe(root)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || !strings.HasPrefix(got[0], "internal/other/x_test.go: imports unsafe") {
		t.Errorf("checkUnsafe = %q, want the test file outside the list alone", got)
	}
	os.Remove(filepath.Join(root, "mapping.go"))
	got, _ = checkUnsafe(root)
	if !slices.ContainsFunc(got, func(s string) bool { return strings.HasPrefix(s, "mapping.go: in unsafeAllowed") }) {
		t.Errorf("checkUnsafe = %q, want the entry no file uses named", got)
	}
}

func TestExternal(t *testing.T) {
	for imp, want := range map[string]string{
		"fmt":                                "",
		"encoding/json":                      "",
		"C":                                  "C (cgo)",
		"golang.org/x/sys/unix":              "x/sys/unix",
		"github.com/hanwen/go-fuse/v2/fs":    "hanwen/go-fuse",
		"github.com/spf13/cobra":             "spf13/cobra",
		"sigs.k8s.io/yaml":                   "sigs.k8s.io/yaml",
		"github.com/NVIDIA/go-nvml/pkg/nvml": "NVIDIA/go-nvml",
		"github.com/coreos/go-systemd/v22/daemon": "coreos/go-systemd",
	} {
		if got := external(imp); got != want {
			t.Errorf("external(%q) = %q, want %q", imp, got, want)
		}
	}
}

func TestPackageTable(t *testing.T) {
	pkgs := []pkg{
		{rel: "internal/wire", doc: "Package wire is the protocol.", ext: []string{"x/sys/unix"}},
		{rel: ".", imports: []string{"internal/wire"}},
		{rel: "checkpoint", imports: []string{"internal/wire", "."}},
		{rel: "internal/new", doc: "Package new has a | in it.", imports: []string{"checkpoint"}},
	}
	old := "| package | gives | depends on |\n| --- | --- | --- |\n" +
		"| `internal/wire` | messages | nothing |\n" +
		"| `gpushm` (root) | the client | wire |\n" +
		"| `gpushm/checkpoint` | files \\| segments | wire |\n"
	want := "| package | floor | gives | depends on |\n| --- | --- | --- | --- |\n" +
		"| `internal/wire` | 0 | messages | nothing of ours; x/sys/unix |\n" +
		"| `gpushm` (root) | 1 | the client | wire |\n" +
		"| `checkpoint` | 2 | files \\| segments | the root package, wire |\n" +
		"| `internal/new` | 3 | Package new has a \\| in it. | checkpoint |\n"
	got := packageTable(pkgs, old)
	if got != want {
		t.Errorf("packageTable:\n%s\nwant:\n%s\ndiff:\n%s", got, want, diff(got, want))
	}
	// Written again, it stays.
	if again := packageTable(pkgs, got); again != got {
		t.Errorf("packageTable of its own table:\n%s", diff(got, again))
	}
}

func TestMapNames(t *testing.T) {
	got := mapNames("floor 3  checkpoint/ (put/get of a FILE)  | internal/daemon (the daemon's: gpushm (root), internal/nvml/nvmltest).")
	want := []string{"gpushm (root)", "checkpoint/", "put/get", "internal/daemon", "internal/nvml/nvmltest"}
	if !slices.Equal(got, want) {
		t.Errorf("mapNames = %q, want %q", got, want)
	}
}
