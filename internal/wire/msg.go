package wire

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math/bits"
	"strconv"

	jsonv2 "github.com/go-json-experiment/json"
	"github.com/go-json-experiment/json/jsontext"
)

// Version is the protocol version spoken by this package.
const Version = 1

// MaxMessage bounds every packet in both directions. It stays well under the
// default socket buffer (about 208 KiB) so a packet always fits in one send.
const MaxMessage = 64 << 10

// MaxMeta bounds a segment's user metadata, so that any single-segment reply
// fits in one packet.
const MaxMeta = 32 << 10

// Lifetimes a create may ask for.
const (
	// LifetimeConnection ends the segment when the connection that created
	// it closes, for whatever reason.
	LifetimeConnection = "connection"
)

// Request is a client's message. Fields an operation does not use must be
// absent or zero.
type Request struct {
	ID       uint64          `json:"id"`
	Op       string          `json:"op"`
	Version  int             `json:"version,omitempty"`
	Name     string          `json:"name,omitempty"`
	Size     int64           `json:"size,omitempty"`
	Device   *int            `json:"device,omitempty"`
	Mode     *uint32         `json:"mode,omitempty"`
	Meta     json.RawMessage `json:"meta,omitempty"`
	ExistOK  bool            `json:"exist_ok,omitempty"`
	Open     bool            `json:"open,omitempty"`
	ReadOnly bool            `json:"readonly,omitempty"`
	Segment  uint64          `json:"segment,omitempty"`
	After    string          `json:"after,omitempty"`
	Limit    int             `json:"limit,omitempty"`
	Lifetime string          `json:"lifetime,omitempty"`
	TTL      float64         `json:"ttl_seconds,omitempty"`
	UID      *int64          `json:"uid,omitempty"`
	GID      *int64          `json:"gid,omitempty"`
	To       string          `json:"to,omitempty"`
	// Session (hello) names the client across reconnections.
	Session string `json:"session,omitempty"`
	// Count (reclaim) is how many leases to take back.
	Count int `json:"count,omitempty"`
	// Slots and SlotBytes (create) make a channel; Role (open, create with
	// open, reclaim) takes a channel's role: "tx" or "rx".
	Slots     int    `json:"slots,omitempty"`
	SlotBytes int64  `json:"slot_bytes,omitempty"`
	Role      string `json:"role,omitempty"`
	// Uncommitted (create) makes a segment that only its creator may open
	// until it commits it (OpCommit); Wait (open) is how long, in seconds,
	// to wait for the name to name a committed segment.
	Uncommitted bool    `json:"uncommitted,omitempty"`
	Wait        float64 `json:"wait,omitempty"`
	// Offset (fill, dump) is where in the file the bytes are; At where in
	// the segment; Size how many.
	Offset int64 `json:"offset,omitempty"`
	At     int64 `json:"at,omitempty"`
	// Trace (any operation) asks the daemon to time the request's steps
	// and send them in the reply, for benchmarks.
	Trace bool `json:"trace,omitempty"`
	// Pin (create, pin) keeps the segment on its device: it is never
	// evicted to host memory.
	Pin bool `json:"pin,omitempty"`
	// NextVersion (create, with uncommitted and open) makes the next
	// version of the name: it takes the name only when its writer commits
	// it, replacing the current version in one step.
	NextVersion bool `json:"next_version,omitempty"`
	// Empty (create, without open) makes a segment of size 0: a name
	// that holds no memory, as an empty file does.
	Empty bool `json:"empty,omitempty"`
	// NoReplace (rename) fails with EEXIST when the new name exists,
	// instead of replacing it.
	NoReplace bool `json:"no_replace,omitempty"`
	// Persist (create) makes a durable segment: its bytes go to disk after
	// its commit and at each sync, and come back after a reboot (docs/disk.md).
	Persist bool `json:"persist,omitempty"`
	// Offer (create, offer) offers the segment to the daemon's peers on
	// other nodes (docs/peers.md); in offer, absent or false takes it back.
	Offer bool `json:"offer,omitempty"`
	// From (pull) names the peer to pull from (absent: any that offers
	// the name).
	From string `json:"from,omitempty"`
}

