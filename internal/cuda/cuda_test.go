package cuda

import (
	"bufio"
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
)

func TestResultError(t *testing.T) {
	tests := []struct {
		r    Result
		name string
		text string
	}{
		{0, "CUDA_SUCCESS", "CUDA_SUCCESS (0)"},
		{ErrInvalidValue, "CUDA_ERROR_INVALID_VALUE", "CUDA_ERROR_INVALID_VALUE (1)"},
		{ErrOutOfMemory, "CUDA_ERROR_OUT_OF_MEMORY", "CUDA_ERROR_OUT_OF_MEMORY (2)"},
		{3, "CUDA_ERROR_NOT_INITIALIZED", "CUDA_ERROR_NOT_INITIALIZED (3)"},
		{ErrNoDevice, "CUDA_ERROR_NO_DEVICE", "CUDA_ERROR_NO_DEVICE (100)"},
		{ErrInvalidDevice, "CUDA_ERROR_INVALID_DEVICE", "CUDA_ERROR_INVALID_DEVICE (101)"},
		{ErrInvalidHandle, "CUDA_ERROR_INVALID_HANDLE", "CUDA_ERROR_INVALID_HANDLE (400)"},
		{ErrNotPermitted, "CUDA_ERROR_NOT_PERMITTED", "CUDA_ERROR_NOT_PERMITTED (800)"},
		{ErrNotSupported, "CUDA_ERROR_NOT_SUPPORTED", "CUDA_ERROR_NOT_SUPPORTED (801)"},
		{916, "CUDA_ERROR_KEY_ROTATION", "CUDA_ERROR_KEY_ROTATION (916)"},
		{ErrUnknown, "CUDA_ERROR_UNKNOWN", "CUDA_ERROR_UNKNOWN (999)"},
		{9999, "CUDA_ERROR_UNKNOWN_CODE(9999)", "CUDA_ERROR_UNKNOWN_CODE(9999)"},
		{-1, "CUDA_ERROR_UNKNOWN_CODE(-1)", "CUDA_ERROR_UNKNOWN_CODE(-1)"},
	}
	for _, tt := range tests {
		if got := tt.r.Name(); got != tt.name {
			t.Errorf("Result(%d).Name() = %q, want %q", int(tt.r), got, tt.name)
		}
		if got := tt.r.Error(); got != tt.text {
			t.Errorf("Result(%d).Error() = %q, want %q", int(tt.r), got, tt.text)
		}
	}
}

func TestResultTableWellFormed(t *testing.T) {
	seen := map[string]Result{}
	for r, n := range resultNames {
		if !strings.HasPrefix(n, "CUDA_") || strings.ToUpper(n) != n {
			t.Errorf("Result(%d) has malformed name %q", int(r), n)
		}
		if prev, dup := seen[n]; dup {
			t.Errorf("name %q used for both %d and %d", n, int(prev), int(r))
		}
		seen[n] = r
	}
}

func TestResultErrorsIs(t *testing.T) {
	err := fmt.Errorf("cuMemCreate: %w", Result(2))
	if !errors.Is(err, ErrOutOfMemory) {
		t.Errorf("errors.Is(%v, ErrOutOfMemory) = false", err)
	}
	if errors.Is(err, ErrInvalidValue) {
		t.Errorf("errors.Is(%v, ErrInvalidValue) = true", err)
	}
	var r Result
	if !errors.As(err, &r) || r != ErrOutOfMemory {
		t.Errorf("errors.As(%v) = %v", err, r)
	}
}

const childEnv = "GPUSHM_CUDA_TEST_CHILD"

// TestNoDriver checks the behaviour without a loadable libcuda.so.1. Init can
// run only once per process, so the checks run in a child process that points
// the loader at a library that does not exist, whatever this machine has.
func TestNoDriver(t *testing.T) {
	if os.Getenv(childEnv) == "nodriver" {
		driverLibrary = "libcuda-gpushm-test-missing.so.1"
		checkNoDriver(t)
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestNoDriver$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), childEnv+"=nodriver")
	out, err := cmd.CombinedOutput()
	if err != nil || !bytes.Contains(out, []byte("--- PASS: TestNoDriver")) {
		t.Fatalf("child process failed: %v\n%s", err, out)
	}
}

