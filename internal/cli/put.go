package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/checkpoint"
	"github.com/gpushm/gpushm/internal/bytesize"
	"github.com/gpushm/gpushm/internal/complete"
	"github.com/gpushm/gpushm/internal/exitcode"
	"github.com/gpushm/gpushm/internal/interrupt"
	"github.com/gpushm/gpushm/internal/progress"
	"github.com/gpushm/gpushm/internal/report"
)

// putLong is put's help.
const putLong = `Copy FILE into a new segment NAME of exactly the file's size. With FILE '-',
standard input is spooled to a temporary file first, to learn its size. A
safetensors file becomes a tensor bundle as it is (its header is checked
first).

A directory is a checkpoint, as Hugging Face lays them out: its *.safetensors
shards (those model.safetensors.index.json names, when there is an index)
become one bundle whose safetensors header names every tensor, and every
other regular file at its top level of at most 64 MiB (config.json,
generation_config.json, tokenizer files, the index) is kept in the same
segment, so that 'gpushm get NAME DIR' writes the directory back. Every
header is checked before anything is allocated. What is not kept is named
on standard error.

Several copiers read in parallel, each through two pinned buffers and its
own CUDA stream; chunks the page cache does not hold are read with O_DIRECT
where the file system allows it. On a terminal a bar shows the bytes
copied, the rate and the time left, whichever side copies.

Whoever copies a safetensors file (the daemon, or this process) computes
its CRC-32C while copying, and the bundle records where each came from:
the directory, symbolic links resolved, and each file's identity (size,
times, device and inode, following links) with its checksum, so that a
loader opening that path may serve it from the bundle while the file is
unchanged (docs/protocol.md, "Where a bundle came from"). A file written
during the copy fails the put.

The segment is created uncommitted and committed once it is full: until
then 'gpushm ls' lists it as incomplete, and opens and 'gpushm get' refuse
it (or wait for it, with --wait). If anything fails, or put is killed, the
segment goes with it; Ctrl-C stops put with status 130, and leaves no
segment (from '-', it stops reading at once).

With --force (-f; --new-version is the same flag, by the protocol's name
for it), NAME is replaced if it exists, as cp -f replaces a file, and made
if it does not: the copy becomes NAME's next version, which readers do
not see while it is written. The commit makes it current in one step:
from then on NAME names the new version, and processes that hold the old
one keep it until they refresh onto the new one (at the same addresses)
or close it; it is freed after the last of them. 'gpushm stat NAME' shows
the versions still held. Only NAME's owner (or root) may replace it; the
new version keeps its owner, and its mode unless --mode says another.

An empty FILE makes an empty segment: a name that holds no memory, as an
empty file does, which 'gpushm get' writes back as an empty file and
'gpushm cat' as nothing; programs cannot open it (there is nothing to
map). With --force it replaces NAME in one step too (a rename over it).

--mode, --meta (for a file that is not a tensor bundle, whose meta is its
layout), --pin and --ttl are create's.

It prints nothing on standard output unless -o asks: -o json and -o yaml
print what was copied and the segment made, -o name its name.`