// Reply answers the Request with the same ID. Exactly one of Error or the
// operation's result fields is set.
type Reply struct {
	ID    uint64 `json:"id"`
	Error *Error `json:"error,omitempty"`

	// hello
	Version int    `json:"version,omitempty"`
	Server  string `json:"server,omitempty"`
	// Epoch says that the attached fd is the epoch page (hello only).
	Epoch bool `json:"epoch,omitempty"`
	// Peer (hello) is the client as the daemon knows it, from
	// SO_PEERCRED: the uid and gid its segments get and its requests are
	// checked as, which a client in a user namespace cannot learn from
	// its own geteuid.
	Peer *Peer `json:"peer,omitempty"`

	// info
	Backend string   `json:"backend,omitempty"`
	Devices []Device `json:"devices,omitempty"`
	Usage   *Usage   `json:"usage,omitempty"`
	// Pool is absent while the daemon holds none.
	Pool *Pool `json:"pool,omitempty"`
	// Tiers is the devices' budgets and what moved between them and host
	// memory.
	Tiers *Tiers `json:"tiers,omitempty"`
	// PID is the process serving the socket; SupervisorPID the one
	// holding the segments' descriptors across its restarts (equal to PID
	// when the daemon runs unsupervised). Restarts counts serving
	// processes that died and were replaced (always in info, 0 included);
	// Grace is how long, in seconds, clients of a replaced process may
	// still reclaim leases (absent when they may not).
	PID           int     `json:"pid,omitempty"`
	SupervisorPID int     `json:"supervisor_pid,omitempty"`
	Restarts      *int    `json:"restarts,omitempty"`
	Grace         float64 `json:"grace_seconds,omitempty"`
	// GPU is what the daemon knows of the node's GPUs.
	GPU *GPUReport `json:"gpu,omitempty"`
	// Users is what each uid holds on each device; Quotas the limits in
	// force and their use.
	Users  []UserUse `json:"users,omitempty"`
	Quotas []Quota   `json:"quotas,omitempty"`

	// Trace answers a request that asked for one (create, open).
	Trace *Trace `json:"trace,omitempty"`

	// peers: absent when the daemon has no peers configured.
	Peers *PeersReport `json:"peers,omitempty"`

	// create, open, stat
	Segment *Segment `json:"segment,omitempty"`
	// Created (create, publish) says whether this request allocated; it is
	// sent false too, when create with exist_ok found the segment.
	Created *bool `json:"created,omitempty"`
	// FD says that a descriptor for Segment is attached (create with open, open).
	FD bool `json:"fd,omitempty"`
	// Control says that a second packet follows with a channel's control
	// block; ControlFD marks that packet.
	Control   bool `json:"control,omitempty"`
	ControlFD bool `json:"control_fd,omitempty"`
	// CtlFD is where a client puts the control block's descriptor once it
	// read the second packet; -1 when none. Never on the wire.
	CtlFD int `json:"-"`

	// list
	Segments []Segment `json:"segments,omitempty"`
	Next     string    `json:"next,omitempty"`

	// fill, dump: the bytes copied, the copy's own seconds (the daemon's
	// engine, from the first read to the last byte in place), how many
	// copiers worked and how many bytes were read with O_DIRECT.
	Bytes       int64   `json:"bytes,omitempty"`
	CopySeconds float64 `json:"copy_seconds,omitempty"`
	Copiers     int     `json:"copiers,omitempty"`
	Direct      int64   `json:"direct,omitempty"`
	// CRC32C (fill) is the CRC-32C of the bytes copied, 8 lowercase
	// hexadecimal digits, computed as the engine read them. Daemons from
	// before it send none.
	CRC32C string `json:"crc32c,omitempty"`
}

// Device describes one device the daemon allocates on.
type Device struct {
	Index       int    `json:"index"`
	Name        string `json:"name"`
	UUID        string `json:"uuid,omitempty"`
	TotalBytes  uint64 `json:"total_bytes"`
	FreeBytes   uint64 `json:"free_bytes"`
	Granularity int64  `json:"granularity"`
}

// Trace is the daemon's timing of one request: TotalNS from the moment
// the request was read to the moment its reply was encoded, and its
// steps, in order (docs/protocol.md, "Tracing a request").
type Trace struct {
	TotalNS int64       `json:"total_ns"`
	Steps   []TraceStep `json:"steps"`
}

// TraceStep is one step of a traced request.
type TraceStep struct {
	Step string `json:"step"`
	NS   int64  `json:"ns"`
}

