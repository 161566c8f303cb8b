//go:build !linux || !cgo

package nvml

import "fmt"

// NVML is an initialised NVML; no value exists in this build.
type NVML struct{}

// Open fails with ErrUnavailable: this build cannot load NVML.
func Open(path string) (*NVML, error) {
	return nil, fmt.Errorf("%w: this build has no cgo or is not for linux", ErrUnavailable)
}

// Driver is never called in this build.
func (n *NVML) Driver() string { return "" }

// GPUs is never called in this build.
func (n *NVML) GPUs() ([]GPU, error) { return nil, ErrUnavailable }

// Close is never called in this build.
func (n *NVML) Close() error { return nil }
