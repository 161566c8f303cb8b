package nvml_test

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/gpushm/gpushm/internal/nvml"
	"github.com/gpushm/gpushm/internal/nvml/nvmltest"
)

func TestOpenWithoutLibrary(t *testing.T) {
	for _, path := range []string{
		"/nonexistent/libnvidia-ml.so.1",
		"libm.so.6", // loads, but is not NVML
	} {
		n, err := nvml.Open(path)
		if err == nil {
			n.Close()
			t.Fatalf("Open(%q) succeeded", path)
		}
		if !errors.Is(err, nvml.ErrUnavailable) {
			t.Errorf("Open(%q) = %v, want ErrUnavailable", path, err)
		}
		t.Logf("Open(%q): %v", path, err)
	}
	if _, err := nvml.Open("libm.so.6"); err == nil || !strings.Contains(err.Error(), "has no nvmlInit_v2 or nvmlInit") {
		t.Errorf("Open(libm) = %v, want the missing symbol named", err)
	}
}

// TestRealLibrary runs where NVIDIA's driver is installed (the GPU
// machine). It comes before TestFakeLibrary: a process uses one library.
func TestRealLibrary(t *testing.T) {
	n, err := nvml.Open("")
	if errors.Is(err, nvml.ErrUnavailable) {
		t.Skipf("no NVML here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	gpus, err := n.GPUs()
	if err != nil {
		t.Fatal(err)
	}
	if len(gpus) == 0 {
		t.Fatal("NVML loaded but sees no GPU")
	}
	for _, g := range gpus {
		if !strings.HasPrefix(g.UUID, "GPU-") || g.TotalBytes == 0 || g.UsedBytes > g.TotalBytes {
			t.Errorf("implausible GPU: %+v", g)
		}
		t.Logf("GPU %d %s %s: %d/%d bytes used, %d%% busy, %d processes (%v), driver %s",
			g.Index, g.Name, g.UUID, g.UsedBytes, g.TotalBytes, g.Utilization, len(g.Processes), g.ProcessErr, n.Driver())
	}
}

func TestFakeLibrary(t *testing.T) {
	if n, err := nvml.Open(""); err == nil {
		n.Close()
		t.Skip("this process uses the real NVML; the fake would never be called")
	}
	lib := filepath.Join(nvmltest.Build(t), "libnvidia-ml.so.1")
	pid := os.Getpid()
	t.Setenv(nvmltest.PIDsEnv, strconv.Itoa(pid)+":1048576,4194303:2097152")

	t.Setenv(nvmltest.ModeEnv, "init-fails")
	if n, err := nvml.Open(lib); err == nil {
		n.Close()
		t.Fatal("Open succeeded with nvmlInit failing")
	} else if errors.Is(err, nvml.ErrUnavailable) || !strings.Contains(err.Error(), "nvmlInit: Driver Not Loaded (NVML error 9)") {
		t.Fatalf("Open with nvmlInit failing = %v, want the NVML error, not ErrUnavailable", err)
	}

	t.Setenv(nvmltest.ModeEnv, "ok")
	n, err := nvml.Open(lib)
	if err != nil {
		t.Fatal(err)
	}
	defer n.Close()
	if n.Driver() != nvmltest.Driver {
		t.Errorf("Driver() = %q, want %q", n.Driver(), nvmltest.Driver)
	}
	gpus, err := n.GPUs()
	if err != nil {
		t.Fatal(err)
	}
	if len(gpus) != 2 {
		t.Fatalf("%d GPUs, want 2: %+v", len(gpus), gpus)
	}
	g := gpus[0]
	if g.Index != 0 || g.Name != "Fake GPU A" || g.UUID != nvmltest.UUID0 || g.TotalBytes != 80<<30 ||
		g.UsedBytes != 3<<30 || g.FreeBytes != 77<<30 || g.Utilization != 42 {
		t.Errorf("GPU 0 = %+v", g)
	}
	// go-nvml asks with room for one process, then again with more.
	want := []nvml.Process{{PID: uint32(pid), UsedBytes: 1 << 20}, {PID: 4194303, UsedBytes: 2 << 20}}
	if len(g.Processes) != 2 || g.Processes[0] != want[0] || g.Processes[1] != want[1] || g.ProcessErr != nil {
		t.Errorf("GPU 0 processes = %+v (%v), want %+v", g.Processes, g.ProcessErr, want)
	}
	if g := gpus[1]; g.Utilization != -1 || len(g.Processes) != 0 || g.ProcessErr != nil || g.UUID != nvmltest.UUID1 {
		t.Errorf("GPU 1 = %+v, want no utilisation and no processes", g)
	}

	t.Setenv(nvmltest.ModeEnv, "gpu-lost")
	gpus, err = n.GPUs()
	if len(gpus) != 1 || gpus[0].UUID != nvmltest.UUID0 || err == nil || !strings.Contains(err.Error(), "GPU 1: nvmlDeviceGetUUID: GPU is lost") {
		t.Fatalf("GPUs with GPU 1 lost = %+v, %v; want GPU 0 and GPU 1's error", gpus, err)
	}
}
