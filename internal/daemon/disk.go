package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/bytesize"
	"github.com/gpushm/gpushm/internal/disk"
	"github.com/gpushm/gpushm/internal/segment"
)

// diskTier is the registry's disk tier (segment.Disk) over the store of
// --disk's directories. A serving process that succeeds another (after a
// crash, or in an upgrade) opens the store in the background: its
// predecessor may still hold the directories' locks until it has handed
// over, which it does only once this process serves. A first start opens
// it at once, so that a directory it cannot use stops the daemon there.
type diskTier struct {
	dirs []string
	o    disk.Options
	log  *slog.Logger

	ready chan struct{} // closed once st or err is set
	st    *disk.Store
	err   error
}

// diskOptions reads --disk and --disk-budget; none is no disk tier.
func (o Options) diskOptions() (dirs []string, budget int64, err error) {
	for _, d := range strings.Split(o.Disk, ",") {
		if d = strings.TrimSpace(d); d != "" {
			dirs = append(dirs, d)
		}
	}
	if len(dirs) == 0 {
		if strings.TrimSpace(o.DiskBudget) != "" && o.DiskBudget != "0" {
			return nil, 0, errors.New("--disk-budget needs --disk")
		}
		return nil, 0, nil
	}
	if b := strings.TrimSpace(o.DiskBudget); b != "" && b != "0" {
		if budget, err = bytesize.Parse(b); err != nil || budget < 0 {
			return nil, 0, fmt.Errorf("--disk-budget %q: want a size (500GiB) or 0 (no budget)", o.DiskBudget)
		}
	}
	return dirs, budget, nil
}

func newDiskTier(dirs []string, budget int64, log *slog.Logger) *diskTier {
	return &diskTier{dirs: dirs, o: disk.Options{Budget: budget, Log: log}, log: log, ready: make(chan struct{})}
}

// open opens the store now, waiting up to 10 s for a daemon that was
// killed to let go of the directories (its exit tears its GPU mappings
// down before it closes its descriptors).
func (d *diskTier) open() error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		d.st, d.err = disk.Open(d.dirs, d.o)
		if d.err == nil || !errors.Is(d.err, unix.EWOULDBLOCK) || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	close(d.ready)
	if d.err != nil {
		return fmt.Errorf("--disk: %w", d.err)
	}
	d.logOpened()
	return nil
}

// openLater opens the store in the background, waiting up to a minute for
// a predecessor to let go of the directories.
func (d *diskTier) openLater() {
	go func() {
		deadline := time.Now().Add(time.Minute)
		for {
			st, err := disk.Open(d.dirs, d.o)
			if err == nil || !errors.Is(err, unix.EWOULDBLOCK) || time.Now().After(deadline) {
				d.st, d.err = st, err
				close(d.ready)
				if err != nil {
					d.log.Error("disk tier unusable: segments on disk cannot be restored, nothing goes to disk", "dirs", d.dirs, "err", err)
				} else {
					d.logOpened()
				}
				return
			}
			time.Sleep(50 * time.Millisecond)
		}
	}()
}

func (d *diskTier) logOpened() {
	used, budget := d.st.Usage()
	if d.st.Direct() {
		d.log.Info("disk tier", "dirs", d.dirs, "used", used, "budget", budget, "direct", true)
	} else {
		d.log.Warn("disk tier through the page cache: a directory refuses O_DIRECT (tmpfs?)", "dirs", d.dirs, "used", used, "budget", budget)
	}
}

func (d *diskTier) store() (*disk.Store, error) {
	<-d.ready
	if d.err != nil {
		return nil, fmt.Errorf("disk tier: %w", d.err)
	}
	return d.st, nil
}

func (d *diskTier) close() {
	select {
	case <-d.ready:
		if d.st != nil {
			d.st.Close()
		}
	default:
	}
}

// memData is a segment's memory as the store's Source and Sink.
type memData struct{ d segment.Data }

func (m memData) ReadAt(p []byte, off int64) error  { return m.d.ReadAt(p, off) }
func (m memData) WriteAt(p []byte, off int64) error { return m.d.WriteAt(p, off) }

func dataOf(m segment.Memory) (segment.Data, error) {
	if d, ok := m.(segment.Data); ok {
		return d, nil
	}
	if c, ok := m.(*segment.ChannelMemory); ok {
		return dataOf(c.Data)
	}
	return nil, segment.ErrNoData
}

// Write implements segment.Disk.
func (d *diskTier) Write(key string, src segment.Memory, size int64, meta []byte) error {
	st, err := d.store()
	if err != nil {
		return err
	}
	data, err := dataOf(src)
	if err != nil {
		return err
	}
	_, err = st.Write(context.Background(), key, size, meta, memData{data})
	return err
}

