package ucx

import (
	"errors"
	"fmt"
	"os"
	"time"
)

// Library is the file Load opens.
const Library = "libucp.so.0"

// ErrNoLibrary is returned, wrapped with the loader's reason, by Load and
// by everything that needs the library when libucp.so.0 cannot be loaded:
// UCX not installed, a build without cgo, or a platform other than Linux.
var ErrNoLibrary = errors.New("ucx: " + Library + " not found (install UCX's runtime: apt-get install libucx0 on Debian and Ubuntu)")

// ErrClosed is returned by operations on a closed Context, Worker, Endpoint
// or Region, and by a Get that its Endpoint's Close ended.
var ErrClosed = errors.New("ucx: closed")

// The shape of a Get: chunks of getChunk bytes, getDepth of them in flight.
// Variables so that tests can make many small chunks of a small buffer.
var (
	getChunk = 1 << 20
	getDepth = 16
)

// cancelGrace is how long a cancelled Get waits for its chunks in flight
// to finish before it closes the endpoint by force: UCX cannot cancel a
// get once issued, and the destination must not be written after Get
// returns.
const cancelGrace = time.Second

// Status is a ucs_status_t, UCX's result code: 0 is UCS_OK, 1
// UCS_INPROGRESS, negative values are errors.
type Status int8

// UCX status codes this package's callers may test for with errors.Is.
const (
	StatusCanceled        Status = -16 // UCS_ERR_CANCELED
	StatusConnectionReset Status = -25 // UCS_ERR_CONNECTION_RESET
	StatusEndpointTimeout Status = -80 // UCS_ERR_ENDPOINT_TIMEOUT
)

// Error prints UCX's own description (ucs_status_string) once the library
// is loaded, and the code.
func (s Status) Error() string {
	if msg, ok := statusString(s); ok {
		return fmt.Sprintf("%s (UCX status %d)", msg, int(s))
	}
	return fmt.Sprintf("UCX status %d", int(s))
}

// TCPSegment is the size of the tcp transport's send and receive buffers
// that this package asks UCX for, where UCX_TCP_TX_SEG_SIZE and
// UCX_TCP_RX_SEG_SIZE are not set: UCX's own 8 KiB moved 1.2 GB/s between
// two processes of an H200 machine over loopback, 64 KiB 2.8 GB/s, 512 KiB
// 3.3 GB/s (docs/benchmarks.md, "Beyond one node").
const TCPSegment = "512k"

// tcpDefaults sets the variables UCX reads its tcp configuration from,
// where the user has not: before the first context reads them.
func tcpDefaults() {
	for _, v := range []string{"UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"} {
		if _, ok := os.LookupEnv(v); !ok {
			os.Setenv(v, TCPSegment)
		}
	}
}

// Open loads UCX and makes a context and its worker; the caller closes
// both, the worker first.
func Open() (*Context, *Worker, error) {
	if err := Load(); err != nil {
		return nil, nil, err
	}
	c, err := NewContext()
	if err != nil {
		return nil, nil, err
	}
	w, err := c.NewWorker()
	if err != nil {
		c.Close()
		return nil, nil, err
	}
	return c, w, nil
}