func checkNoDriver(t *testing.T) {
	err := Init()
	if err == nil {
		t.Fatal("Init succeeded without a driver library")
	}
	if !errors.Is(err, ErrNoDriver) {
		t.Fatalf("Init error %q does not wrap ErrNoDriver", err)
	}
	t.Logf("Init: %v", err)
	if again := Init(); again != err {
		t.Errorf("second Init returned %v, want the remembered %v", again, err)
	}
	if _, err := DeviceCount(); !errors.Is(err, ErrNoDriver) {
		t.Errorf("DeviceCount error = %v, want ErrNoDriver", err)
	}
	if _, err := DriverVersion(); !errors.Is(err, ErrNoDriver) {
		t.Errorf("DriverVersion error = %v, want ErrNoDriver", err)
	}
	if d, err := GetDevice(0); d != nil || !errors.Is(err, ErrNoDriver) {
		t.Errorf("GetDevice(0) = %v, %v; want nil, ErrNoDriver", d, err)
	}
	checkZeroValues(t)
}

// checkZeroValues calls methods on values that never came from the driver;
// each must return an error rather than call through a nil pointer.
func checkZeroValues(t *testing.T) {
	var nilDev *Device
	zero := &Device{}
	for _, d := range []*Device{nilDev, zero} {
		if _, err := d.Name(); err == nil {
			t.Error("Name on an unusable device succeeded")
		}
		if _, _, err := d.MemInfo(); err == nil {
			t.Error("MemInfo on an unusable device succeeded")
		}
		if _, err := d.Create(2 << 20); err == nil {
			t.Error("Create on an unusable device succeeded")
		}
		if _, err := d.Map(1, 2<<20, false, d); err == nil {
			t.Error("Map on an unusable device succeeded")
		}
		if err := d.Synchronize(); err == nil {
			t.Error("Synchronize on an unusable device succeeded")
		}
		if _, err := d.AllocHost(4096); err == nil {
			t.Error("AllocHost on an unusable device succeeded")
		}
	}
	if err := (*Stream)(nil).Synchronize(); err == nil {
		t.Error("Synchronize on a nil stream succeeded")
	}
	if err := (&Stream{}).Close(); err == nil {
		t.Error("Close on a zero stream succeeded")
	}
	if err := (*Event)(nil).Record(nil); err == nil {
		t.Error("Record on a nil event succeeded")
	}
	if _, err := ElapsedMs(&Event{}, nil); err == nil {
		t.Error("ElapsedMs on zero events succeeded")
	}
}

func TestZeroValuesDoNotCrash(t *testing.T) {
	checkZeroValues(t)
}

func TestLoaderErrors(t *testing.T) {
	err := probeLibrary("libcuda-gpushm-test-missing.so.1")
	if !errors.Is(err, ErrNoDriver) {
		t.Fatalf("probe of a missing library: %v, want ErrNoDriver", err)
	}
	if !cgoBuild {
		return
	}
	if !strings.Contains(err.Error(), "libcuda-gpushm-test-missing.so.1") {
		t.Errorf("error %q does not carry the dlerror text", err)
	}
	// libc loads everywhere and exports none of the driver's symbols.
	err = probeLibrary("libc.so.6")
	if err == nil || errors.Is(err, ErrNoDriver) || !strings.Contains(err.Error(), "cuInit") {
		t.Errorf("probe of libc.so.6 = %v, want an error naming cuInit", err)
	}
}

// TestABIMatchesCudaHeader compiles testdata/abi_check.c against a real
// cuda.h and compares every layout and constant with the copies in the cgo
// preamble. It runs wherever a CUDA toolkit and a C compiler are installed.
func TestABIMatchesCudaHeader(t *testing.T) {
	facts := abiFacts()
	if facts == nil {
		t.Skip("not a cgo build")
	}
	var inc string
	for _, dir := range []string{os.Getenv("CUDA_HOME"), os.Getenv("CUDA_PATH"), "/usr/local/cuda"} {
		if dir == "" {
			continue
		}
		if _, err := os.Stat(filepath.Join(dir, "include", "cuda.h")); err == nil {
			inc = filepath.Join(dir, "include")
			break
		}
	}
	if inc == "" {
		t.Skip("no cuda.h found under $CUDA_HOME, $CUDA_PATH or /usr/local/cuda")
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
			t.Errorf("%s: cuda.h has %d, package does not check it", k, want)
		case got != want:
			t.Errorf("%s: package has %d, cuda.h in %s has %d", k, got, inc, want)
		}
	}
	for k := range facts {
		if _, ok := header[k]; !ok {
			t.Errorf("%s: not printed by abi_check.c", k)
		}
	}
	t.Logf("%d layout facts match %s/cuda.h", len(header), inc)
}

