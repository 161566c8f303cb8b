package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/checkpoint"
	"github.com/gpushm/gpushm/internal/bytesize"
	"github.com/gpushm/gpushm/internal/crc32c"
	"github.com/gpushm/gpushm/internal/layout"
	"github.com/gpushm/gpushm/internal/segment"
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
		device   string
		mode     string
		readOnly bool
		copyOpts copyFlags
		verbose  bool
		next     bool
		meta     string
		pin      bool
		ttl      time.Duration
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
		ValidArgsFunction: namesThenFiles(func(cmd *cobra.Command) bool {
			return next // a new name otherwise: nothing to complete
		}),
		RunE: func(cmd *cobra.Command, args []string) error {
			name, path := args[0], args[1]
			co, err := copyOpts.options()
			if err != nil {
				return usagef(cmd, "%v", err)
			}
			perm, err := parseMode(cmd, mode)
			if err != nil {
				return err
			}
			inDaemon, err := copyOpts.inDaemon()
			if err != nil {
				return usagef(cmd, "%v", err)
			}
			if meta != "" && !json.Valid([]byte(meta)) {
				return usagef(cmd, "--meta: not valid JSON")
			}
			if ttl < 0 {
				return usagef(cmd, "--ttl %s: want a positive duration, such as 10m", ttl)
			}
			ctx, stop := interruptible(cmd.Context())
			defer stop()
			o := putOptions{device: device, perm: perm, readOnly: readOnly, co: co, inDaemon: inDaemon, verbose: verbose, next: next,
				pin: pin, ttl: ttl}
			if meta != "" {
				o.meta = json.RawMessage(meta)
			}
			var res copyResult
			if st, serr := os.Stat(path); path != "-" && serr == nil && st.IsDir() {
				res, err = putDir(ctx, name, path, o)
			} else {
				res, err = putFile(ctx, name, path, o)
			}
			err = failed("put", name, err)
			if errors.Is(err, syscall.EEXIST) && !next {
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
	f.BoolVar(&readOnly, "readonly-default", false, "mark a tensor bundle so that clients map it read-only unless they ask for write access")
	f.BoolVarP(&verbose, "verbose", "v", false, "print what was copied, how, and how fast")
	f.BoolVarP(&next, "force", "f", false, "replace NAME if it exists, in one step once the copy is complete: the copy is its next version, which readers refresh onto")
	f.BoolVar(&next, "new-version", false, "the same as --force")
	f.StringVar(&meta, "meta", "", "user metadata, a JSON value (not for a tensor bundle, whose meta is its layout)")
	f.BoolVar(&pin, "pin", false, "keep the segment on its device: never evict it to host memory ('gpushm unpin' lets it go)")
	f.DurationVar(&ttl, "ttl", 0, "remove the segment once nobody has had it open for this long (e.g. 10m)")
	copyOpts.register(cmd)
	addOutput(cmd, false)
	return cmd
}

// putOptions are put's flags, read.
type putOptions struct {
	device   string
	perm     *uint32
	readOnly bool
	co       *gpushm.CopyOptions
	inDaemon bool
	verbose  bool
	next     bool
	// meta, pin and ttl are create's.
	meta json.RawMessage
	pin  bool
	ttl  time.Duration
}

// putFile puts a file, or standard input ("-"), into a new segment name.
func putFile(ctx context.Context, name, path string, po putOptions) (res copyResult, err error) {
	start := time.Now()
	f, size, cleanup, err := openSource(ctx, path)
	if err != nil {
		return res, err
	}
	defer cleanup()
	if size == 0 {
		return putEmpty(ctx, name, path, po)
	}
	// The file's identity, taken before its header is read, for the
	// bundle's origin.
	var origin *layout.Origin
	if path != "-" {
		origin = &layout.Origin{}
		if origin.Dir, err = layout.OriginDir(filepath.Dir(path)); err != nil {
			return res, err
		}
		id, err := layout.StatFile(f)
		if err != nil {
			return res, err
		}
		id.Name = filepath.Base(path)
		origin.Files = []layout.Identity{id}
	}
	o := &gpushm.CreateOptions{Mode: po.perm, NextVersion: po.next, Pin: po.pin, TTL: po.ttl}
	if o.Meta, err = layout.FileMeta(f, size, po.readOnly); err != nil {
		return res, err
	}
	if o.Meta == nil && po.readOnly {
		return res, fmt.Errorf("--readonly-default is for tensor bundles, and %s is not a safetensors file", path)
	}
	if o.Meta != nil && po.meta != nil {
		return res, fmt.Errorf("--meta: %s is a safetensors file, whose segment's meta is its tensors' layout", path)
	}
	if o.Meta == nil {
		origin = nil // only bundles say where they came from
		o.Meta = po.meta
	}
	c, err := dial(ctx)
	if err != nil {
		return res, err
	}
	defer c.Close()
	if o.Device, err = resolveDevice(ctx, c, po.device); err != nil {
		return res, err
	}
	st, copier, err := put(ctx, c, name, f, size, o, po.co, po.inDaemon, origin)
	if err != nil {
		return res, err
	}
	res = copyResult{Name: name, File: path, Bytes: size, Copier: copier}
	if origin != nil && len(st.CRC32C) == 1 {
		res.CRC32C = crc32c.Format(st.CRC32C[0])
	}
	res.finish(start)
	report("put", name, size, time.Since(start), st, po.verbose)
	return res, describe(ctx, c, &res)
}

// putEmpty makes name an empty segment, as the empty file path is: a name
// that holds no memory (docs/protocol.md, "create": empty). Replacing
// name (--force), it is made under a name of its own beside it and renamed
// over name, one step as a next version's commit is (a version is memory
// to fill, and an empty segment has none); it takes the owner, and unless
// --mode the mode, of what it replaces, as a next version does. A put
// killed between the two steps leaves that name, which says what it is,
// as get leaves a file.
func putEmpty(ctx context.Context, name, path string, po putOptions) (res copyResult, err error) {
	start := time.Now()
	if po.readOnly {
		return res, fmt.Errorf("--readonly-default is for tensor bundles, and %s is empty", path)
	}
	c, err := dial(ctx)
	if err != nil {
		return res, err
	}
	defer c.Close()
	o := &gpushm.CreateOptions{Mode: po.perm, Meta: po.meta, Pin: po.pin, TTL: po.ttl}
	if o.Device, err = resolveDevice(ctx, c, po.device); err != nil {
		return res, err
	}
	target := name
	var cur *gpushm.SegmentInfo
	if po.next {
		cur, err = c.Stat(ctx, name)
		switch {
		case errors.Is(err, syscall.ENOENT):
			cur = nil // nothing to replace
		case err != nil:
			return res, err
		default:
			target = besideName(name)
			if o.Mode == nil {
				o.Mode = &cur.Mode
			}
		}
	}
	made, _, err := c.CreateOnly(ctx, target, 0, o)
	if errors.Is(err, syscall.EPROTO) {
		return res, fmt.Errorf("%s is empty, and the daemon predates empty segments (upgrade it): %w", path, err)
	}
	if err != nil {
		return res, err
	}
	if cur != nil {
		// Seen through once begun, as a commit is: an interrupt leaves
		// no stray name behind.
		ctx := context.WithoutCancel(ctx)
		if made.UID != cur.UID || made.GID != cur.GID {
			err = c.Chown(ctx, target, int64(cur.UID), int64(cur.GID))
		}
		if err == nil {
			err = c.Rename(ctx, target, name)
		}
		if err != nil {
			c.Unlink(ctx, target)
			return res, err
		}
	}
	res = copyResult{Name: name, File: path, Copier: "client"}
	res.finish(start)
	report("put", name, 0, time.Since(start), gpushm.CopyStats{}, po.verbose)
	return res, describe(ctx, c, &res)
}

// besideName is a name for a segment made to be renamed over name, hidden
// from globs that do not match a leading dot, and saying what it is, as
// get's temporary files do.
func besideName(name string) string {
	suffix := fmt.Sprintf(".gpushm-put-%08x", rand.Uint32())
	keep := name[:min(len(name), segment.MaxName-1-len(suffix))]
	for !utf8.ValidString(keep) {
		keep = keep[:len(keep)-1] // cut inside a character
	}
	return "." + keep + suffix
}

// describe adds the segment put made to res, for -o json and yaml.
func describe(ctx context.Context, c *gpushm.Client, res *copyResult) error {
	if !structured() {
		return nil
	}
	s, err := c.Stat(ctx, res.Name)
	if err != nil {
		return fmt.Errorf("put, then: %w", err)
	}
	v := viewOf(s)
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

func putDir(ctx context.Context, name, dir string, po putOptions) (res copyResult, err error) {
	start := time.Now()
	if po.meta != nil {
		return res, fmt.Errorf("--meta: %s is a checkpoint directory, whose segment's meta is its tensors' layout", dir)
	}
	ck, err := checkpoint.Open(dir)
	if err != nil {
		return res, err
	}
	defer ck.Close()
	scanned := time.Since(start)
	if s := ck.Skipped(); len(s) > 0 {
		fmt.Fprintf(os.Stderr, "put %s: not kept: %s\n", name, strings.Join(s, ", "))
	}
	c, err := dial(ctx)
	if err != nil {
		return res, err
	}
	defer c.Close()
	o := &checkpoint.PutOptions{Mode: po.perm, ReadOnlyDefault: po.readOnly, Copy: *po.co, InDaemon: po.inDaemon, NextVersion: po.next,
		Pin: po.pin, TTL: po.ttl}
	if o.Device, err = resolveDevice(ctx, c, po.device); err != nil {
		return res, err
	}
	bar := newProgress("put "+name, ck.DataBytes()+ck.FileBytes())
	o.Copy.Progress = bar.fn()
	st, err := checkpoint.Put(ctx, c, name, ck, o)
	if o.InDaemon && errors.Is(err, syscall.ENOSYS) {
		// A daemon from before fill: copy here.
		o.InDaemon = false
		st, err = checkpoint.Put(ctx, c, name, ck, o)
	}
	bar.finish(err)
	if err != nil {
		return res, err
	}
	if len(st.CRC32C) == 0 {
		fmt.Fprintf(os.Stderr, "put %s: the daemon did not checksum the shards it copied (it predates that): the bundle records no origin, so loaders read the files themselves\n", name)
	}
	if po.verbose {
		fmt.Fprintf(os.Stderr, "put %s: %d tensors in %d shards, %d small files; checked in %s\n",
			name, ck.Tensors(), len(ck.Shards()), len(ck.Files()), scanned.Round(time.Microsecond))
	}
	res = copyResult{Name: name, File: dir, Bytes: ck.Size(), Copier: "client"}
	if o.InDaemon {
		res.Copier = "daemon"
	}
	res.finish(start)
	report("put", name, ck.Size(), time.Since(start), st, po.verbose)
	return res, describe(ctx, c, &res)
}

// put creates name uncommitted and fills it from f, a regular file, then
// commits it; on any failure, or an interrupt, the segment goes. The
// daemon copies (inDaemon), in steps that a bar follows, or this process,
// with parallel reads; copier says which did. With origin (f's identity,
// without its checksum), whoever copies hashes the file as it reads it,
// and the commit records origin, checksum included, in the meta.
func put(ctx context.Context, c *gpushm.Client, name string, f *os.File, size int64, o *gpushm.CreateOptions, co *gpushm.CopyOptions, inDaemon bool, origin *layout.Origin) (st gpushm.CopyStats, copier string, err error) {
	o.Uncommitted = true
	seg, err := c.Create(ctx, name, size, o)
	if err != nil {
		return st, "", err
	}
	defer func() {
		// Closed uncommitted, after a failure, the segment goes.
		cerr := seg.Close()
		if err == nil {
			err = cerr
		}
	}()
	bar := newProgress("put "+name, size)
	copier = "daemon"
	if inDaemon {
		st, err = fillSteps(ctx, seg, f, size, bar)
	}
	if !inDaemon || errors.Is(err, syscall.ENOSYS) {
		// This process copies; so does it when the daemon is from before
		// fill.
		copier = "client"
		var m *gpushm.Mapping
		if m, err = seg.Map(); err == nil {
			co.Progress = bar.fn()
			co.CRC32C = origin != nil
			st, err = m.LoadFiles([]gpushm.FileRange{{File: f, Len: size}}, co)
		}
	}
	bar.finish(err)
	if err != nil {
		return st, copier, err
	}
	return st, copier, commit(ctx, seg, name, f, o.Meta, origin, st.CRC32C)
}

// commit commits seg, with meta gaining origin and the file's checksum when
// there is an origin: unless f changed during the copy, which fails the
// put. A daemon that cannot take the meta (it predates commits that carry
// one), or did not hash what it filled, gets a plain commit and a notice.
//
// An interrupt before the commit is sent fails the put; one after is too
// late, and the commit is seen through, so that what put says is what
// happened.
func commit(ctx context.Context, seg *gpushm.Segment, name string, f *os.File, meta json.RawMessage, origin *layout.Origin, crcs []uint32) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	ctx = context.WithoutCancel(ctx)
	if origin == nil {
		return seg.Commit(ctx)
	}
	if err := origin.Files[0].Unchanged(f); err != nil {
		return err
	}
	if len(crcs) != 1 {
		fmt.Fprintf(os.Stderr, "put %s: the daemon did not checksum the file it copied (it predates that): the bundle records no origin, so loaders read the file itself\n", name)
		return seg.Commit(ctx)
	}
	o := *origin
	o.Files = []layout.Identity{origin.Files[0].Sealed(crcs[0])}
	meta, err := layout.WithOrigin(meta, &o)
	if err != nil {
		return err
	}
	err = seg.CommitMeta(ctx, meta)
	if errors.Is(err, syscall.EPROTO) {
		fmt.Fprintf(os.Stderr, "put %s: the daemon cannot record where the file came from (it predates commits with meta): the bundle records no origin, so loaders read the file itself\n", name)
		return seg.Commit(ctx)
	}
	return err
}

// openSource opens path, or spools stdin for "-", and tells its size. An
// interrupt while stdin is read fails it: the writer of a pipe usually
// dies of the same Ctrl-C, and what was read up to then is not the
// whole input.
func openSource(ctx context.Context, path string) (*os.File, int64, func(), error) {
	if path != "-" {
		f, err := os.Open(path)
		if err != nil {
			return nil, 0, nil, err
		}
		st, err := f.Stat()
		if err != nil {
			f.Close()
			return nil, 0, nil, err
		}
		if !st.Mode().IsRegular() {
			f.Close()
			return nil, 0, nil, fmt.Errorf("%s is not a regular file (use '-' with a pipe)", path)
		}
		return f, st.Size(), func() { f.Close() }, nil
	}
	tmp, err := os.CreateTemp("", "gpushm-put-*")
	if err != nil {
		return nil, 0, nil, fmt.Errorf("spool stdin: %w", err)
	}
	os.Remove(tmp.Name())
	size, err := spool(ctx, tmp)
	if err == nil {
		_, err = tmp.Seek(0, io.SeekStart)
	}
	if err != nil {
		tmp.Close()
		return nil, 0, nil, fmt.Errorf("spool stdin: %w", err)
	}
	return tmp, size, func() { tmp.Close() }, nil
}

// spool copies standard input to dst until its end, or an interrupt. A
// pipe's read is made to end at once at an interrupt (through the
// runtime's poller, on a descriptor of its own), whether or not the
// writer dies of the same Ctrl-C; other inputs (a file, a terminal, which
// is the shell's too) are read to their end. Either way an interrupt
// fails it: what was read is not the whole input.
func spool(ctx context.Context, dst *os.File) (int64, error) {
	in := os.Stdin
	// A terminal's description is the shell's too: left non-blocking by a
	// forced exit, it would be the shell's problem.
	if fd, err := unix.Dup(0); err == nil && !isTerminal(in) {
		// O_NONBLOCK is the open file description's, shared with
		// descriptor 0: it is set back through 0 before return.
		if unix.SetNonblock(fd, true) == nil {
			defer unix.SetNonblock(0, false)
		}
		in = os.NewFile(uintptr(fd), "standard input")
		defer in.Close()
		stop := context.AfterFunc(ctx, func() { in.SetReadDeadline(time.Now()) })
		defer stop()
	} else if err == nil {
		unix.Close(fd)
	}
	n, err := io.Copy(dst, in)
	if cerr := ctx.Err(); cerr != nil {
		return n, cerr
	}
	return n, err
}

// report prints the whole command's rate on a terminal, and with verbose
// (anywhere) how the copy went.
func report(verb, name string, n int64, d time.Duration, st gpushm.CopyStats, verbose bool) {
	if !verbose && !isTerminal(os.Stderr) {
		return
	}
	fmt.Fprintf(os.Stderr, "%s %s: %s in %.3fs (%.2f GB/s)\n", verb, name, bytesize.Format(n), d.Seconds(), float64(n)/d.Seconds()/1e9)
	if verbose && st.Elapsed > 0 {
		chunks := ""
		if st.Chunk > 0 { // the daemon's copies do not say
			chunks = ", " + bytesize.Format(st.Chunk) + " chunks"
		}
		fmt.Fprintf(os.Stderr, "%s %s: copy %s in %.3fs (%.2f GB/s), %s with O_DIRECT, %d copiers%s\n",
			verb, name, bytesize.Format(st.Bytes), st.Elapsed.Seconds(), float64(st.Bytes)/st.Elapsed.Seconds()/1e9,
			bytesize.Format(st.Direct), st.Workers, chunks)
	}
}