// Pool is what the daemon holds of allocations made ahead of time (info):
// memory that belongs to no segment yet, and that a create takes first.
type Pool struct {
	// Ready is how many allocations wait to be taken; Bytes their size;
	// Filling how many sizes are being made now.
	Ready   int   `json:"ready"`
	Bytes   int64 `json:"bytes"`
	Filling int   `json:"filling"`
}

// Usage is what the daemon holds.
type Usage struct {
	Segments int   `json:"segments"` // holding memory, named or unlinked-but-open
	Named    int   `json:"named"`
	Bytes    int64 `json:"bytes"` // allocated
	Opens    int   `json:"opens"`
}

// GPUReport is what the daemon knows of the node's GPUs (info).
type GPUReport struct {
	// Source is where the figures come from: "nvml"; "cuda" (the driver's
	// cuMemGetInfo, for the GPUs the daemon serves: memory only); or "none".
	Source string `json:"source"`
	// Note says why NVML is not the source, or what it could not read.
	Note   string `json:"note,omitempty"`
	Driver string `json:"driver,omitempty"`
	GPUs   []GPU  `json:"gpus,omitempty"`
}

// GPU is one GPU of the node.
type GPU struct {
	// Index is NVML's index (nvidia-smi's) with source "nvml", else the
	// CUDA ordinal; Device is the ordinal gpushm serves the GPU as, absent
	// when it does not serve it.
	Index      int    `json:"index"`
	Device     *int   `json:"device,omitempty"`
	Name       string `json:"name"`
	UUID       string `json:"uuid,omitempty"`
	TotalBytes uint64 `json:"total_bytes"`
	UsedBytes  uint64 `json:"used_bytes"`
	// Utilization is the percentage of NVML's last sample period in which
	// a kernel ran; absent when unknown.
	Utilization *int         `json:"utilization_percent,omitempty"`
	Processes   []GPUProcess `json:"processes,omitempty"`
	// MoreProcesses counts processes left out of Processes (the smallest)
	// so that the reply fits in one packet.
	MoreProcesses int `json:"more_processes,omitempty"`
}

// GPUProcess is a process holding memory on a GPU.
type GPUProcess struct {
	PID       uint32 `json:"pid"`
	UsedBytes uint64 `json:"used_bytes"`
	// Command and UID come from /proc/PID, where the daemon can read it.
	Command string  `json:"command,omitempty"`
	UID     *uint32 `json:"uid,omitempty"`
}

// Handle types of a segment's descriptor.
const (
	HandleMemfd = "memfd"   // mmap it
	HandleCUDA  = "cuda_fd" // cuMemImportFromShareableHandle, POSIX fd
)

