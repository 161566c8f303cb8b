// Package nvmltest builds a fake libnvidia-ml.so.1 for tests, so that the
// NVML code path runs on machines without a GPU (see testdata/fakenvml.c
// for what it reports and the GPUSHM_FAKE_NVML modes).
package nvmltest

import (
	_ "embed"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

//go:embed testdata/fakenvml.c
var source []byte

// Environment variables the fake reads at every call.
const (
	// ModeEnv picks the fake's behaviour: "ok", "init-fails" or "gpu-lost".
	ModeEnv = "GPUSHM_FAKE_NVML"
	// PIDsEnv lists the processes GPU 0 reports, as "pid:bytes,pid:bytes".
	PIDsEnv = "GPUSHM_FAKE_NVML_PIDS"
)

// What the fake reports.
const (
	UUID0  = "GPU-fa4e0000-0000-0000-0000-000000000000"
	UUID1  = "GPU-fa4e0001-0000-0000-0000-000000000001"
	Driver = "999.99.99-fake"
)

// Build compiles the fake into a directory of the test's and returns that
// directory, which holds libnvidia-ml.so.1: put it in LD_LIBRARY_PATH, or
// pass the file's path to nvml.Open. It skips the test when gcc is missing.
func Build(t testing.TB) string {
	t.Helper()
	gcc, err := exec.LookPath("gcc")
	if err != nil {
		t.Skipf("the fake NVML library needs a C compiler: %v", err)
	}
	dir := t.TempDir()
	os.Chmod(dir, 0o755) // for daemons running as other users
	src := filepath.Join(dir, "fakenvml.c")
	if err := os.WriteFile(src, source, 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(gcc, "-Wall", "-Werror", "-shared", "-fPIC", "-o", filepath.Join(dir, "libnvidia-ml.so.1"), src).CombinedOutput()
	if err != nil {
		t.Fatalf("build fake NVML: %v\n%s", err, out)
	}
	return dir
}
