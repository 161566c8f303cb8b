package wire

import "time"

// The protocol's operations, as Request.Op names them. Operations says
// what each does and which fields it reads.
const (
	OpHello       = "hello"
	OpInfo        = "info"
	OpCreate      = "create"
	OpOpen        = "open"
	OpClose       = "close"
	OpUnlink      = "unlink"
	OpStat        = "stat"
	OpList        = "list"
	OpChmod       = "chmod"
	OpChown       = "chown"
	OpRename      = "rename"
	OpPublish     = "publish"
	OpReclaim     = "reclaim"
	OpCommit      = "commit"
	OpWaitVersion = "wait_version"
	OpFill        = "fill"
	OpDump        = "dump"
	OpEvict       = "evict"
	OpLoad        = "load"
	OpPin         = "pin"
	OpSync        = "sync"
	OpOffer       = "offer"
	OpPeers       = "peers"
	OpPull        = "pull"
)

// An Operation is one operation of the protocol.
type Operation struct {
	// Name is the operation's name on the wire (Request.Op), and the
	// title of its section in docs/protocol.md.
	Name string
	// FD is whether its request comes with a descriptor.
	FD bool
	// Doc says what it does, in one line.
	Doc string
	// fields are the fields of Request it reads. A field outside them
	// must be absent or zero, so that a client that sends one by mistake
	// (a size with open, a mode with stat) learns that the daemon would
	// ignore it. Every operation takes trace.
	fields uint64
}

// Operations is the one list of the protocol's operations, in the order
// of docs/protocol.md's op row. The decoder takes each one's fields from
// it; the server's dispatch has one handler for each, and for nothing
// else (its tests check); docs/protocol.md's op row lists these, in this
// order, and has a section for each (TestProtocolDocRequests); and the
// conformance examples send every one (internal/server's
// TestConformance). An operation is added here first.
var Operations = []Operation{
	{Name: OpHello, Doc: "the first message: the protocol version and the client's session; the reply carries the epoch page",
		fields: fTrace | fVersion | fSession},
	{Name: OpInfo, Doc: "the daemon: its version, backend, devices, limits and usage",
		fields: fTrace},
	{Name: OpCreate, Doc: "a new segment, or a channel; with open, opened at once",
		fields: fTrace | fName | fSize | fDevice | fMode | fMeta | fExistOK | fOpen | fReadOnly | fLifetime | fTTL | fSlots | fSlotBytes | fRole | fUncommitted | fPin | fNextVersion | fEmpty | fPersist | fOffer},
	{Name: OpOpen, Doc: "a lease on a segment by its name, and its descriptor",
		fields: fTrace | fName | fReadOnly | fRole | fWait},
	{Name: OpClose, Doc: "gives back a lease this connection holds",
		fields: fTrace | fSegment | fRole},
	{Name: OpUnlink, Doc: "removes a name; the memory goes with its last lease",
		fields: fTrace | fName},
	{Name: OpStat, Doc: "one segment's description, by its name",
		fields: fTrace | fName},
	{Name: OpList, Doc: "the segments' descriptions, in name order, a page at a time",
		fields: fTrace | fAfter | fLimit},
	{Name: OpChmod, Doc: "a segment's permission bits",
		fields: fTrace | fName | fMode},
	{Name: OpChown, Doc: "a segment's owner and group",
		fields: fTrace | fName | fUID | fGID},
	{Name: OpRename, Doc: "gives a segment another name, over an existing one unless no_replace",
		fields: fTrace | fName | fTo | fNoReplace},
	{Name: OpPublish, FD: true, Doc: "a segment of memory the client allocated and sends",
		fields: fTrace | fName | fSize | fDevice | fMode | fMeta | fLifetime | fTTL},
	{Name: OpReclaim, Doc: "takes back leases a client held before the daemon restarted",
		fields: fTrace | fSegment | fCount | fReadOnly | fRole},
	{Name: OpCommit, Doc: "makes a segment created uncommitted openable by its name, with meta, if it carries one, as its meta from then on",
		fields: fTrace | fSegment | fMeta},
	{Name: OpWaitVersion, Doc: "answers when the name names another segment than the one given: the reader's version was replaced (docs/protocol.md, \"Versions\")",
		fields: fTrace | fName | fSegment | fWait},
	{Name: OpFill, FD: true, Doc: "the daemon's copy engine copies the file sent into a segment the client holds open read-write",
		fields: fTrace | fSegment | fSize | fOffset | fAt},
	{Name: OpDump, FD: true, Doc: "the daemon's copy engine copies a segment the client holds open into the file sent",
		fields: fTrace | fSegment | fSize | fOffset | fAt},
	{Name: OpEvict, Doc: "moves a segment nobody holds to host memory now, or (to \"disk\") to the disk tier",
		fields: fTrace | fName | fTo},
	{Name: OpLoad, Doc: "brings a segment back to its device ahead of an open",
		fields: fTrace | fName},
	{Name: OpPin, Doc: "keeps a segment on its device (pin true), or lets it move again",
		fields: fTrace | fName | fPin},
	{Name: OpSync, Doc: "writes a durable segment's bytes to disk now, and answers once they are durable",
		fields: fTrace | fName},
	{Name: OpOffer, Doc: "offers a segment to the daemon's peers on other nodes (offer true), or takes it back",
		fields: fTrace | fName | fOffer},
	{Name: OpPeers, Doc: "the daemon's peers on other nodes: whether each is connected, and what it offers; with a name, only that name's pull in progress here",
		fields: fTrace | fName},
	{Name: OpPull, Doc: "copies a segment a peer offers into a new one of the same name here, committed once every chunk checked",
		fields: fTrace | fName | fFrom},
}

// PullTime bounds a pull on the daemon's side; a client waits that much
// longer than its timeout for a pull's reply, which comes when the bytes
// are here.
const PullTime = 30 * time.Minute

// operations indexes Operations by name, for the decoder and CarriesFD.
var operations = func() map[string]*Operation {
	m := make(map[string]*Operation, len(Operations))
	for i := range Operations {
		m[Operations[i].Name] = &Operations[i]
	}
	return m
}()

// Known says whether op is an operation of the protocol.
func Known(op string) bool { return operations[op] != nil }

// CarriesFD says whether a request of op comes with a descriptor.
func CarriesFD(op string) bool {
	o := operations[op]
	return o != nil && o.FD
}
