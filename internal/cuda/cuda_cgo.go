//go:build linux && cgo

package cuda

// Loading the driver (driver.c, driver.h), its errors, and devices with
// their primary contexts. The rest of the cgo side, by concern:
// memory_cgo.go (VMM allocations, export, import, mapping), copy_cgo.go
// (copies, pinned host memory), stream_cgo.go (streams, events, stream
// memory operations), abi_cgo.go (layouts for the tests).

/*
#cgo LDFLAGS: -ldl
#include "driver.h"
*/
import "C"

import (
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"
)

// cgoBuild tells tests which implementation they run against.
const cgoBuild = true

// driverLibrary is a variable only so that tests can make loading fail on a
// machine that has a driver.
var driverLibrary = "libcuda.so.1"

// maxAccessDevices bounds the access list of one Map; it matches the fixed
// descriptor array in gs_setAccess, which keeps Go pointers out of C.
const maxAccessDevices = 64

var (
	initOnce sync.Once
	initErr  error
	// loaded is set once the symbol table is installed, which may be before
	// cuInit fails; it only gates driverErrorName.
	loaded atomic.Bool
)

// Init loads libcuda.so.1, resolves every symbol the package uses and calls
// cuInit(0). It runs once per process; later calls return the first result.
// Every other function and method calls it, so calling it explicitly is only
// needed to learn early whether a GPU is usable.
func Init() error {
	initOnce.Do(func() { initErr = initDriver() })
	return initErr
}

func initDriver() error {
	if err := openLibrary(driverLibrary, true); err != nil {
		return err
	}
	loaded.Store(true)
	if r := C.gs_cuInit(0); r != 0 {
		return fmt.Errorf("cuInit: %w", Result(r))
	}
	return nil
}

// openLibrary loads path and resolves the package's symbols in it, installing
// them for the trampolines only when install is set.
func openLibrary(path string, install bool) error {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var msg [512]C.char
	inst := C.int(0)
	if install {
		inst = 1
	}
	switch C.gpushm_open(cpath, inst, &msg[0], C.size_t(len(msg))) {
	case C.GPUSHM_OPEN_OK:
		return nil
	case C.GPUSHM_OPEN_NO_LIBRARY:
		return fmt.Errorf("%w: %s", ErrNoDriver, C.GoString(&msg[0]))
	default:
		return fmt.Errorf("cuda: %s lacks symbol %s; the NVIDIA driver is too old", path, C.GoString(&msg[0]))
	}
}

// probeLibrary resolves the package's symbols in path without installing
// them, so tests can check the loader's error paths.
func probeLibrary(path string) error { return openLibrary(path, false) }

// driverErrorName asks the loaded driver for names of codes newer than
// resultNames.
func driverErrorName(r Result) (string, bool) {
	if !loaded.Load() {
		return "", false
	}
	var s *C.char
	if C.gs_cuGetErrorName(C.CUresult(r), &s) != 0 || s == nil {
		return "", false
	}
	return C.GoString(s), true
}

func wrap(call string, r C.CUresult) error {
	if r == 0 {
		return nil
	}
	return fmt.Errorf("%s: %w", call, Result(r))
}

// DriverVersion returns the CUDA version the driver supports, encoded as
// 1000*major + 10*minor (13000 for CUDA 13.0).
func DriverVersion() (int, error) {
	if err := Init(); err != nil {
		return 0, err
	}
	var v C.int
	if err := wrap("cuDriverGetVersion", C.gs_cuDriverGetVersion(&v)); err != nil {
		return 0, err
	}
	return int(v), nil
}

// DeviceCount returns the number of CUDA devices visible to this process.
func DeviceCount() (int, error) {
	if err := Init(); err != nil {
		return 0, err
	}
	var n C.int
	if err := wrap("cuDeviceGetCount", C.gs_cuDeviceGetCount(&n)); err != nil {
		return 0, err
	}
	return int(n), nil
}

// Device is one CUDA device with its retained primary context. Obtain it from
// GetDevice; the zero value is not usable. A Device is safe for concurrent
// use.
type Device struct {
	ordinal int
	dev     C.CUdevice
	ctx     C.CUcontext
	gran    atomic.Int64 // cached Granularity; 0 until first known
	rdma    atomic.Int32 // cached RDMACapable: 0 until known, 1 no, 2 yes
}

