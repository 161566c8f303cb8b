// Package pull moves a segment's bytes from a daemon on one node to a
// daemon on another over UCX (internal/ucx), in two helper processes the
// daemons exec: a lender that holds only the segment it lends, read-only,
// and a fetcher that holds only the segment it fills. UCX over tcp checks
// neither the key nor the range of a get (docs/architecture.md, "Peers:
// the data path"), so neither daemon runs a worker itself: a peer that
// reaches a helper's port can read the one segment its owner offered, and
// nothing else.
//
// The lender computes a CRC-32C of each chunk of what it lends; the
// fetcher checks every chunk it gets against them, so that a peer that
// sends wrong bytes, or a wrong size, is caught.
package pull

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"syscall"
	"time"
)

// Chunk is the unit of checksums and of gets.
const Chunk = 16 << 20

// Grant is what a lender tells the fetcher, through the daemons' control
// plane: its worker's address, the address and key of what it lends, the
// size, and each chunk's CRC-32C.
type Grant struct {
	Worker []byte   `json:"worker"`
	Addr   uint64   `json:"addr"`
	RKey   []byte   `json:"rkey"`
	Size   int64    `json:"size"`
	Chunk  int64    `json:"chunk"`
	CRCs   []uint32 `json:"crcs"`
}

// check says what is wrong with g for size bytes, or nil.
func (g *Grant) check(size int64) error {
	switch {
	case g.Size != size:
		return fmt.Errorf("the lender offers %d bytes, the segment has %d", g.Size, size)
	case g.Chunk <= 0 || g.Chunk > 1<<30:
		return fmt.Errorf("a chunk of %d bytes", g.Chunk)
	case int64(len(g.CRCs)) != (g.Size+g.Chunk-1)/g.Chunk:
		return fmt.Errorf("%d checksums for %d bytes in chunks of %d", len(g.CRCs), g.Size, g.Chunk)
	case len(g.Worker) == 0 || len(g.RKey) == 0:
		return errors.New("no worker address or key")
	}
	return nil
}

// self is the gpushm binary the helpers run.
func self() string {
	if p, err := os.Executable(); err == nil {
		return p
	}
	return "/proc/self/exe"
}

// helper starts 'gpushm __pull VERB' with fd as its descriptor 3; the
// helper dies with the thread that started it (PR_SET_PDEATHSIG), so a
// daemon killed leaves none behind.
func helper(verb string, fd int, args ...string) (*exec.Cmd, io.WriteCloser, *bufio.Reader, error) {
	dup, err := syscall.Dup(fd)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("dup: %w", err)
	}
	f := os.NewFile(uintptr(dup), "segment")
	defer f.Close()
	cmd := exec.Command(self(), append([]string{"__pull", verb}, args...)...)
	cmd.Args[0] = "gpushm-" + verb
	cmd.ExtraFiles = []*os.File{f}
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, nil, nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, nil, nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, nil, nil, fmt.Errorf("start the %s helper: %w", verb, err)
	}
	return cmd, in, bufio.NewReader(out), nil
}

// A Lender lends one segment until Close.
type Lender struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	Grant Grant
}

// Lend starts a lender of size bytes of the memory fd (the helper gets a
// descriptor of its own; a read-only one is the caller's to give), and
// returns once it serves, with its Grant.
func Lend(fd int, size int64) (*Lender, error) {
	if size <= 0 {
		return nil, fmt.Errorf("lend: %d bytes: nothing to lend", size)
	}
	cmd, in, out, err := helper("lend", fd, "--size", fmt.Sprint(size))
	if err != nil {
		return nil, err
	}
	l := &Lender{cmd: cmd, stdin: in}
	line, err := out.ReadBytes('\n')
	if err == nil {
		err = json.Unmarshal(line, &l.Grant)
	}
	if err != nil {
		l.Close()
		return nil, fmt.Errorf("the lender did not start: %w", err)
	}
	return l, nil
}

// Close ends the lender: its stdin closes, and it exits (killed after 5 s).
func (l *Lender) Close() error {
	l.stdin.Close()
	done := make(chan error, 1)
	go func() { done <- l.cmd.Wait() }()
	select {
	case err := <-done:
		return err
	case <-time.After(5 * time.Second):
		l.cmd.Process.Kill()
		return <-done
	}
}

// Fetch fills size bytes of the memory fd from a lender's grant, in a
// fetcher helper, every chunk checked; ctx ends it (the helper is killed).
func Fetch(ctx context.Context, fd int, size int64, g Grant) error {
	if err := g.check(size); err != nil {
		return fmt.Errorf("fetch: %w", err)
	}
	cmd, in, out, err := helper("fetch", fd)
	if err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, func() { cmd.Process.Kill() })
	defer stop()
	err = json.NewEncoder(in).Encode(g)
	in.Close()
	var res struct {
		Error string `json:"error"`
	}
	if err == nil {
		var line []byte
		if line, err = out.ReadBytes('\n'); err == nil {
			err = json.Unmarshal(line, &res)
		}
	}
	werr := cmd.Wait()
	switch {
	case ctx.Err() != nil:
		return fmt.Errorf("fetch: %w", context.Cause(ctx))
	case res.Error != "":
		return errors.New(res.Error)
	case err != nil:
		return fmt.Errorf("fetch: the helper failed: %v (%v)", err, werr)
	}
	return werr
}