// requireGPU returns device 0, or skips the test with the reason no usable
// GPU is present.
func requireGPU(tb testing.TB) *Device {
	tb.Helper()
	if err := Init(); err != nil {
		tb.Skipf("no usable CUDA driver: %v", err)
	}
	n, err := DeviceCount()
	if err != nil {
		tb.Skipf("no usable CUDA driver: %v", err)
	}
	if n == 0 {
		tb.Skip("no CUDA devices")
	}
	d, err := GetDevice(0)
	if err != nil {
		tb.Fatalf("GetDevice(0): %v", err)
	}
	ok, err := d.VMMSupported()
	if err != nil {
		tb.Fatalf("VMMSupported: %v", err)
	}
	if !ok {
		tb.Skip("device 0 lacks VMM or POSIX fd export support")
	}
	return d
}

func allocSize(tb testing.TB, d *Device, min int64) int64 {
	tb.Helper()
	g, err := d.Granularity()
	if err != nil {
		tb.Fatalf("Granularity: %v", err)
	}
	return (min + g - 1) / g * g
}

func randomBytes(tb testing.TB, n int64) []byte {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		tb.Fatal(err)
	}
	return b
}

// closeFD closes a descriptor from ExportFD, which the caller owns.
func closeFD(fd int) error { return os.NewFile(uintptr(fd), "exported").Close() }

func must(tb testing.TB, err error) {
	tb.Helper()
	if err != nil {
		tb.Fatal(err)
	}
}

func check(tb testing.TB, what string, err error) {
	tb.Helper()
	if err != nil {
		tb.Errorf("%s: %v", what, err)
	}
}

func TestDeviceInfo(t *testing.T) {
	d := requireGPU(t)
	v, err := DriverVersion()
	must(t, err)
	n, err := DeviceCount()
	must(t, err)
	name, err := d.Name()
	must(t, err)
	uuid, err := d.UUID()
	must(t, err)
	if !regexp.MustCompile(`^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`).MatchString(uuid) {
		t.Errorf("UUID %q is not in nvidia-smi's format", uuid)
	}
	total, err := d.TotalMem()
	must(t, err)
	free, total2, err := d.MemInfo()
	must(t, err)
	if total == 0 || free == 0 || free > total2 {
		t.Errorf("TotalMem %d, MemInfo free %d total %d", total, free, total2)
	}
	g, err := d.Granularity()
	must(t, err)
	if g <= 0 || g&(g-1) != 0 {
		t.Errorf("granularity %d is not a power of two", g)
	}
	self, err := d.CanAccessPeer(d)
	must(t, err)
	t.Logf("driver %d, %d devices; device 0: %s %s, total %d, free %d, granularity %d, self peer %v",
		v, n, name, uuid, total, free, g, self)
	if d.Ordinal() != 0 {
		t.Errorf("Ordinal = %d", d.Ordinal())
	}

	// nvidia-smi orders devices by PCI bus while CUDA defaults to fastest
	// first, so only membership is compared.
	if out, err := exec.Command("nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader").Output(); err == nil {
		if !strings.Contains(string(out), uuid) {
			t.Errorf("UUID %s not among nvidia-smi's:\n%s", uuid, out)
		}
	} else {
		t.Logf("nvidia-smi not usable, UUID not cross-checked: %v", err)
	}

	if _, err := GetDevice(n); !errors.Is(err, ErrInvalidDevice) {
		t.Errorf("GetDevice(%d) error = %v, want ErrInvalidDevice", n, err)
	}
	if _, err := GetDevice(-1); !errors.Is(err, ErrInvalidDevice) {
		t.Errorf("GetDevice(-1) error = %v, want ErrInvalidDevice", err)
	}
	checkZeroValues(t)
}