func putCmd() *cobra.Command {
	var (
		device, mode, meta string
		copyOpts           copyFlags
		verbose            bool
		o                  checkpoint.PutFileOptions
	)
	cmd := &cobra.Command{
		Use:   "put NAME FILE|DIR",
		Short: "Copy a file, or a checkpoint directory, into a new segment ('-' reads stdin)",
		Long:  putLong,
		Example: `  gpushm put weights model.bin
  gpushm put llama /models/llama              # a checkpoint directory
  curl -s https://example.com/w.bin | gpushm put weights -
  gpushm put --force weights model-v2.bin     # replace weights, readers refresh
  gpushm put --ttl 1h --mode 0644 scratch data.bin`,
		Args: cobra.ExactArgs(2),
		ValidArgsFunction: complete.NamesThenFiles(dial, func(cmd *cobra.Command) bool {
			return o.NextVersion // a new name otherwise: nothing to complete
		}),
		RunE: func(cmd *cobra.Command, args []string) error {
			name, path := args[0], args[1]
			co, err := copyOpts.options()
			if err != nil {
				return exitcode.Usagef(cmd, "%v", err)
			}
			if o.Mode, err = parseMode(cmd, mode); err != nil {
				return err
			}
			if o.InDaemon, err = copyOpts.inDaemon(); err != nil {
				return exitcode.Usagef(cmd, "%v", err)
			}
			if meta != "" && !json.Valid([]byte(meta)) {
				return exitcode.Usagef(cmd, "--meta: not valid JSON")
			}
			if o.TTL < 0 {
				return exitcode.Usagef(cmd, "--ttl %s: want a positive duration, such as 10m", o.TTL)
			}
			ctx, stop := interrupt.Context(cmd.Context())
			defer stop()
			o.Copy = *co
			if meta != "" {
				o.Meta = json.RawMessage(meta)
			}
			var res report.Copy
			if st, serr := os.Stat(path); path != "-" && serr == nil && st.IsDir() {
				res, err = putDir(ctx, name, path, device, verbose, &o)
			} else {
				res, err = putFile(ctx, name, path, device, verbose, &o)
			}
			err = exitcode.Failed("put", name, err)
			if errors.Is(err, syscall.EEXIST) && !o.NextVersion {
				err = fmt.Errorf("%w ('gpushm put --force %s ...' replaces it)", err, name)
			}
			if err != nil {
				return err
			}
			return printCopy(res)
		},
	}
	f := cmd.Flags()
	f.StringVar(&device, "device", "", "GPU ordinal or UUID (default: the daemon's first device)")
	f.StringVar(&mode, "mode", "", "permission bits in octal (default 0600)")
	f.BoolVar(&o.ReadOnlyDefault, "readonly-default", false, "mark a tensor bundle so that clients map it read-only unless they ask for write access")
	f.BoolVarP(&verbose, "verbose", "v", false, "print what was copied, how, and how fast")
	addQuiet(cmd)
	f.BoolVarP(&o.NextVersion, "force", "f", false, "replace NAME if it exists, in one step once the copy is complete: the copy is its next version, which readers refresh onto")
	f.BoolVar(&o.NextVersion, "new-version", false, "the same as --force")
	f.StringVar(&meta, "meta", "", "user metadata, a JSON value (not for a tensor bundle, whose meta is its layout)")
	f.BoolVar(&o.Pin, "pin", false, "keep the segment on its device: never evict it to host memory ('gpushm unpin' lets it go)")
	f.BoolVar(&o.Offer, "offer", false, "offer it to the daemon's peers on other nodes (docs/peers.md)")
	f.BoolVar(&o.Persist, "persist", false, "make it durable: its bytes go to the daemon's disk tier once the copy is committed, and it is listed again after a reboot (docs/disk.md)")
	f.DurationVar(&o.TTL, "ttl", 0, "remove the segment once nobody has had it open for this long (e.g. 10m)")
	copyOpts.register(cmd)
	addOutput(cmd, false)
	return cmd
}

