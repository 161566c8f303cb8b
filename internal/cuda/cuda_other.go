//go:build !linux || !cgo

package cuda

import "fmt"

// cgoBuild tells tests which implementation they run against.
const cgoBuild = false

// driverLibrary mirrors the cgo build so that tests compile in both.
var driverLibrary = "libcuda.so.1"

var errUnavailable = fmt.Errorf("%w: this build has no cgo or is not for linux", ErrNoDriver)

// Init always fails: without cgo on Linux the driver cannot be loaded.
func Init() error { return errUnavailable }

func probeLibrary(string) error { return errUnavailable }

func driverErrorName(Result) (string, bool) { return "", false }

func abiFacts() map[string]int64 { return nil }

// DriverVersion fails with ErrNoDriver in this build.
func DriverVersion() (int, error) { return 0, errUnavailable }

// DeviceCount fails with ErrNoDriver in this build.
func DeviceCount() (int, error) { return 0, errUnavailable }

// Device is a CUDA device; no value is usable in this build.
type Device struct{ ordinal int }

// GetDevice fails with ErrNoDriver in this build.
func GetDevice(int) (*Device, error) { return nil, errUnavailable }

// OrdinalOf needs the CUDA driver.
func OrdinalOf(string) (int, error) { return -1, errUnavailable }

// Ordinal returns the device ordinal, or -1 for a nil Device.
func (d *Device) Ordinal() int {
	if d == nil {
		return -1
	}
	return d.ordinal
}

// The methods below all fail with ErrNoDriver in this build.

func (d *Device) Name() (string, error)                    { return "", errUnavailable }
func (d *Device) UUID() (string, error)                    { return "", errUnavailable }
func (d *Device) TotalMem() (uint64, error)                { return 0, errUnavailable }
func (d *Device) MemInfo() (free, total uint64, err error) { return 0, 0, errUnavailable }
func (d *Device) VMMSupported() (bool, error)              { return false, errUnavailable }
func (d *Device) RDMACapable() bool                        { return false }
func (d *Device) HandleRDMA(Handle) (bool, error)          { return false, errUnavailable }
func (d *Device) Granularity() (int64, error)              { return 0, errUnavailable }
func (d *Device) CanAccessPeer(*Device) (bool, error)      { return false, errUnavailable }
func (d *Device) Create(int64) (Handle, error)             { return 0, errUnavailable }
func (d *Device) Release(Handle) error                     { return errUnavailable }
func (d *Device) ExportFD(Handle) (int, error)             { return -1, errUnavailable }
func (d *Device) ImportFD(int) (Handle, error)             { return 0, errUnavailable }
func (d *Device) Unmap(uint64, int64) error                { return errUnavailable }
func (d *Device) UnmapAt(uint64, int64) error              { return errUnavailable }
func (d *Device) Free(uint64, int64) error                 { return errUnavailable }
func (d *Device) Reserve(int64) (uint64, error)            { return 0, errUnavailable }
func (d *Device) HandleDevice(Handle) (int, bool, error)   { return 0, false, errUnavailable }
func (d *Device) MapAt(uint64, Handle, int64, bool, ...*Device) error {
	return errUnavailable
}
func (d *Device) CopyHtoD(uint64, []byte) error        { return errUnavailable }
func (d *Device) CopyDtoH([]byte, uint64) error        { return errUnavailable }
func (d *Device) CopyDtoD(uint64, uint64, int64) error { return errUnavailable }
func (d *Device) MemsetD8(uint64, byte, int64) error   { return errUnavailable }
func (d *Device) Synchronize() error                   { return errUnavailable }
func (d *Device) AllocHost(int64) ([]byte, error)      { return nil, errUnavailable }
func (d *Device) FreeHost([]byte) error                { return errUnavailable }
func (d *Device) NewStream() (*Stream, error)          { return nil, errUnavailable }
func (d *Device) NewEvent() (*Event, error)            { return nil, errUnavailable }
func (d *Device) NewSyncEvent() (*Event, error)        { return nil, errUnavailable }

func (d *Device) Map(Handle, int64, bool, ...*Device) (uint64, error) {
	return 0, errUnavailable
}

// Stream is a CUDA stream; no value is usable in this build.
type Stream struct{}

func (s *Stream) CopyHtoDAsync(uint64, []byte) error { return errUnavailable }
func (s *Stream) CopyDtoHAsync([]byte, uint64) error { return errUnavailable }
func (s *Stream) Synchronize() error                 { return errUnavailable }
func (s *Stream) Close() error                       { return errUnavailable }

// Event is a CUDA event; no value is usable in this build.
type Event struct{}

func (e *Event) Record(*Stream) error { return errUnavailable }
func (e *Event) Synchronize() error   { return errUnavailable }
func (e *Event) Close() error         { return errUnavailable }

// ElapsedMs fails with ErrNoDriver in this build.
func ElapsedMs(*Event, *Event) (float32, error) { return 0, errUnavailable }

func (s *Stream) CopyDtoDAsync(uint64, uint64, int64) error { return errUnavailable }
func (s *Stream) CopyPeerAsync(uint64, *Device, uint64, *Device, int64) error {
	return errUnavailable
}

func (d *Device) RegisterHost([]byte) (uint64, error) { return 0, errUnavailable }
func (d *Device) UnregisterHost([]byte) error         { return errUnavailable }
func (d *Device) ForeignStream(uintptr) *Stream       { return &Stream{} }
func (s *Stream) WriteValue64(uint64, uint64) error   { return errUnavailable }
func (s *Stream) WaitValue64(uint64, uint64) error    { return errUnavailable }

func (s *Stream) Handle() uintptr { return 0 }
