package daemon

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"slices"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gpushm/gpushm/internal/backend"
	"github.com/gpushm/gpushm/internal/channel"
	"github.com/gpushm/gpushm/internal/segment"
	"github.com/gpushm/gpushm/internal/server"
	"github.com/gpushm/gpushm/internal/supervisor"
)

// restore rebuilds the registry from what the supervisor held, checking
// each descriptor with the backend, and adopts the connections a
// predecessor parked.
func restore(srv *server.Server, b backend.Backend, host *backend.Host, disk *diskTier, start *supervisor.Start, log *slog.Logger) error {
	items := make([]segment.Restored, 0, len(start.Segments))
	now := time.Now().UnixNano()
	// An orphan without a record is dated now and owned by root (0600).
	unknown := segment.Record{Created: now, Modified: now, Mode: 0o600}
	for _, h := range start.Segments {
		it := segment.Restored{Record: unknown}
		it.Record.ID = h.ID
		if h.Rec == nil {
			it.Problem = "a memory descriptor came back without a record"
		} else if err := json.Unmarshal(h.Rec, &it.Record); err != nil || it.Record.ID != h.ID {
			it.Record = unknown
			it.Record.ID = h.ID
			it.Problem = fmt.Sprintf("its record is unreadable: %.200s", h.Rec)
		}
		if h.FD >= 0 {
			alloc := it.Record.Alloc
			if alloc == 0 && it.Problem == "" {
				it.Problem = "a memory descriptor came back for a segment without memory"
			}
			if alloc == 0 {
				alloc = 1 // an orphan: anything mappable will do to hold it
			}
			if ps := it.Record.Parts; len(ps) > 1 && ps[0].Size > 0 {
				alloc = ps[0].Size // the first part's (joinParts)
			}
			var (
				mem segment.Memory
				err error
			)
			if it.Record.OnHost() {
				// Evicted: a memfd whatever the backend.
				mem, err = host.Restore(0, h.FD, alloc)
			} else {
				mem, err = b.Restore(it.Record.Device, h.FD, alloc)
			}
			if err != nil {
				if it.Problem == "" {
					it.Problem = "its memory descriptor is not usable: " + err.Error()
				}
				mem = rawMemory{fd: h.FD, size: alloc}
			}
			it.Memory = mem
		}
		if h.FD < 0 && it.Problem == "" && it.Record.Tier == segment.OnDisk.String() {
			// Its bytes are on disk: the first open reads them back.
			if disk == nil {
				it.Problem = "its bytes are on disk, and this daemon has no disk tier (--disk)"
			} else {
				it.Memory = segment.DiskMemory(it.Record.Alloc)
			}
		}
		if it.Record.Slots > 0 || h.CtlFD >= 0 {
			it.Memory, it.Problem = restoreChannel(host, it, h.CtlFD)
		}
		items = append(items, it)
	}
	items = joinParts(items)
	reg := srv.Registry()
	if disk != nil && start.Reason == "start" {
		// Nothing before this process served these directories in this
		// supervisor: what is on disk is of a daemon that stopped, or of a
		// machine that rebooted, and its durable segments come back.
		if err := disk.open(); err != nil {
			return err
		}
		ids := map[string]bool{}
		names := map[string]bool{}
		for _, it := range items {
			ids[segment.DiskKey(it.Record.ID)] = true
			if it.Record.Linked {
				names[it.Record.Name] = true
			}
		}
		known := func(k string) bool { return ids[k] }
		back := disk.durable(known, func(n string) bool { return names[n] })
		items = append(items, back...)
		log.Info("durable segments back from disk", "segments", len(back))
	} else if disk != nil {
		disk.openLater()
	}
	orphans := reg.Restore(items, start.NextID, time.Until(start.GraceUntil))
	for _, name := range orphans {
		inf, _ := reg.Stat(name)
		log.Error("kept a segment that cannot be served; 'gpushm rm' frees it", "name", name, "why", inf.Orphan)
	}
	for _, p := range start.Conns {
		if err := srv.Adopt(p.FD, p.State); err != nil {
			log.Error("adopt a connection", "err", err)
		}
	}
	srv.RepairChannels()
	if disk != nil {
		go disk.leftovers(reg)
	}
	log.Info("restored", "reason", start.Reason, "segments", len(start.Segments), "connections", len(start.Conns), "orphans", len(orphans))
	return nil
}