func TestGetDeviceConcurrent(t *testing.T) {
	d0 := requireGPU(t)
	var wg sync.WaitGroup
	for range 32 {
		wg.Go(func() {
			d, err := GetDevice(0)
			if err != nil || d != d0 {
				t.Errorf("GetDevice(0) = %p, %v; want %p", d, err, d0)
			}
		})
	}
	wg.Wait()
}

// TestResultNamesMatchDriver compares the built-in name table with the
// driver's own cuGetErrorName.
func TestResultNamesMatchDriver(t *testing.T) {
	requireGPU(t)
	for code := Result(0); code <= 1000; code++ {
		drv, ok := driverErrorName(code)
		ours, known := resultNames[code]
		switch {
		case ok && known && drv != ours:
			t.Errorf("code %d: table says %s, driver says %s", int(code), ours, drv)
		case ok && !known:
			t.Logf("code %d: driver knows %s, table does not (Name still reports it)", int(code), drv)
		case !ok && known:
			t.Logf("code %d: table has %s, this driver does not know it", int(code), ours)
		}
	}
}

func TestVMMRoundTrip(t *testing.T) {
	d := requireGPU(t)
	size := allocSize(t, d, 2<<20)

	if _, err := d.Create(size + 1); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("Create(%d) error = %v, want ErrInvalidValue", size+1, err)
	}

	h, err := d.Create(size)
	must(t, err)
	defer func() { check(t, "Release", d.Release(h)) }()

	fd, err := d.ExportFD(h)
	must(t, err)
	defer closeFD(fd)

	h2, err := d.ImportFD(fd)
	must(t, err)
	defer func() { check(t, "Release imported", d.Release(h2)) }()
	// A second import works only if the first left the descriptor open.
	h2b, err := d.ImportFD(fd)
	if err != nil {
		t.Errorf("second ImportFD of fd %d: %v", fd, err)
	} else {
		check(t, "Release second import", d.Release(h2b))
	}

	if _, err := d.Map(h, size, false); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("Map with no access list: %v, want ErrInvalidValue", err)
	}

	rw, err := d.Map(h, size, false, d)
	must(t, err)
	defer func() { check(t, "Unmap rw", d.Unmap(rw, size)) }()

	pattern := randomBytes(t, size)
	must(t, d.CopyHtoD(rw, pattern))
	got := make([]byte, size)
	must(t, d.CopyDtoH(got, rw))
	if !bytes.Equal(got, pattern) {
		t.Fatal("read-write mapping: data read back differs from data written")
	}

	ro, err := d.Map(h2, size, true, d)
	must(t, err)
	defer func() { check(t, "Unmap ro", d.Unmap(ro, size)) }()
	if ro == rw {
		t.Fatalf("second mapping reused address %#x", ro)
	}
	clear(got)
	must(t, d.CopyDtoH(got, ro))
	if !bytes.Equal(got, pattern) {
		t.Fatal("read-only mapping of the imported handle does not show the data")
	}

	// Both mappings share physical memory: a memset through one shows in the
	// other.
	const half = 1 << 20
	must(t, d.MemsetD8(rw+half, 0xA5, size-half))
	must(t, d.Synchronize())
	must(t, d.CopyDtoH(got, ro))
	if !bytes.Equal(got[:half], pattern[:half]) {
		t.Error("memset changed bytes before its range")
	}
	for i, b := range got[half:] {
		if b != 0xA5 {
			t.Fatalf("byte %d after memset is %#x, want 0xa5", half+i, b)
		}
	}

	h3, err := d.Create(size)
	must(t, err)
	defer func() { check(t, "Release h3", d.Release(h3)) }()
	p3, err := d.Map(h3, size, false, d)
	must(t, err)
	defer func() { check(t, "Unmap p3", d.Unmap(p3, size)) }()
	must(t, d.CopyHtoD(rw, pattern))
	must(t, d.CopyDtoD(p3, rw, size))
	must(t, d.Synchronize())
	clear(got)
	must(t, d.CopyDtoH(got, p3))
	if !bytes.Equal(got, pattern) {
		t.Error("CopyDtoD: destination differs from source")
	}

	if _, err := d.Map(h, size+1, false, d); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("Map of %d bytes: %v, want ErrInvalidValue", size+1, err)
	}
}

