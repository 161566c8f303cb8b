package gpushm

import (
	"time"

	"github.com/gpushm/gpushm/internal/wire"
)

// Error is an error reported by the daemon. errors.Is matches it against
// its errno (syscall.ENOENT, ...) and the fs errors (fs.ErrNotExist, ...).
type Error = wire.Error

// SegmentInfo describes a segment as the daemon reports it.
type SegmentInfo = wire.Segment

// Trace is the daemon's timing of one request, for benchmarks
// (CreateOptions.Trace, OpenOptions.Trace): the time from reading the
// request to its reply, and its steps in order (docs/protocol.md, "Tracing
// a request").
type Trace = wire.Trace

// Device describes a device the daemon allocates on.
type Device = wire.Device

// Info is what the daemon reports about itself. The JSON names are the
// protocol's.
type Info struct {
	Server  string   `json:"server"`
	Backend string   `json:"backend"` // "cuda" or "host"
	Devices []Device `json:"devices"`
	Usage   Usage    `json:"usage"`
	// GPU is the node's GPUs as the daemon sees them (NVML's figures, or
	// the driver's); nil from a daemon that does not report them.
	GPU *GPUReport `json:"gpu,omitempty"`
	// PID is the process serving the socket; SupervisorPID the one holding
	// the segments across the serving process's restarts (equal to PID for
	// an unsupervised daemon). Restarts counts serving processes that died
	// and were replaced; Grace is what is left of the grace period in
	// which clients of a replaced process reclaim their leases.
	PID           int           `json:"pid"`
	SupervisorPID int           `json:"supervisor_pid"`
	Restarts      int           `json:"restarts"`
	Grace         time.Duration `json:"-"`
	GraceSeconds  float64       `json:"grace_seconds,omitempty"`
	// Pool is what the daemon holds of allocations made ahead of time,
	// which a create takes first; nil while it holds none.
	Pool *Pool `json:"pool,omitempty"`
	// Tiers is each device's budget and use, what was evicted to host
	// memory and what moved (docs/architecture.md, "Tiers"); nil from a
	// daemon without tiers.
	Tiers *Tiers `json:"tiers,omitempty"`
	// Users is what each uid holds on each device, and Quotas the limits
	// in force with their use (the asker's own user limits included,
	// whether or not it holds anything); both nil from a daemon from
	// before them.
	Users  []UserUse `json:"users,omitempty"`
	Quotas []Quota   `json:"quotas,omitempty"`
}

// Tiers is the daemon's budgets and eviction (Info).
type Tiers = wire.Tiers

// UserUse is what one uid holds on one device (Info).
type UserUse = wire.UserUse

// Quota is one limit in force and its use (Info).
type Quota = wire.Quota

// Usage is what the daemon holds.
type Usage = wire.Usage

// Pool is the daemon's pool of allocations made ahead of time (Info).
type Pool = wire.Pool

// GPUReport is what the daemon knows of the node's GPUs, and from where.
type GPUReport = wire.GPUReport
