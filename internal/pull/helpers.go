package pull

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/crc32c"
	"github.com/gpushm/gpushm/internal/ucx"
)

// Command is the hidden __pull command: the helpers' halves, run in
// processes of their own with the segment as descriptor 3.
func Command() *cobra.Command {
	cmd := &cobra.Command{Use: "__pull", Hidden: true, Args: cobra.NoArgs}
	var size int64
	lend := &cobra.Command{
		Use: "lend", Args: cobra.NoArgs, SilenceUsage: true,
		RunE: func(*cobra.Command, []string) error { return runLend(size) },
	}
	lend.Flags().Int64Var(&size, "size", 0, "bytes to lend")
	fetch := &cobra.Command{
		Use: "fetch", Args: cobra.NoArgs, SilenceUsage: true,
		RunE: func(*cobra.Command, []string) error { return runFetch() },
	}
	cmd.AddCommand(lend, fetch)
	return cmd
}

// corruptEnv, for tests, makes a lender serve one byte that is not the
// segment's: the fetcher must catch it.
const corruptEnv = "GPUSHM_TEST_LEND_CORRUPT"

// runLend maps descriptor 3 copy-on-write (UCX may touch what it
// registers; the segment stays as it is), checksums it, serves gets until
// stdin closes, and says how to reach it on stdout.
func runLend(size int64) error {
	b, err := unix.Mmap(3, 0, int(size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE)
	if err != nil {
		return fmt.Errorf("lend: map the segment: %w", err)
	}
	defer unix.Munmap(b)
	g := Grant{Size: size, Chunk: Chunk}
	for off := int64(0); off < size; off += Chunk {
		g.CRCs = append(g.CRCs, crc32c.Checksum(b[off:min(off+Chunk, size)]))
	}
	if os.Getenv(corruptEnv) != "" {
		b[size/2] ^= 0x40
	}
	c, w, err := worker()
	if err != nil {
		return err
	}
	defer c.Close()
	defer w.Close()
	r, err := c.Map(b)
	if err != nil {
		return err
	}
	defer r.Free()
	if g.RKey, err = r.PackKey(); err != nil {
		return err
	}
	if g.Worker, err = w.Address(); err != nil {
		return err
	}
	g.Addr = r.Addr()
	if err := json.NewEncoder(os.Stdout).Encode(g); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		var buf [1]byte
		os.Stdin.Read(buf[:]) // EOF: the daemon is done with this loan
		cancel()
	}()
	err = w.Serve(ctx)
	if ctx.Err() != nil {
		return nil
	}
	return err
}

// runFetch reads a Grant on stdin, gets every chunk into descriptor 3,
// checks each, and writes {"error": ...} (empty for none) on stdout.
func runFetch() error {
	err := fetch()
	msg := ""
	if err != nil {
		msg = err.Error()
	}
	return json.NewEncoder(os.Stdout).Encode(struct {
		Error string `json:"error"`
	}{msg})
}

func fetch() error {
	var g Grant
	if err := json.NewDecoder(os.Stdin).Decode(&g); err != nil {
		return fmt.Errorf("fetch: the grant: %w", err)
	}
	if err := g.check(g.Size); err != nil {
		return fmt.Errorf("fetch: %w", err)
	}
	b, err := unix.Mmap(3, 0, int(g.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("fetch: map the segment: %w", err)
	}
	defer unix.Munmap(b)
	c, w, err := worker()
	if err != nil {
		return err
	}
	defer c.Close()
	defer w.Close()
	ep, err := w.Connect(g.Worker)
	if err != nil {
		return err
	}
	defer ep.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	for i, off := 0, int64(0); off < g.Size; i, off = i+1, off+g.Chunk {
		end := min(off+g.Chunk, g.Size)
		if err := ep.Get(ctx, b[off:end], g.Addr+uint64(off), g.RKey); err != nil {
			return fmt.Errorf("fetch: bytes %d to %d: %w", off, end, err)
		}
		if got := crc32c.Checksum(b[off:end]); got != g.CRCs[i] {
			return fmt.Errorf("fetch: chunk %d (bytes %d to %d) fails its checksum (crc32c %08x, the lender's %08x): the peer sent wrong bytes", i, off, end, got, g.CRCs[i])
		}
	}
	return nil
}

// worker loads UCX and makes a context and its worker; the caller closes
// both, the worker first.
func worker() (*ucx.Context, *ucx.Worker, error) {
	if err := ucx.Load(); err != nil {
		return nil, nil, err
	}
	c, err := ucx.NewContext()
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