func TestReleaseKeepsMappingAlive(t *testing.T) {
	d := requireGPU(t)
	size := allocSize(t, d, 2<<20)
	h, err := d.Create(size)
	must(t, err)
	p, err := d.Map(h, size, false, d)
	if err != nil {
		d.Release(h)
		t.Fatal(err)
	}
	must(t, d.Release(h))
	pattern := randomBytes(t, size)
	must(t, d.CopyHtoD(p, pattern))
	got := make([]byte, size)
	must(t, d.CopyDtoH(got, p))
	must(t, d.Unmap(p, size))
	if !bytes.Equal(got, pattern) {
		t.Error("mapping of a released handle lost its data")
	}
}

func TestMemInfoTracksCreate(t *testing.T) {
	d := requireGPU(t)
	size := allocSize(t, d, 256<<20)
	const slack = 16 << 20
	free0, _, err := d.MemInfo()
	must(t, err)
	h, err := d.Create(size)
	must(t, err)
	free1, _, err := d.MemInfo()
	if err != nil {
		d.Release(h)
		t.Fatal(err)
	}
	must(t, d.Release(h))
	free2, _, err := d.MemInfo()
	must(t, err)
	t.Logf("free: %d before, %d after Create(%d), %d after Release", free0, free1, size, free2)
	if free1 > free0 || free0-free1+slack < uint64(size) {
		t.Errorf("free dropped by %d after Create(%d)", int64(free0)-int64(free1), size)
	}
	if free2+slack < free0 {
		t.Errorf("free is %d after Release, %d before Create", free2, free0)
	}
}

func TestPinnedStreamRoundTrip(t *testing.T) {
	d := requireGPU(t)
	size := allocSize(t, d, 4<<20)

	src, err := d.AllocHost(size)
	must(t, err)
	defer func() { check(t, "FreeHost src", d.FreeHost(src)) }()
	dst, err := d.AllocHost(size)
	must(t, err)
	defer func() { check(t, "FreeHost dst", d.FreeHost(dst)) }()
	copy(src, randomBytes(t, size))

	h, err := d.Create(size)
	must(t, err)
	defer func() { check(t, "Release", d.Release(h)) }()
	p, err := d.Map(h, size, false, d)
	must(t, err)
	defer func() { check(t, "Unmap", d.Unmap(p, size)) }()

	s, err := d.NewStream()
	must(t, err)
	start, err := d.NewEvent()
	must(t, err)
	end, err := d.NewEvent()
	must(t, err)

	if err := s.CopyHtoDAsync(p, make([]byte, 16)); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("async copy from Go memory: %v, want ErrInvalidValue", err)
	}

	// Copy in chunks from sub-slices, as a pipelined caller would.
	must(t, start.Record(s))
	const chunks = 4
	c := size / chunks
	for i := range int64(chunks) {
		must(t, s.CopyHtoDAsync(p+uint64(i*c), src[i*c:(i+1)*c]))
	}
	must(t, s.CopyDtoHAsync(dst, p))
	must(t, end.Record(s))
	must(t, s.Synchronize())
	must(t, end.Synchronize())
	if !bytes.Equal(dst, src) {
		t.Error("stream round trip: data differs")
	}
	ms, err := ElapsedMs(start, end)
	must(t, err)
	if ms < 0 {
		t.Errorf("ElapsedMs = %v", ms)
	}
	t.Logf("async round trip of %d bytes: %.3f ms", size, ms)

	// The legacy default stream, for Record(nil).
	must(t, start.Record(nil))
	must(t, start.Synchronize())

	must(t, start.Close())
	must(t, end.Close())
	if err := end.Close(); !errors.Is(err, ErrInvalidHandle) {
		t.Errorf("second Event.Close: %v, want ErrInvalidHandle", err)
	}
	must(t, s.Close())
	if err := s.Close(); !errors.Is(err, ErrInvalidHandle) {
		t.Errorf("second Stream.Close: %v, want ErrInvalidHandle", err)
	}
	if err := s.Synchronize(); !errors.Is(err, ErrInvalidHandle) {
		t.Errorf("Synchronize after Close: %v, want ErrInvalidHandle", err)
	}

	if err := d.FreeHost(src[1:]); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("FreeHost of a reslice: %v, want ErrInvalidValue", err)
	}
	if err := d.FreeHost(make([]byte, 8)); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("FreeHost of Go memory: %v, want ErrInvalidValue", err)
	}
	extra, err := d.AllocHost(4096)
	must(t, err)
	must(t, d.FreeHost(extra))
	if err := d.FreeHost(extra); !errors.Is(err, ErrInvalidValue) {
		t.Errorf("second FreeHost: %v, want ErrInvalidValue", err)
	}
}