// Segment is the public state of one segment. A caller who may not read
// the segment gets it without Meta and without its Versions' PIDs
// (docs/security.md, "What others may see").
type Segment struct {
	ID        uint64 `json:"id"`
	Name      string `json:"name"`
	Size      int64  `json:"size"`
	AllocSize int64  `json:"alloc_size"`
	Device    int    `json:"device"`
	// UUID names a cuda segment's GPU ("GPU-…", as nvidia-smi prints
	// it). Device is the daemon's ordinal, which a client that sees
	// another set of GPUs (a container, CUDA_VISIBLE_DEVICES) numbers
	// differently: clients map by UUID.
	UUID       string          `json:"uuid,omitempty"`
	HandleType string          `json:"handle_type"`
	UID        uint32          `json:"uid"`
	GID        uint32          `json:"gid"`
	Mode       uint32          `json:"mode"`
	Opens      int             `json:"opens"`
	Created    int64           `json:"created"` // Unix nanoseconds
	Meta       json.RawMessage `json:"meta,omitempty"`
	// Lifetime is "connection" for a segment that ends with its creator's
	// connection; TTL, in seconds, ends a segment unopened that long, and
	// Idle (Unix nanoseconds) is when it was last seen unopened.
	Lifetime string  `json:"lifetime,omitempty"`
	TTL      float64 `json:"ttl_seconds,omitempty"`
	Idle     int64   `json:"idle_since,omitempty"`
	// Orphan, when set, says why the daemon cannot serve the segment: it
	// survived a restart in a state the daemon could not prove. It can be
	// listed, stat'ed and removed, not opened.
	Orphan string `json:"orphan,omitempty"`
	// Channel describes a channel (docs/protocol.md, "Channels").
	Channel *Channel `json:"channel,omitempty"`
	// Uncommitted: its creator is still filling it; it cannot be opened
	// until the creator commits it.
	Uncommitted bool `json:"uncommitted,omitempty"`
	// Tier is where its bytes are: "gpu" (on its device; on the host
	// backend, the memory it serves) or "host" (evicted; an open brings it
	// back). LastOpen (Unix nanoseconds) is when it was last opened,
	// created or loaded; Pinned says it never leaves its device.
	Tier     string `json:"tier,omitempty"`
	LastOpen int64  `json:"last_open,omitempty"`
	Pinned   bool   `json:"pinned,omitempty"`
	// Persist says the segment is durable (docs/disk.md); Synced (Unix
	// nanoseconds) is when its copy on disk was written, absent while it
	// has none; Stale that it was opened to be written since.
	Persist bool  `json:"persist,omitempty"`
	Synced  int64 `json:"synced,omitempty"`
	Stale   bool  `json:"stale,omitempty"`
	// Offer says the daemon offers the segment to its peers.
	Offer bool `json:"offer,omitempty"`
	// Version counts the segments the name has named, this one included
	// (absent from older daemons: 1). Versions (stat only) are the
	// name's earlier versions that are still held, oldest first.
	Version uint64 `json:"version,omitempty"`
	// RDMA says an RDMA engine (NIXL, UCX, Mooncake) can register the
	// memory: cuda memory made gpuDirectRDMACapable, on a device that
	// allows it. Absent for host memory, evicted segments included.
	RDMA     bool          `json:"rdma,omitempty"`
	Versions []HeldVersion `json:"versions,omitempty"`
	// Sources (stat only) are the ranges the daemon itself filled from
	// files, with each file's identity as the daemon saw it
	// (docs/protocol.md, "Sources"): what a loader may trust about which
	// bytes are which file's.
	Sources []Source `json:"sources,omitempty"`
}

// Source is a range of a segment the daemon filled from a file: the
// file's device, inode, size and times as fstat saw them through the
// client's descriptor before and after the copy (equal, or no source is
// recorded), where the range starts in the file (Offset) and in the
// segment (At), its length, and its CRC-32C (8 lowercase hex digits).
type Source struct {
	Dev     uint64 `json:"dev"`
	Ino     uint64 `json:"ino"`
	Size    int64  `json:"size"`
	MtimeNS int64  `json:"mtime_ns"`
	CtimeNS int64  `json:"ctime_ns"`
	Offset  int64  `json:"offset"`
	At      int64  `json:"at"`
	Len     int64  `json:"len"`
	CRC32C  string `json:"crc32c"`
}

// Peer is a client's identity as the daemon sees it.
type Peer struct {
	UID uint32 `json:"uid"`
	GID uint32 `json:"gid"`
}

// HeldVersion is an earlier version of a name that readers still hold.
type HeldVersion struct {
	ID      uint64 `json:"id"`
	Version uint64 `json:"version"`
	Opens   int    `json:"opens"`
	// PIDs are the processes holding it, as the daemon sees them (those
	// of a pid namespace it cannot see are counted in Opens only); absent
	// for a caller who may not read the segment.
	PIDs []int `json:"pids,omitempty"`
}

// Tiers is what info says of budgets and eviction.
type Tiers struct {
	Devices []DeviceTier `json:"devices"`
	// HostBudget bounds the bytes evicted to host memory (0: eviction is
	// off); HostBytes is what they hold now.
	HostBudget int64 `json:"host_budget_bytes"`
	HostBytes  int64 `json:"host_bytes"`
	// CleanBytes is host memory that holds copies of segments back on
	// their device, opened only read-only since: evicting one again is a
	// swap, not a copy. It counts against the host budget, and goes first
	// when an eviction needs room.
	CleanBytes int64 `json:"host_copy_bytes"`
	// Spare and SpareBytes: host memory let go of (memfds), kept a while
	// for the next eviction of its size.
	Spare      int   `json:"spare_memfds"`
	SpareBytes int64 `json:"spare_bytes"`
	// Reserve: host memory made ahead of evictions (gpushm daemon
	// --host-reserve), ReserveTarget bytes when full, ReserveBytes in
	// ReserveMemfds now; ReserveTakes is the evictions (and growths of
	// evicted segments) that took their memory from it.
	ReserveTarget int64  `json:"reserve_target_bytes"`
	ReserveBytes  int64  `json:"reserve_bytes"`
	ReserveMemfds int    `json:"reserve_memfds"`
	ReserveTakes  uint64 `json:"reserve_takes"`
	Evictions     uint64 `json:"evictions"`
	Restores      uint64 `json:"restores"`
	EvictedBytes  int64  `json:"evicted_bytes"`
	RestoredBytes int64  `json:"restored_bytes"`
	// Disk is the disk tier, absent without one.
	Disk *DiskTier `json:"disk,omitempty"`
}