var devices struct {
	mu sync.Mutex
	m  map[int]*Device
}

// GetDevice returns the device with that ordinal. The first call for an
// ordinal retains the device's primary context, which is kept until the
// process exits; later calls return the same *Device.
func GetDevice(ordinal int) (*Device, error) {
	if err := Init(); err != nil {
		return nil, err
	}
	devices.mu.Lock()
	defer devices.mu.Unlock()
	if d, ok := devices.m[ordinal]; ok {
		return d, nil
	}
	if ordinal < 0 || int64(ordinal) > int64(^uint32(0)>>1) {
		return nil, fmt.Errorf("cuda: device ordinal %d: %w", ordinal, ErrInvalidDevice)
	}
	var dev C.CUdevice
	if err := wrap("cuDeviceGet", C.gs_cuDeviceGet(&dev, C.int(ordinal))); err != nil {
		return nil, err
	}
	var ctx C.CUcontext
	if err := wrap("cuDevicePrimaryCtxRetain", C.gs_cuDevicePrimaryCtxRetain(&ctx, dev)); err != nil {
		return nil, err
	}
	d := &Device{ordinal: ordinal, dev: dev, ctx: ctx}
	if devices.m == nil {
		devices.m = make(map[int]*Device)
	}
	devices.m[ordinal] = d
	return d, nil
}

var errBadDevice = fmt.Errorf("cuda: device not obtained from GetDevice: %w", ErrInvalidDevice)

// check guards every method: the trampolines must never run before the
// symbol table is installed, nor with a zero Device.
func (d *Device) check() error {
	if err := Init(); err != nil {
		return err
	}
	if d == nil || d.ctx == nil {
		return errBadDevice
	}
	return nil
}