// TestCrossProcessImport hands an exported descriptor to a child process,
// which imports and maps it read-only and reports a digest of what it reads.
func TestCrossProcessImport(t *testing.T) {
	if os.Getenv(childEnv) == "import" {
		importChild(t)
		return
	}
	d := requireGPU(t)
	size := allocSize(t, d, 2<<20)
	h, err := d.Create(size)
	must(t, err)
	defer func() { check(t, "Release", d.Release(h)) }()
	p, err := d.Map(h, size, false, d)
	must(t, err)
	defer func() { check(t, "Unmap", d.Unmap(p, size)) }()
	pattern := randomBytes(t, size)
	must(t, d.CopyHtoD(p, pattern))

	fd, err := d.ExportFD(h)
	must(t, err)
	f := os.NewFile(uintptr(fd), "exported")
	defer f.Close()
	cmd := exec.Command(os.Args[0], "-test.run=^TestCrossProcessImport$", "-test.v", "-test.count=1")
	cmd.Env = append(os.Environ(), childEnv+"=import", "GPUSHM_CUDA_TEST_SIZE="+strconv.FormatInt(size, 10))
	cmd.ExtraFiles = []*os.File{f} // descriptor 3 in the child
	out, err := cmd.CombinedOutput()
	if err != nil || !bytes.Contains(out, []byte("--- PASS: TestCrossProcessImport")) {
		t.Fatalf("child failed: %v\n%s", err, out)
	}
	want := fmt.Sprintf("sha256=%x", sha256.Sum256(pattern))
	if !bytes.Contains(out, []byte(want)) {
		t.Errorf("child did not read the parent's data; want %s in:\n%s", want, out)
	}
}

func importChild(t *testing.T) {
	d := requireGPU(t)
	size, err := strconv.ParseInt(os.Getenv("GPUSHM_CUDA_TEST_SIZE"), 10, 64)
	must(t, err)
	h, err := d.ImportFD(3)
	must(t, err)
	defer func() { check(t, "Release", d.Release(h)) }()
	p, err := d.Map(h, size, true, d)
	must(t, err)
	defer func() { check(t, "Unmap", d.Unmap(p, size)) }()
	got := make([]byte, size)
	must(t, d.CopyDtoH(got, p))
	fmt.Printf("sha256=%x\n", sha256.Sum256(got))
}

// TestMultiGPU maps one device's memory for a second device, both within one
// mapping and through an imported handle mapped by the second device.
func TestMultiGPU(t *testing.T) {
	d0 := requireGPU(t)
	n, err := DeviceCount()
	must(t, err)
	if n < 2 {
		t.Skipf("needs 2 devices, have %d", n)
	}
	d1, err := GetDevice(1)
	must(t, err)
	if d1.Ordinal() != 1 {
		t.Fatalf("Ordinal = %d", d1.Ordinal())
	}
	peer, err := d1.CanAccessPeer(d0)
	must(t, err)
	t.Logf("device 1 can access device 0: %v", peer)
	if !peer {
		t.Skip("device 1 cannot access device 0's memory")
	}
	size := allocSize(t, d0, 2<<20)

	h, err := d0.Create(size)
	must(t, err)
	defer func() { check(t, "Release", d0.Release(h)) }()
	p, err := d0.Map(h, size, false, d0, d1)
	must(t, err)
	defer func() { check(t, "Unmap", d0.Unmap(p, size)) }()
	pattern := randomBytes(t, size)
	must(t, d0.CopyHtoD(p, pattern))
	got := make([]byte, size)
	must(t, d1.CopyDtoH(got, p))
	if !bytes.Equal(got, pattern) {
		t.Error("device 1 reads different data through a shared mapping")
	}

	fd, err := d0.ExportFD(h)
	must(t, err)
	defer closeFD(fd)
	h1, err := d1.ImportFD(fd)
	must(t, err)
	defer func() { check(t, "Release imported", d1.Release(h1)) }()
	p1, err := d1.Map(h1, size, true, d1)
	must(t, err)
	defer func() { check(t, "Unmap imported", d1.Unmap(p1, size)) }()
	clear(got)
	must(t, d1.CopyDtoH(got, p1))
	if !bytes.Equal(got, pattern) {
		t.Error("device 1 reads different data through its own mapping of device 0's memory")
	}
}