// DiskTier is what info says of the disk tier: the bytes its copies take
// and may take (0: no budget), the segments whose bytes are only there,
// the durable segments, and the copies written and read since the daemon
// started.
type DiskTier struct {
	Bytes        int64  `json:"bytes"`
	Budget       int64  `json:"budget_bytes"`
	Segments     int    `json:"segments"`
	Durable      int    `json:"durable"`
	Writes       uint64 `json:"writes"`
	Reads        uint64 `json:"reads"`
	WrittenBytes int64  `json:"written_bytes"`
	ReadBytes    int64  `json:"read_bytes"`
}

// DeviceTier is one device's budget (0: none), the bytes on it now, and
// the most it held since the daemon started.
type DeviceTier struct {
	Device int   `json:"device"`
	Budget int64 `json:"budget_bytes"`
	Bytes  int64 `json:"bytes"`
	Peak   int64 `json:"peak_bytes"`
}

// UserUse is what one uid's segments hold on one device (info): bytes
// allocated, whether on the device or evicted to host memory, and
// segments, those that hold no memory included.
type UserUse struct {
	UID      uint32 `json:"uid"`
	Device   int    `json:"device"`
	Bytes    int64  `json:"bytes"`
	Segments int    `json:"segments"`
}

// Quota is one limit in force and its use (info), as the daemon's
// metrics have them: Kind is "device_bytes" (Scope: the device),
// "segments" (the daemon's), "user_bytes" or "user_segments" (Scope: the
// uid) or "user_device_bytes" (Scope: uid/device).
type Quota struct {
	Kind  string `json:"kind"`
	Scope string `json:"scope,omitempty"`
	Used  int64  `json:"used"`
	Limit int64  `json:"limit"`
}

// Channel is a channel's layout.
type Channel struct {
	Slots        int   `json:"slots"`
	SlotBytes    int64 `json:"slot_bytes"`
	SlotStride   int64 `json:"slot_stride"`
	ControlBytes int64 `json:"control_bytes"`
}

// Error is a failed operation: Code is an errno name such as "ENOENT".
type Error struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

func (e *Error) Error() string { return e.Message + " (" + e.Code + ")" }

// ErrProto marks messages that do not follow the protocol.
var ErrProto = errors.New("protocol error")

// DecodeRequest parses one packet. It is strict: unknown or duplicate
// fields, fields of the wrong type (null included, except for meta, where
// null means none), fields the operation does not use unless zero, invalid
// UTF-8, trailing data, a missing op and oversized packets are protocol
// errors, so that a client's typo fails loudly instead of being ignored.
//
// The request is returned with most errors, for its ID; when the packet is
// too broken for that, RequestID still finds the ID if it can.
func DecodeRequest(b []byte) (*Request, error) {
	if err := checkSize(b); err != nil {
		return nil, err
	}
	if r, ok := decodeHotRequest(b); ok {
		return checkRequest(r)
	}
	var r Request
	if err := jsonv2.Unmarshal(b, &r, jsonv2.RejectUnknownMembers(true)); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrProto, err)
	}
	// The decoder reads null as "leave the field alone", which would make
	// a null name an empty one. Few packets spell null, so only those pay
	// for a second look.
	if bytes.Contains(b, []byte("null")) {
		if name := scanRequest(b).null; name != "" {
			return &r, fmt.Errorf("%w: %q is null", ErrProto, name)
		}
		if string(r.Meta) == "null" {
			r.Meta = nil
		}
	}
	return checkRequest(&r)
}

func checkRequest(r *Request) (*Request, error) {
	if r.Op == "" {
		return r, fmt.Errorf("%w: missing op", ErrProto)
	}
	if err := checkUnused(r); err != nil {
		return r, err
	}
	return r, nil
}

