//go:build !linux || !cgo

package ucx

import (
	"context"
	"fmt"
)

// cgoBuild tells tests which implementation they run against.
const cgoBuild = false

// library mirrors the cgo build so that tests compile in both.
var library = Library

var errUnavailable = fmt.Errorf("%w: this build has no cgo or is not for linux", ErrNoLibrary)

// Load always fails: without cgo on Linux the library cannot be loaded.
func Load() error { return errUnavailable }

func probeLibrary(string) error { return errUnavailable }

func statusString(Status) (string, bool) { return "", false }

func abiFacts() map[string]int64 { return nil }

// Version returns "" in this build.
func Version() string { return "" }

// A Context is a UCP context; none can be made in this build.
type Context struct{}

// NewContext fails with ErrNoLibrary in this build.
func NewContext() (*Context, error) { return nil, errUnavailable }

// Close fails in this build.
func (c *Context) Close() error { return errUnavailable }

// A Worker is a UCP worker; none can be made in this build.
type Worker struct{}

// NewWorker fails in this build.
func (c *Context) NewWorker() (*Worker, error) { return nil, errUnavailable }

// Address fails in this build.
func (w *Worker) Address() ([]byte, error) { return nil, errUnavailable }

// Close fails in this build.
func (w *Worker) Close() error { return errUnavailable }

// Serve fails in this build.
func (w *Worker) Serve(context.Context) error { return errUnavailable }

// An Endpoint is a connection to a peer's worker; none can be made in this
// build.
type Endpoint struct{}

// Connect fails in this build.
func (w *Worker) Connect([]byte) (*Endpoint, error) { return nil, errUnavailable }

// Close fails in this build.
func (e *Endpoint) Close() error { return errUnavailable }

// Get fails in this build.
func (e *Endpoint) Get(context.Context, []byte, uint64, []byte) error { return errUnavailable }

// Put fails in this build.
func (e *Endpoint) Put(context.Context, []byte, uint64, []byte) error { return errUnavailable }

// A Region is registered memory; none can be made in this build.
type Region struct{}

// Map fails in this build.
func (c *Context) Map([]byte) (*Region, error) { return nil, errUnavailable }

// Addr is 0 in this build.
func (r *Region) Addr() uint64 { return 0 }

// Len is 0 in this build.
func (r *Region) Len() int { return 0 }

// PackKey fails in this build.
func (r *Region) PackKey() ([]byte, error) { return nil, errUnavailable }

// Free fails in this build.
func (r *Region) Free() error { return errUnavailable }