// putFile puts a file, or standard input ("-"), into a new segment name.
// device is --device, resolved by the daemon; verbose says how the copy
// went.
func putFile(ctx context.Context, name, path, device string, verbose bool, o *checkpoint.PutFileOptions) (res report.Copy, err error) {
	start := time.Now()
	src, err := checkpoint.OpenFile(ctx, path)
	if err != nil {
		return res, err
	}
	defer src.Close()
	switch {
	case src.Size() == 0 && o.ReadOnlyDefault:
		return res, fmt.Errorf("--readonly-default is for tensor bundles, and %s is empty", path)
	case src.Size() == 0:
	case !src.Bundle() && o.ReadOnlyDefault:
		return res, fmt.Errorf("--readonly-default is for tensor bundles, and %s is not a safetensors file", path)
	case src.Bundle() && o.Meta != nil:
		return res, fmt.Errorf("--meta: %s is a safetensors file, whose segment's meta is its tensors' layout", path)
	}
	c, err := dial(ctx)
	if err != nil {
		return res, err
	}
	defer c.Close()
	o.Progress, o.Log = progressFor("put "+name), log.New(Stderr, "put "+name+": ", 0)
	if o.Device, err = resolveDevice(ctx, c, device); err != nil {
		return res, err
	}
	cp, err := checkpoint.PutFile(ctx, c, name, src, o)
	if err != nil {
		return res, err
	}
	res = report.Copy{Name: name, File: path, Bytes: cp.Bytes, Copier: cp.Copier, CRC32C: cp.CRC32C}
	if src.Bundle() && cp.Copier != "daemon" {
		fmt.Fprintln(Stderr, noSourcesNote(name))
	}
	res.Finish(start)
	rate("put", name, cp.Bytes, time.Since(start), cp.Stats, verbose)
	return res, describe(ctx, c, &res)
}

// progressFor starts a progress bar for what, on a terminal, as checkpoint's
// copies take it.
func progressFor(what string) func(int64) checkpoint.Progress {
	return func(total int64) checkpoint.Progress {
		if quiet {
			return (*progress.Bar)(nil) // draws nothing, as off a terminal
		}
		return progress.New(what, total)
	}
}

// quiet is put's and get's -q: no bar, no summary; errors only.
var quiet bool

// rate is report.Rate unless -q.
func rate(verb, name string, n int64, d time.Duration, st gpushm.CopyStats, verbose bool) {
	if !quiet {
		report.Rate(Stderr, verb, name, n, d, st, verbose)
	}
}

// addQuiet gives cmd -q, --quiet.
func addQuiet(cmd *cobra.Command) {
	cmd.Flags().BoolVarP(&quiet, "quiet", "q", false, "print nothing on standard error but errors: no progress bar, no summary")
	run := cmd.RunE
	cmd.RunE = func(c *cobra.Command, args []string) error {
		if v, _ := c.Flags().GetBool("verbose"); quiet && v {
			return exitcode.Usagef(c, "%s: -q and -v: one or the other", c.Name())
		}
		return run(c, args)
	}
}

// describe adds the segment put made to res, for -o json and yaml.
func describe(ctx context.Context, c *gpushm.Client, res *report.Copy) error {
	if !structured() {
		return nil
	}
	s, err := c.Stat(ctx, res.Name)
	if err != nil {
		return fmt.Errorf("put, then: %w", err)
	}
	v := report.SegmentOf(s)
	res.Segment = &v
	return nil
}

// copyFlags are the copy tuning flags of put and get.
type copyFlags struct {
	workers int
	chunk   string
	direct  string
	copier  string
	cmd     *cobra.Command
}

func (c *copyFlags) register(cmd *cobra.Command) {
	c.cmd = cmd
	f := cmd.Flags()
	f.StringVar(&c.copier, "copier", "auto", "who copies a regular file: daemon (its warm copy engine; this process needs no CUDA context), client (this process, tuned by --workers, --chunk and --direct), or auto: the daemon unless a tuning flag is given")
	f.IntVar(&c.workers, "workers", 0, "parallel copiers (default min(16, CPUs))")
	f.StringVar(&c.chunk, "chunk", "8MiB", "bytes a copier moves per step, a multiple of 64KiB")
	f.StringVar(&c.direct, "direct", "auto", "O_DIRECT reads: auto (what the page cache lacks), always, never")
}