// RequestID reads the id of a packet that DecodeRequest may refuse: the
// first top-level member "id" that is a uint64, read as far into the
// packet as the JSON holds together (a truncated packet, trailing data or
// a bad field after the id do not hide it). ok is false when the packet
// holds no readable id; the reply then carries 0.
func RequestID(b []byte) (id uint64, ok bool) {
	s := scanRequest(b)
	return s.id, s.idOK
}

type scanned struct {
	id   uint64
	idOK bool
	null string // the first member other than meta that is null
}

// scanRequest reads a packet's top-level members leniently (duplicate
// names and invalid UTF-8 allowed), stopping at the first syntax error.
func scanRequest(b []byte) scanned {
	var s scanned
	dec := jsontext.NewDecoder(bytes.NewReader(b), jsontext.AllowDuplicateNames(true), jsontext.AllowInvalidUTF8(true))
	if tok, err := dec.ReadToken(); err != nil || tok.Kind() != '{' {
		return s
	}
	seenID := false
	for dec.PeekKind() == '"' {
		tok, err := dec.ReadToken()
		if err != nil {
			return s
		}
		name := tok.String() // the token is valid only until the next read
		if dec.PeekKind() == 'n' && name != "meta" && s.null == "" {
			s.null = name
		}
		v, err := dec.ReadValue()
		if err != nil {
			return s
		}
		if name == "id" && !seenID {
			seenID = true
			if n, err := strconv.ParseUint(string(v), 10, 64); err == nil && v.Kind() == '0' {
				s.id, s.idOK = n, true
			}
		}
	}
	return s
}

// The request's fields beyond id and op, one bit each; fieldNames has
// their names on the wire.
const (
	fVersion uint64 = 1 << iota
	fName
	fSize
	fDevice
	fMode
	fMeta
	fExistOK
	fOpen
	fReadOnly
	fSegment
	fAfter
	fLimit
	fLifetime
	fTTL
	fUID
	fGID
	fTo
	fSession
	fCount
	fSlots
	fSlotBytes
	fRole
	fUncommitted
	fWait
	fOffset
	fAt
	fTrace
	fPin
	fNextVersion
	fEmpty
	fNoReplace
	fPersist
	fOffer
	fFrom
	fieldCount = iota
)

var fieldNames = [fieldCount]string{
	"version", "name", "size", "device", "mode", "meta", "exist_ok", "open", "readonly", "segment",
	"after", "limit", "lifetime", "ttl_seconds", "uid", "gid", "to", "session", "count", "slots",
	"slot_bytes", "role", "uncommitted", "wait", "offset", "at", "trace", "pin", "next_version",
	"empty", "no_replace", "persist", "offer", "from",
}

// setFields is the set of r's fields that hold something other than
// their zero value. Straight tests, no list: decoding is on every round
// trip.
func setFields(r *Request) uint64 {
	var m uint64
	set := func(f uint64, nonzero bool) {
		if nonzero {
			m |= f
		}
	}
	set(fVersion, r.Version != 0)
	set(fName, r.Name != "")
	set(fSize, r.Size != 0)
	set(fDevice, r.Device != nil && *r.Device != 0)
	set(fMode, r.Mode != nil && *r.Mode != 0)
	set(fMeta, len(r.Meta) > 0)
	set(fExistOK, r.ExistOK)
	set(fOpen, r.Open)
	set(fReadOnly, r.ReadOnly)
	set(fSegment, r.Segment != 0)
	set(fAfter, r.After != "")
	set(fLimit, r.Limit != 0)
	set(fLifetime, r.Lifetime != "")
	set(fTTL, r.TTL != 0)
	set(fUID, r.UID != nil && *r.UID != 0)
	set(fGID, r.GID != nil && *r.GID != 0)
	set(fTo, r.To != "")
	set(fSession, r.Session != "")
	set(fCount, r.Count != 0)
	set(fSlots, r.Slots != 0)
	set(fSlotBytes, r.SlotBytes != 0)
	set(fRole, r.Role != "")
	set(fUncommitted, r.Uncommitted)
	set(fWait, r.Wait != 0)
	set(fOffset, r.Offset != 0)
	set(fAt, r.At != 0)
	set(fTrace, r.Trace)
	set(fPin, r.Pin)
	set(fNextVersion, r.NextVersion)
	set(fEmpty, r.Empty)
	set(fNoReplace, r.NoReplace)
	set(fPersist, r.Persist)
	set(fOffer, r.Offer)
	set(fFrom, r.From != "")
	return m
}