func BenchmarkCreateExportFD(b *testing.B) {
	d := requireGPU(b)
	size := allocSize(b, d, 2<<20)
	for b.Loop() {
		h, err := d.Create(size)
		if err != nil {
			b.Fatal(err)
		}
		fd, err := d.ExportFD(h)
		if err != nil {
			b.Fatal(err)
		}
		closeFD(fd)
		if err := d.Release(h); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkImportMapUnmap(b *testing.B) {
	d := requireGPU(b)
	size := allocSize(b, d, 2<<20)
	h, err := d.Create(size)
	must(b, err)
	defer d.Release(h)
	fd, err := d.ExportFD(h)
	must(b, err)
	defer closeFD(fd)
	for b.Loop() {
		h2, err := d.ImportFD(fd)
		if err != nil {
			b.Fatal(err)
		}
		p, err := d.Map(h2, size, true, d)
		if err != nil {
			b.Fatal(err)
		}
		if err := d.Unmap(p, size); err != nil {
			b.Fatal(err)
		}
		if err := d.Release(h2); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkStreamCopyHtoD measures pinned host-to-device bandwidth on a
// stream in 64 MiB copies.
func BenchmarkStreamCopyHtoD(b *testing.B) {
	d := requireGPU(b)
	size := allocSize(b, d, 64<<20)
	buf, err := d.AllocHost(size)
	must(b, err)
	defer d.FreeHost(buf)
	h, err := d.Create(size)
	must(b, err)
	defer d.Release(h)
	p, err := d.Map(h, size, false, d)
	must(b, err)
	defer d.Unmap(p, size)
	s, err := d.NewStream()
	must(b, err)
	defer s.Close()
	b.SetBytes(size)
	for b.Loop() {
		if err := s.CopyHtoDAsync(p, buf); err != nil {
			b.Fatal(err)
		}
		if err := s.Synchronize(); err != nil {
			b.Fatal(err)
		}
	}
}

// TestSyncEvent orders a host read after an async copy with an event whose
// Synchronize sleeps, and checks that it refuses to time.
func TestSyncEvent(t *testing.T) {
	d := requireGPU(t)
	size := allocSize(t, d, 8<<20)
	buf, err := d.AllocHost(2 * size)
	must(t, err)
	defer func() { check(t, "FreeHost", d.FreeHost(buf)) }()
	src, dst := buf[:size], buf[size:]
	copy(src, randomBytes(t, size))
	h, err := d.Create(size)
	must(t, err)
	defer func() { check(t, "Release", d.Release(h)) }()
	p, err := d.Map(h, size, false, d)
	must(t, err)
	defer func() { check(t, "Unmap", d.Unmap(p, size)) }()
	s, err := d.NewStream()
	must(t, err)
	defer func() { check(t, "Stream.Close", s.Close()) }()
	ev, err := d.NewSyncEvent()
	must(t, err)
	defer func() { check(t, "Event.Close", ev.Close()) }()

	must(t, s.CopyHtoDAsync(p, src))
	must(t, s.CopyDtoHAsync(dst, p))
	must(t, ev.Record(s))
	must(t, ev.Synchronize())
	if !bytes.Equal(dst, src) {
		t.Error("bytes differ after waiting on the sync event")
	}
	if _, err := ElapsedMs(ev, ev); !errors.Is(err, ErrInvalidHandle) {
		t.Errorf("ElapsedMs on an event without timing: %v, want ErrInvalidHandle", err)
	}
}