// withCtx runs fn with d's primary context current on a locked OS thread,
// because the driver's current context is a property of the OS thread and the
// Go scheduler may otherwise move the goroutine between the two C calls.
func (d *Device) withCtx(fn func() error) error {
	if err := d.check(); err != nil {
		return err
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := wrap("cuCtxSetCurrent", C.gs_cuCtxSetCurrent(d.ctx)); err != nil {
		return err
	}
	return fn()
}

// Ordinal returns the ordinal passed to GetDevice, or -1 for a nil Device.
func (d *Device) Ordinal() int {
	if d == nil {
		return -1
	}
	return d.ordinal
}

// Name returns the product name, such as "NVIDIA H100 80GB HBM3".
func (d *Device) Name() (string, error) {
	if err := d.check(); err != nil {
		return "", err
	}
	var buf [256]C.char
	if err := wrap("cuDeviceGetName", C.gs_cuDeviceGetName(&buf[0], C.int(len(buf)), d.dev)); err != nil {
		return "", err
	}
	buf[len(buf)-1] = 0
	return C.GoString(&buf[0]), nil
}

// UUID returns the device UUID in the form nvidia-smi prints,
// "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".
func (d *Device) UUID() (string, error) {
	if err := d.check(); err != nil {
		return "", err
	}
	return uuidOf(d.dev)
}

func uuidOf(dev C.CUdevice) (string, error) {
	var u C.CUuuid
	if err := wrap("cuDeviceGetUuid", C.gs_cuDeviceGetUuid(&u, dev)); err != nil {
		return "", err
	}
	var b [16]byte
	for i := range b {
		b[i] = byte(u.bytes[i])
	}
	return fmt.Sprintf("GPU-%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16]), nil
}

var uuids struct {
	once sync.Once
	m    map[string]int // UUID, lower case, to this process's ordinal
	err  error
}

// OrdinalOf returns this process's ordinal of the GPU with that UUID
// ("GPU-…", case ignored), or ErrInvalidDevice when the process cannot see
// it (CUDA_VISIBLE_DEVICES, a container given other GPUs). Another process
// may number the same GPU differently; the UUID is the same everywhere.
// No context is made.
func OrdinalOf(uuid string) (int, error) {
	uuids.once.Do(func() {
		n, err := DeviceCount()
		if err != nil {
			uuids.err = err
			return
		}
		uuids.m = make(map[string]int, n)
		for i := range n {
			var dev C.CUdevice
			if err := wrap("cuDeviceGet", C.gs_cuDeviceGet(&dev, C.int(i))); err != nil {
				uuids.err = err
				return
			}
			u, err := uuidOf(dev)
			if err != nil {
				uuids.err = err
				return
			}
			uuids.m[strings.ToLower(u)] = i
		}
	})
	if uuids.err != nil {
		return -1, uuids.err
	}
	if i, ok := uuids.m[strings.ToLower(uuid)]; ok {
		return i, nil
	}
	return -1, fmt.Errorf("cuda: GPU %s is not among the %d this process can see (CUDA_VISIBLE_DEVICES, or a container given other GPUs?): %w",
		uuid, len(uuids.m), ErrInvalidDevice)
}

// TotalMem returns the device's total memory in bytes.
func (d *Device) TotalMem() (uint64, error) {
	if err := d.check(); err != nil {
		return 0, err
	}
	var n C.size_t
	if err := wrap("cuDeviceTotalMem", C.gs_cuDeviceTotalMem(&n, d.dev)); err != nil {
		return 0, err
	}
	return uint64(n), nil
}

// MemInfo returns the free and total memory of the device as its primary
// context sees them.
func (d *Device) MemInfo() (free, total uint64, err error) {
	var f, t C.size_t
	err = d.withCtx(func() error {
		return wrap("cuMemGetInfo", C.gs_cuMemGetInfo(&f, &t))
	})
	if err != nil {
		return 0, 0, err
	}
	return uint64(f), uint64(t), nil
}

func (d *Device) attribute(attr C.int) (int, error) {
	if err := d.check(); err != nil {
		return 0, err
	}
	var v C.int
	if err := wrap("cuDeviceGetAttribute", C.gs_cuDeviceGetAttribute(&v, attr, d.dev)); err != nil {
		return 0, err
	}
	return int(v), nil
}

// VMMSupported reports whether the device supports the virtual memory
// management calls and exporting allocations as POSIX file descriptors, both
// of which the rest of the package needs.
func (d *Device) VMMSupported() (bool, error) {
	vmm, err := d.attribute(C.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)
	if err != nil {
		return false, err
	}
	fd, err := d.attribute(C.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)
	if err != nil {
		return false, err
	}
	return vmm != 0 && fd != 0, nil
}

// RDMACapable reports whether d makes VMM allocations that an RDMA engine
// can register (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED):
// Create then asks for every allocation to be, as NIXL, UCX and Mooncake
// need (ibv_reg_mr fails on VMM memory made without the flag). A driver
// that cannot answer counts as no. Queried once.
func (d *Device) RDMACapable() bool {
	if rdmaOff.Load() {
		return false
	}
	switch d.rdma.Load() {
	case 1:
		return false
	case 2:
		return true
	}
	v, err := d.attribute(C.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)
	yes := err == nil && v != 0
	d.rdma.Store(int32(1 + b2i(yes)))
	return yes
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// Granularity returns the minimum allocation granularity for pinned device
// memory exportable as a POSIX file descriptor; sizes passed to Create and
// Map must be multiples of it. The value is queried once and cached.
func (d *Device) Granularity() (int64, error) {
	if err := d.check(); err != nil {
		return 0, err
	}
	if g := d.gran.Load(); g != 0 {
		return g, nil
	}
	var g C.size_t
	if err := wrap("cuMemGetAllocationGranularity", C.gs_granularity(&g, C.int(d.ordinal))); err != nil {
		return 0, err
	}
	if g == 0 {
		return 0, fmt.Errorf("cuMemGetAllocationGranularity: driver reported 0: %w", ErrUnknown)
	}
	d.gran.Store(int64(g))
	return int64(g), nil
}

// CanAccessPeer reports cuDeviceCanAccessPeer(d, peer): whether d can map
// and access memory that resides on peer. The driver reports false for a
// device and itself (seen on driver 580), which callers need not ask about.
func (d *Device) CanAccessPeer(peer *Device) (bool, error) {
	if err := d.check(); err != nil {
		return false, err
	}
	if err := peer.check(); err != nil {
		return false, err
	}
	var v C.int
	if err := wrap("cuDeviceCanAccessPeer", C.gs_cuDeviceCanAccessPeer(&v, d.dev, peer.dev)); err != nil {
		return false, err
	}
	return v != 0, nil
}