func checkUnused(r *Request) error {
	o := operations[r.Op]
	if o == nil {
		return nil // an unknown op is the server's to refuse (ENOSYS)
	}
	if extra := setFields(r) &^ o.fields; extra != 0 {
		return fmt.Errorf("%w: %s does not take %q", ErrProto, r.Op, fieldNames[bits.TrailingZeros64(extra)])
	}
	return nil
}

// DecodeReply parses one reply packet. Unknown fields are ignored, so that
// a newer daemon may add some.
func DecodeReply(b []byte) (*Reply, error) {
	if err := checkSize(b); err != nil {
		return nil, err
	}
	if r, ok := decodeHotReply(b); ok {
		return r, nil
	}
	r := Reply{CtlFD: -1}
	if err := jsonv2.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrProto, err)
	}
	return &r, nil
}

func checkSize(b []byte) error {
	if len(b) > MaxMessage {
		return fmt.Errorf("%w: message is %d bytes, limit %d", ErrProto, len(b), MaxMessage)
	}
	return nil
}

// Decoding uses the v2 prototype of encoding/json (strict and about three
// times faster here, which is a fifth of a round trip); encoding stays with
// encoding/json, faster for the replies and with the omitempty rules the
// protocol document describes.

// KeepBuffer bounds the encoding buffer a caller of AppendEncode keeps
// for its next message: a list's reply or a create's meta of 64 KiB is
// not kept for every worker and client.
const KeepBuffer = 4 << 10

// Encode marshals a message and checks that it fits in one packet.
func Encode(v any) ([]byte, error) { return AppendEncode(nil, v) }

// AppendEncode is Encode appending to dst, for a caller that keeps a
// buffer across messages (up to KeepBuffer bytes of it).
func AppendEncode(dst []byte, v any) ([]byte, error) {
	start := len(dst)
	if dst == nil {
		dst = make([]byte, 0, 512)
	}
	var (
		b  []byte
		ok bool
	)
	switch m := v.(type) {
	case *Request:
		b, ok = appendRequest(dst, m)
	case *Reply:
		b, ok = appendReply(dst, m)
	}
	if !ok {
		j, err := json.Marshal(v)
		if err != nil {
			return dst, err
		}
		b = append(dst, j...)
	}
	if n := len(b) - start; n > MaxMessage {
		return dst[:start], fmt.Errorf("%w: message is %d bytes, limit %d", ErrProto, n, MaxMessage)
	}
	return b, nil
}

// PeersReport is what the peers operation says: this node's name, the
// address it listens on for peers (empty: none), the name whose addresses
// are its peers (--peer-service) and why its last resolution failed, and
// each peer.
type PeersReport struct {
	Node         string     `json:"node"`
	Listen       string     `json:"listen,omitempty"`
	Service      string     `json:"service,omitempty"`
	ServiceError string     `json:"service_error,omitempty"`
	Peers        []PeerNode `json:"peers"`
	Pulls        []PeerPull `json:"pulls,omitempty"`
}

// PeerPull is a pull in progress here: the name, the peer that lends it,
// its size and the bytes checked so far.
type PeerPull struct {
	Name string `json:"name"`
	From string `json:"from"`
	Size int64  `json:"size"`
	Done int64  `json:"done"`
}

// PeerNode is a peer: its node name once a handshake told it, its address,
// whether it is one this node dials (outbound) or one that dialed it,
// whether it is connected (since when, or failing since when, and why),
// and, when connected, what it offers, or why that could not be asked.
type PeerNode struct {
	Name      string      `json:"name,omitempty"`
	Addr      string      `json:"addr"`
	Outbound  bool        `json:"outbound"`
	Connected bool        `json:"connected"`
	Since     int64       `json:"since,omitempty"` // Unix nanoseconds
	LastError string      `json:"last_error,omitempty"`
	Offers    []PeerOffer `json:"offers,omitempty"`
	Error     string      `json:"error,omitempty"`
}

// PeerOffer is a segment a peer offers: its name, size, owner and group
// (user names, as the peer knows them), mode and version.
type PeerOffer struct {
	Name    string `json:"name"`
	Size    int64  `json:"size"`
	Owner   string `json:"owner"`
	Group   string `json:"group,omitempty"`
	Mode    uint32 `json:"mode"`
	Version uint64 `json:"version"`
}
