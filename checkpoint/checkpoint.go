// Package checkpoint copies files into segments and back: what 'gpushm
// put' and 'gpushm get' do. A model's checkpoint directory (safetensors
// shards, the index, config.json and the tokenizer's files) goes into
// gpushm as one bundle segment (Open, Put), and a bundle back out as the
// directory it came from, byte for byte (Get); a single file goes into a
// segment of its size (OpenFile, PutFile), a safetensors file as a bundle
// that records where it came from, and a segment into a file (GetFile).
// It is built on the client (package gpushm) and its copy engine; the
// bundle's layout is docs/protocol.md's ("A checkpoint directory's
// bundle").
package checkpoint

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm"
	"github.com/gpushm/gpushm/internal/layout"
	"github.com/gpushm/gpushm/internal/xfer"
)

// Checkpoint is a checkpoint directory, checked and ready to load: its
// safetensors shards (following model.safetensors.index.json when there is
// one) and its small files (config.json, generation_config.json, the
// tokenizer's, the index: every other regular file at its top level of at
// most 64 MiB). It holds the files open; Close it.
type Checkpoint struct {
	p *layout.Plan
}

// Open reads and checks dir. Every shard's header is checked; a
// corrupt header, an unknown dtype, a tensor in two shards, a shard the
// index names but the directory lacks, or a directory without safetensors
// files is an error naming the file. Nothing is allocated.
func Open(dir string) (*Checkpoint, error) {
	p, err := layout.Scan(dir)
	if err != nil {
		return nil, err
	}
	return &Checkpoint{p}, nil
}

// Close closes the checkpoint's files.
func (ck *Checkpoint) Close() error { return ck.p.Close() }

// Size is the size of the segment the checkpoint becomes.
func (ck *Checkpoint) Size() int64 { return ck.p.Size }

// DataBytes is the span of the tensor data in the segment, the bulk of
// Size: the shards' data regions and the alignment between them.
func (ck *Checkpoint) DataBytes() int64 { return ck.p.DataBytes }

// FileBytes is the small files' size, together.
func (ck *Checkpoint) FileBytes() int64 {
	var n int64
	for _, f := range ck.p.Files {
		n += f.Size
	}
	return n
}

// Tensors is the number of tensors in all shards.
func (ck *Checkpoint) Tensors() int { return ck.p.Tensors }

// Shards are the shard files' names.
func (ck *Checkpoint) Shards() []string {
	var s []string
	for _, sh := range ck.p.Shards {
		s = append(s, sh.Name)
	}
	return s
}

// Files are the small files' names.
func (ck *Checkpoint) Files() []string {
	var s []string
	for _, f := range ck.p.Files {
		s = append(s, f.Name)
	}
	return s
}

// Skipped says what the directory holds that the bundle will not, and why
// ("original/ (a directory)").
func (ck *Checkpoint) Skipped() []string { return ck.p.Skipped }

// PutOptions are the optional parts of Put.
type PutOptions struct {
	// Device is the GPU ordinal; nil means the daemon's default device.
	Device *int
	// Mode is the permission bits; nil means 0600.
	Mode *uint32
	// ReadOnlyDefault marks the bundle so that clients map it read-only
	// unless they ask for write access.
	ReadOnlyDefault bool
	// Copy tunes the copy.
	Copy gpushm.CopyOptions
	// InDaemon has the daemon copy (gpushm.Segment.Fill): this process then maps
	// nothing and needs no CUDA context. Copy's tuning does not apply.
	InDaemon bool
	// NextVersion makes the bundle the next version of name, which its
	// commit makes current (gpushm.CreateOptions.NextVersion).
	NextVersion bool
	// Pin and TTL are gpushm.CreateOptions's: keep the bundle on its
	// device; remove it once unopened this long.
	Pin bool
	// Persist makes it durable: its bytes go to disk after the commit and
	// it is listed again after a reboot (a daemon with --disk).
	Persist bool
	// Offer offers it to the daemon's peers on other nodes.
	Offer bool
	TTL   time.Duration
}