// Read implements segment.Disk.
func (d *diskTier) Read(key string, dst segment.Memory, size int64) error {
	st, err := d.store()
	if err != nil {
		return err
	}
	e, err := st.Stat(key)
	if err != nil {
		return err
	}
	if e.Size < size {
		return fmt.Errorf("%w: the copy on disk of %s holds %d bytes, not %d (%s)", disk.ErrCorrupt, key, e.Size, size, strings.Join(e.Files, ", "))
	}
	data, err := dataOf(dst)
	if err != nil {
		return err
	}
	if _, err := st.Read(context.Background(), key, memData{data}); err != nil {
		return err
	}
	return data.Sync()
}

// Remove implements segment.Disk.
func (d *diskTier) Remove(key string) error {
	st, err := d.store()
	if err != nil {
		return err
	}
	return st.Remove(key)
}

// SetMeta implements segment.Disk.
func (d *diskTier) SetMeta(key string, meta []byte) error {
	st, err := d.store()
	if err != nil {
		return err
	}
	return st.SetMeta(key, meta)
}

// Usage implements segment.Disk.
func (d *diskTier) Usage() (used, budget int64) {
	select {
	case <-d.ready:
		if d.st != nil {
			return d.st.Usage()
		}
	default:
	}
	return 0, d.o.Budget
}

// durable is what a daemon that starts afresh (nothing survived in a
// supervisor) serves again from disk: the newest durable copy of each name,
// each a segment on disk with the record it was written with. Every other
// copy (of segments that were not durable, of older versions, of segments
// the registry already has) is removed. known says which keys the
// registry holds already.
func (d *diskTier) durable(known func(key string) bool, names func(name string) bool) []segment.Restored {
	st, err := d.store()
	if err != nil {
		return nil
	}
	var items []segment.Restored
	byName := map[string]int{}
	for _, e := range st.List() {
		if known(e.Key) {
			continue
		}
		var rec segment.Record
		id, kerr := strconv.ParseUint(e.Key, 10, 64)
		if len(e.Meta) == 0 || json.Unmarshal(e.Meta, &rec) != nil || kerr != nil || rec.ID != id || !rec.Persist || !rec.Linked || names(rec.Name) {
			d.drop(st, e.Key, "not durable, or replaced")
			continue
		}
		rec.Alloc = max(rec.Alloc, e.Size)
		if rec.TTL > 0 {
			rec.Idle = time.Now().UnixNano() // its clock starts again now
		}
		rec.Tier, rec.DiskCopy = segment.OnDisk.String(), true
		it := segment.Restored{Record: rec, Memory: segment.DiskMemory(rec.Alloc), Fresh: true}
		if i, ok := byName[rec.Name]; ok {
			old := items[i].Record
			if old.Version > rec.Version || old.Version == rec.Version && old.ID > rec.ID {
				d.drop(st, e.Key, "an older version")
				continue
			}
			d.drop(st, strconv.FormatUint(old.ID, 10), "an older version")
			items[i] = it
			continue
		}
		byName[rec.Name] = len(items)
		items = append(items, it)
	}
	slices.SortFunc(items, func(a, b segment.Restored) int { return strings.Compare(a.Record.Name, b.Record.Name) })
	for _, it := range items {
		args := []any{"name", it.Record.Name, "version", it.Record.Version, "bytes", it.Record.Size}
		if it.Record.Stale {
			args = append(args, "stale", "changed after its last sync: these are the bytes of that sync")
		}
		d.log.Info("durable segment back from disk", args...)
	}
	return items
}

// leftovers removes the copies of segments the registry does not hold: a
// serving process that died between writing a copy and recording it. The
// copy of an earlier version of a durable name whose current version is
// not on disk yet stays until it is.
func (d *diskTier) leftovers(reg *segment.Registry) {
	st, err := d.store()
	if err != nil {
		return
	}
	held := map[string]bool{}
	for _, k := range reg.DiskKeys() {
		held[k] = true
	}
	for _, e := range st.List() {
		if held[e.Key] {
			continue
		}
		var rec segment.Record
		if json.Unmarshal(e.Meta, &rec) == nil && rec.Persist && rec.Linked && reg.AdoptCopy(rec.Name, e.Key) {
			continue
		}
		d.drop(st, e.Key, "no segment holds it")
	}
	reg.ResyncDurable()
}

func (d *diskTier) drop(st *disk.Store, key, why string) {
	if err := st.Remove(key); err != nil {
		d.log.Warn("remove a copy on disk", "key", key, "why", why, "err", err)
		return
	}
	d.log.Debug("removed a copy on disk", "key", key, "why", why)
}

var _ segment.Disk = (*diskTier)(nil)

// durable serves, in a daemon without a supervisor, the durable segments
// on disk: every start of one is afresh.
func (s *serving) durable() error {
	if err := s.disk.open(); err != nil {
		return err
	}
	reg := s.srv.Registry()
	items := s.disk.durable(func(string) bool { return false }, func(string) bool { return false })
	reg.Restore(items, 0, 0)
	s.log.Info("durable segments back from disk", "segments", len(items))
	return nil
}