// inDaemon says whether the daemon should copy a regular file.
func (c *copyFlags) inDaemon() (bool, error) {
	tuned := c.cmd != nil && (c.cmd.Flags().Changed("workers") || c.cmd.Flags().Changed("chunk") || c.cmd.Flags().Changed("direct"))
	switch c.copier {
	case "auto":
		return !tuned, nil
	case "daemon":
		if tuned {
			return false, fmt.Errorf("--workers, --chunk and --direct tune this process's copy: give --copier client (or auto)")
		}
		return true, nil
	case "client":
		return false, nil
	}
	return false, fmt.Errorf("--copier %q: want auto, daemon or client", c.copier)
}

func (c *copyFlags) options() (*gpushm.CopyOptions, error) {
	o := &gpushm.CopyOptions{Workers: c.workers}
	n, err := bytesize.Parse(c.chunk)
	if err != nil {
		return nil, fmt.Errorf("--chunk: %w", err)
	}
	if n <= 0 || n%(64<<10) != 0 {
		return nil, fmt.Errorf("--chunk %s: want a positive multiple of 64KiB", c.chunk)
	}
	o.Chunk = n
	switch c.direct {
	case "auto":
		o.Direct = gpushm.DirectAuto
	case "always":
		o.Direct = gpushm.DirectAlways
	case "never":
		o.Direct = gpushm.DirectNever
	default:
		return nil, fmt.Errorf("--direct %q: want auto, always or never", c.direct)
	}
	return o, nil
}

// putDir puts a checkpoint directory into a new bundle segment name.
func putDir(ctx context.Context, name, dir, device string, verbose bool, fo *checkpoint.PutFileOptions) (res report.Copy, err error) {
	start := time.Now()
	if fo.Meta != nil {
		return res, fmt.Errorf("--meta: %s is a checkpoint directory, whose segment's meta is its tensors' layout", dir)
	}
	ck, err := checkpoint.Open(dir)
	if err != nil {
		return res, err
	}
	defer ck.Close()
	scanned := time.Since(start)
	if s := ck.Skipped(); len(s) > 0 {
		fmt.Fprintf(Stderr, "put %s: not kept: %s\n", name, strings.Join(s, ", "))
	}
	c, err := dial(ctx)
	if err != nil {
		return res, err
	}
	defer c.Close()
	o := fo.PutOptions
	if o.Device, err = resolveDevice(ctx, c, device); err != nil {
		return res, err
	}
	bar := progress.New("put "+name, ck.DataBytes()+ck.FileBytes())
	o.Copy.Progress = bar.Func()
	st, err := checkpoint.Put(ctx, c, name, ck, &o)
	if o.InDaemon && errors.Is(err, syscall.ENOSYS) {
		// A daemon from before fill: copy here.
		o.InDaemon = false
		st, err = checkpoint.Put(ctx, c, name, ck, &o)
	}
	bar.Done(err)
	if err != nil {
		return res, err
	}
	if len(st.CRC32C) == 0 {
		fmt.Fprintf(Stderr, "put %s: the daemon did not checksum the shards it copied (it predates that): the bundle records no origin, so loaders read the files themselves\n", name)
	}
	if verbose {
		fmt.Fprintf(Stderr, "put %s: %d tensors in %d shards, %d small files; checked in %s\n",
			name, ck.Tensors(), len(ck.Shards()), len(ck.Files()), scanned.Round(time.Microsecond))
	}
	res = report.Copy{Name: name, File: dir, Bytes: ck.Size(), Copier: "client"}
	if o.InDaemon {
		res.Copier = "daemon"
	} else {
		fmt.Fprintln(Stderr, noSourcesNote(name))
	}
	res.Finish(start)
	rate("put", name, ck.Size(), time.Since(start), st, verbose)
	return res, describe(ctx, c, &res)
}

// noSourcesNote says what a put copied by this process means for loaders:
// they trust only what the daemon itself read from a file
// (docs/security.md, "Files served from bundles").
func noSourcesNote(name string) string {
	return fmt.Sprintf("put %s: copied by this process, not the daemon: programs under 'python -m gpushm.run' read the files themselves (they serve only files the daemon copied; --copier daemon)", name)
}