// Put creates name as one bundle segment holding the
// checkpoint: a safetensors header naming every tensor of every shard, the
// shards' data, the small files and what it takes to write the shards back
// byte for byte (docs/protocol.md, "Metadata conventions"). The segment is
// created uncommitted and committed once full, so nobody opens it half
// written; on any failure, or if this process dies first, it goes.
//
// Whoever copies (the daemon, or this process) computes each shard's
// CRC-32C while copying, and the shard table records it with the shard's
// identity (docs/protocol.md, "Where a bundle came from"); the stats'
// CRC32C has the shards' checksums, in Shards' order. A shard written
// while it was copied fails the put. A daemon too old to hash what it
// fills leaves the records out, and CRC32C empty.
func Put(ctx context.Context, c *gpushm.Client, name string, ck *Checkpoint, o *PutOptions) (st gpushm.CopyStats, err error) {
	if o == nil {
		o = &PutOptions{}
	}
	meta, err := ck.p.Meta(o.ReadOnlyDefault)
	if err != nil {
		return st, err
	}
	seg, err := c.Create(ctx, name, ck.p.Size, &gpushm.CreateOptions{Device: o.Device, Mode: o.Mode, Meta: meta, Uncommitted: true, NextVersion: o.NextVersion,
		Pin: o.Pin, TTL: o.TTL, Persist: o.Persist, Offer: o.Offer})
	if err != nil {
		return st, err
	}
	defer func() {
		// Closed uncommitted, after a failure, the segment goes.
		if cerr := seg.Close(); err == nil {
			err = cerr
		}
	}()
	var ranges []gpushm.FileRange
	for _, r := range ck.p.Ranges() {
		ranges = append(ranges, gpushm.FileRange{File: r.File, Off: r.Off, Len: r.Len, At: r.At})
	}
	var crcs []uint32 // the shard files'
	if o.InDaemon {
		st, crcs, err = fill(ctx, seg, ck.p, ranges, o.Copy.Progress)
	} else {
		st, crcs, err = load(seg, ck.p, ranges, o.Copy)
	}
	if err != nil {
		return st, fmt.Errorf("gpushm: put %s: %w", name, err)
	}
	st.CRC32C = crcs
	// An interrupt after the commit is sent is too late: the commit is
	// seen through, so that the error says what happened.
	if err := ctx.Err(); err != nil {
		return st, err
	}
	return st, seg.Commit(context.WithoutCancel(ctx))
}

// load copies the checkpoint in this process, through its own mapping,
// hashing the shards as it reads them; the shard table goes last.
func load(seg *gpushm.Segment, p *layout.Plan, ranges []gpushm.FileRange, o gpushm.CopyOptions) (st gpushm.CopyStats, crcs []uint32, err error) {
	m, err := seg.Map()
	if err != nil {
		return st, nil, err
	}
	for _, pc := range p.Pieces() {
		if _, err := m.WriteAt(pc.Data, pc.At); err != nil {
			return st, nil, err
		}
	}
	o.CRC32C = true
	if st, err = m.LoadFiles(ranges, &o); err != nil {
		return st, nil, err
	}
	tab, crcs, err := p.Table(st.CRC32C[:len(p.Shards)])
	if err != nil {
		return st, nil, err
	}
	_, err = m.WriteAt(tab.Data, tab.At)
	return st, crcs, err
}

// fill has the daemon copy the checkpoint: every file range, one fill
// each (the daemon hashes what it reads), then the pieces this process
// holds (headers, and the shard table, made last with the checksums) from
// a memfd where each lies at its place in the segment. With progress, a
// range is filled in steps, each told to progress.
func fill(ctx context.Context, seg *gpushm.Segment, p *layout.Plan, ranges []gpushm.FileRange, progress func(int64)) (st gpushm.CopyStats, crcs []uint32, err error) {
	start := time.Now()
	add := func(rs gpushm.CopyStats) {
		st.Bytes += rs.Bytes
		st.Direct += rs.Direct
		st.Elapsed += rs.Elapsed
		st.Workers = max(st.Workers, rs.Workers)
	}
	sums := make([]uint32, len(p.Shards))
	for i, r := range ranges {
		if r.Len == 0 {
			continue // its checksum is 0
		}
		rs, err := fillRange(ctx, seg, r, progress)
		if err != nil {
			return st, nil, err
		}
		add(rs)
		if i < len(sums) {
			if len(rs.CRC32C) != 1 {
				sums = nil // a daemon from before fill's checksum: no records
			} else if sums != nil {
				sums[i] = rs.CRC32C[0]
			}
		}
	}
	tab, crcs, err := p.Table(sums)
	if err != nil {
		return st, nil, err
	}
	fd, err := unix.MemfdCreate("gpushm-pieces", unix.MFD_CLOEXEC)
	if err != nil {
		return st, nil, fmt.Errorf("memfd for the headers: %w", err)
	}
	mf := os.NewFile(uintptr(fd), "pieces")
	defer mf.Close()
	for _, pc := range append(p.Pieces(), tab) {
		if _, err := mf.WriteAt(pc.Data, pc.At); err != nil {
			return st, nil, fmt.Errorf("headers into a memfd: %w", err)
		}
	}
	for _, pc := range append(p.Pieces(), tab) {
		rs, err := seg.Fill(ctx, mf, pc.At, pc.At, int64(len(pc.Data)))
		if err != nil {
			return st, nil, err
		}
		add(rs)
	}
	st.Wall = time.Since(start)
	return st, crcs, nil
}

