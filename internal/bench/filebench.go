package bench

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/bytesize"
)

func benchFilesCmd() *cobra.Command {
	var (
		backend string
		sizes   string
		dir     string
		reps    int
	)
	cmd := &cobra.Command{
		Use:   "files",
		Short: "Time put and get as whole commands against cp and cat, in the same run",
		Long: `For each size, on a private daemon, with a file of random bytes in DIR (a
tmpfs, /dev/shm by default, so that reads come from memory as from a warm
page cache), each a fresh process, best of --reps:

  gpushm put NAME SRC           the whole command: start, connect, create,
                                the daemon's copy (fill), commit
  gpushm get NAME /dev/null     the daemon's copy out (dump) to a device
  gpushm get NAME DIR/out       into a new file in DIR
  cp SRC DIR/cp                 the peer for get into DIR
  cat SRC > /dev/null           a single reader of SRC

The bytes got back are compared with SRC. Rates are the size over the whole
command's time; ratios compare get with cp in the same run.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			list, err := parseSizes(sizes, "--reps", reps)
			if err != nil {
				return err
			}
			return withPrivateDaemon(cmd.Context(), backend, func(d *privateDaemon, c *gpushm.Client) error {
				return benchFiles(cmd.Context(), d, c, list, dir, reps)
			})
		},
	}
	cmd.Flags().StringVar(&backend, "backend", "auto", "backend: auto, cuda or host")
	cmd.Flags().StringVar(&sizes, "sizes", "4GiB", "comma-separated file sizes")
	cmd.Flags().StringVar(&dir, "dir", "/dev/shm", "where the files go (a tmpfs, for reads from memory)")
	cmd.Flags().IntVar(&reps, "reps", 3, "runs of each command; the best counts")
	return cmd
}

func benchFiles(ctx context.Context, d *privateDaemon, c *gpushm.Client, sizes []int64, dir string, reps int) error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	work, err := os.MkdirTemp(dir, "gpushm-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)
	type row struct {
		size                           int64
		put, getNull, getFile, cp, cat time.Duration
		same                           bool
	}
	var rows []row
	for _, size := range sizes {
		src := filepath.Join(work, "src")
		if err := writeRandom(src, size); err != nil {
			return err
		}
		r := row{size: size}
		best := func(cur *time.Duration, name string, args ...string) error {
			for range reps {
				t, err := timeCommand(ctx, d.socket, name, args...)
				if err != nil {
					return err
				}
				if *cur == 0 || t < *cur {
					*cur = t
				}
			}
			return nil
		}
		for range reps {
			c.Unlink(ctx, "bench-files")
			t, err := timeCommand(ctx, d.socket, self, "put", "bench-files", src)
			if err != nil {
				return err
			}
			if r.put == 0 || t < r.put {
				r.put = t
			}
		}
		out, cpOut := filepath.Join(work, "out"), filepath.Join(work, "cp")
		if err := best(&r.getNull, self, "get", "bench-files", os.DevNull); err != nil {
			return err
		}
		for range reps {
			os.Remove(out) // a new file each time, as cp makes
			t, err := timeCommand(ctx, d.socket, self, "get", "bench-files", out)
			if err != nil {
				return err
			}
			if r.getFile == 0 || t < r.getFile {
				r.getFile = t
			}
		}
		for range reps {
			os.Remove(cpOut)
			t, err := timeCommand(ctx, d.socket, "cp", src, cpOut)
			if err != nil {
				return err
			}
			if r.cp == 0 || t < r.cp {
				r.cp = t
			}
		}
		if err := best(&r.cat, "sh", "-c", "cat \"$0\" > /dev/null", src); err != nil {
			return err
		}
		if r.same, err = sameFiles(src, out); err != nil {
			return err
		}
		if err := c.Unlink(ctx, "bench-files"); err != nil {
			return err
		}
		os.Remove(out)
		os.Remove(cpOut)
		os.Remove(src)
		rows = append(rows, r)
		if !r.same {
			return fmt.Errorf("bench files: the %s got back differs from what was put", bytesize.Format(size))
		}
	}
	fmt.Printf("gpushm bench files: backend %s, files in %s, whole commands, best of %d, %s\n\n",
		c.Backend(), dir, reps, time.Now().UTC().Format("2006-01-02"))
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
	rate := func(n int64, t time.Duration) string {
		return fmt.Sprintf("%s (%.2f GB/s)", fmtDur(t), float64(n)/t.Seconds()/1e9)
	}
	fmt.Fprintln(w, "size\tput\tget > /dev/null\tget > file\tcp file file\tcat > /dev/null\tget file / cp\tverified\t")
	for _, r := range rows {
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%.2fx\t%v\t\n", bytesize.Format(r.size), rate(r.size, r.put),
			rate(r.size, r.getNull), rate(r.size, r.getFile), rate(r.size, r.cp), rate(r.size, r.cat),
			r.cp.Seconds()/r.getFile.Seconds(), r.same)
	}
	return w.Flush()
}

// timeCommand runs a command to its end and times it, the daemon's socket
// in its environment.
func timeCommand(ctx context.Context, socket, name string, args ...string) (time.Duration, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = append(os.Environ(), "GPUSHM_SOCKET="+socket)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	t := time.Now()
	if err := cmd.Run(); err != nil {
		return 0, fmt.Errorf("%s %v: %w: %s", name, args, err, stderr.String())
	}
	return time.Since(t), nil
}

func writeRandom(path string, size int64) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	// 64 MiB of random bytes, repeated with a counter mixed in, so that no
	// two chunks are equal and writing 16 GiB takes seconds, not minutes.
	block := make([]byte, min(size, 64<<20))
	if _, err := rand.Read(block); err != nil {
		f.Close()
		return err
	}
	for off, i := int64(0), 0; off < size; off, i = off+int64(len(block)), i+1 {
		n := min(int64(len(block)), size-off)
		block[0], block[1] = byte(i), byte(i>>8)
		if _, err := f.WriteAt(block[:n], off); err != nil {
			f.Close()
			return err
		}
	}
	return f.Close()
}

func sameFiles(a, b string) (bool, error) {
	fa, err := os.Open(a)
	if err != nil {
		return false, err
	}
	defer fa.Close()
	fb, err := os.Open(b)
	if err != nil {
		return false, err
	}
	defer fb.Close()
	ba, bb := make([]byte, 4<<20), make([]byte, 4<<20)
	for {
		na, ea := io.ReadFull(fa, ba)
		nb, eb := io.ReadFull(fb, bb)
		if na != nb || !bytes.Equal(ba[:na], bb[:nb]) {
			return false, nil
		}
		if ea != nil || eb != nil {
			return ea == eb || (ea == io.ErrUnexpectedEOF && eb == io.ErrUnexpectedEOF), nil
		}
	}
}