// joinParts puts together the memory of each segment whose host memory
// is in parts (segment.Parted): the segment's own descriptor is the first
// part, and each other is a record of its own naming the segment. A part
// missing, or not as the segment's record lists it, makes the segment an
// orphan; parts that no segment takes stay in the list, for the registry
// to free (Registry.Restore).
func joinParts(items []segment.Restored) []segment.Restored {
	byID := make(map[uint64]int, len(items))
	for i, it := range items {
		if it.Record.PartOf != 0 {
			byID[it.Record.ID] = i
		}
	}
	taken := map[int]bool{}
	for i := range items {
		it := &items[i]
		ps := it.Record.Parts
		if len(ps) < 2 || it.Record.PartOf != 0 || it.Problem != "" || it.Memory == nil {
			continue
		}
		mems := []segment.Memory{it.Memory}
		var take []int
		problem := ""
		if ps[0].ID != it.Record.ID || it.Memory.Size() != ps[0].Size {
			problem = "its record lists the parts of its host memory wrongly"
		}
		for k, p := range ps[1:] {
			if problem != "" {
				break
			}
			j, ok := byID[p.ID]
			switch {
			case !ok || taken[j] || slices.Contains(take, j):
				problem = fmt.Sprintf("part %d of its host memory (record %d) is missing", k+1, p.ID)
			case items[j].Record.PartOf != it.Record.ID || items[j].Problem != "" || items[j].Memory == nil ||
				items[j].Memory.Size() != p.Size:
				problem = fmt.Sprintf("part %d of its host memory (record %d) is not usable", k+1, p.ID)
			default:
				mems = append(mems, items[j].Memory)
				take = append(take, j)
			}
		}
		var total int64
		for _, p := range ps {
			total += p.Size
		}
		if problem == "" && total != it.Record.Alloc {
			problem = fmt.Sprintf("its parts hold %d bytes, its record %d", total, it.Record.Alloc)
		}
		if problem == "" {
			mem, err := backend.JoinParts(mems)
			if err != nil {
				problem = err.Error()
			} else {
				it.Memory = mem
				for _, j := range take {
					taken[j] = true
				}
			}
		}
		if problem != "" {
			it.Problem = problem
		}
	}
	out := items[:0]
	for i, it := range items {
		if !taken[i] {
			out = append(out, it)
		}
	}
	return out
}

// restoreChannel puts a channel's memory together again: its slots and its
// control block, which must both be there and check out.
func restoreChannel(host *backend.Host, it segment.Restored, ctlFD int) (segment.Memory, string) {
	problem := it.Problem
	var ctl segment.Memory
	if ctlFD >= 0 {
		m, err := host.Restore(0, ctlFD, segment.ControlBytes)
		if err == nil && it.Record.Slots > 0 {
			if err = checkControl(ctlFD, it.Record); err != nil {
				m = nil
			}
		}
		if err != nil {
			if problem == "" {
				problem = "its control block is not usable: " + err.Error()
			}
			m = rawMemory{fd: ctlFD, size: segment.ControlBytes}
		}
		ctl = m
	} else if problem == "" {
		problem = "its control block is missing"
	}
	if it.Record.Slots == 0 && problem == "" {
		problem = "a control block came back for a segment that is not a channel"
	}
	switch {
	case it.Memory == nil && ctl == nil:
		return nil, problem
	case it.Memory == nil:
		return ctl, problem
	case ctl == nil:
		return it.Memory, problem
	}
	return &segment.ChannelMemory{Data: it.Memory, Control: ctl}, problem
}

// checkControl checks that the control block at fd describes the channel
// rec records: a block of another layout is another channel's.
func checkControl(fd int, rec segment.Record) error {
	b, err := unix.Mmap(fd, 0, channel.BlockBytes, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("map: %w", err)
	}
	defer unix.Munmap(b)
	blk, err := channel.Map(b)
	if err != nil {
		return err
	}
	slots, slotBytes, _, err := blk.Check()
	if err != nil {
		return err
	}
	if slots != rec.Slots || slotBytes != rec.SlotBytes {
		return fmt.Errorf("it describes %d slots of %d bytes, the record %d slots of %d bytes", slots, slotBytes, rec.Slots, rec.SlotBytes)
	}
	return nil
}

// rawMemory holds a descriptor the backend could not use: an orphan's
// memory, kept (not freed) until removed. Its size is what the record
// says, so that the record journaled for the orphan still says it has
// memory and the supervisor goes on holding the descriptor.
type rawMemory struct {
	fd   int
	size int64
}

func (m rawMemory) FD() (int, error) { return m.fd, nil }
func (m rawMemory) Size() int64      { return m.size }
func (m rawMemory) Free() error      { return syscall.Close(m.fd) }