// fillRange has the daemon copy r, in one request, or with progress in
// steps that progress follows (xfer.Steps), whose checksums make the
// range's.
func fillRange(ctx context.Context, seg *gpushm.Segment, r gpushm.FileRange, progress func(int64)) (gpushm.CopyStats, error) {
	if progress == nil {
		return seg.Fill(ctx, r.File, r.Off, r.At, r.Len)
	}
	return xfer.Steps(r.Len, progress, func(off, n int64) (gpushm.CopyStats, error) {
		return seg.Fill(ctx, r.File, r.Off+off, r.At+off, n)
	})
}

// Get writes a checkpoint directory's bundle back as the
// directory it came from: the shard files byte for byte, and the small
// files. dir must not exist, or be empty; on failure what was written is
// removed again.
func Get(ctx context.Context, c *gpushm.Client, name, dir string, o *gpushm.CopyOptions) (st gpushm.CopyStats, err error) {
	seg, err := c.Open(ctx, name, &gpushm.OpenOptions{ReadOnly: true})
	if err != nil {
		return st, err
	}
	defer seg.Close()
	meta, ok, err := layout.ParseMeta(seg.Info().Meta, seg.Size())
	if err == nil && (!ok || meta.Source != "dir") {
		err = errors.New("it is not a checkpoint directory's bundle (write it to a file instead)")
	}
	if err != nil {
		return st, fmt.Errorf("gpushm: get %s: %w", name, err)
	}
	m, err := seg.Map()
	if err != nil {
		return st, err
	}
	table := make([]byte, meta.Shards.Size)
	if _, err := m.ReadAt(table, meta.Shards.At); err != nil {
		return st, fmt.Errorf("gpushm: get %s: shard table: %w", name, err)
	}
	outs, err := meta.Outputs(table, seg.Size())
	if err != nil {
		return st, fmt.Errorf("gpushm: get %s: %w", name, err)
	}
	made, err := prepareDir(dir)
	if err != nil {
		return st, err
	}
	var files []*os.File
	defer func() {
		for _, f := range files {
			if cerr := f.Close(); err == nil {
				err = cerr
			}
		}
		if err != nil {
			for _, out := range outs {
				os.Remove(filepath.Join(dir, out.Name))
			}
			if made {
				os.Remove(dir)
			}
		}
	}()
	var ranges []gpushm.FileRange
	for _, out := range outs {
		f, err := os.OpenFile(filepath.Join(dir, out.Name), os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
		if err != nil {
			return st, err
		}
		files = append(files, f)
		var off int64
		for _, p := range out.Pieces {
			ranges = append(ranges, gpushm.FileRange{File: f, Off: off, Len: p.Size, At: p.At})
			off += p.Size
		}
		if err := f.Truncate(off); err != nil {
			return st, err
		}
	}
	return m.StoreFiles(ranges, o)
}

// prepareDir makes dir, or checks that it is an empty directory.
func prepareDir(dir string) (made bool, err error) {
	if err := os.Mkdir(dir, 0o755); err == nil {
		return true, nil
	} else if !errors.Is(err, os.ErrExist) {
		return false, err
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return false, err
	}
	if len(ents) > 0 {
		return false, fmt.Errorf("%s is not empty: give a new or empty directory", dir)
	}
	return false, nil
}
