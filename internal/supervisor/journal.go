package supervisor

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"strconv"
)

// The journal is the supervisor's state written down, so that a process
// that is not the supervisor (systemd's fd store, or the supervisor's own
// successor after exec) can hand it back. It is an append-only sequence of
// frames after an 8-byte magic:
//
//	uint32 length (little-endian) | uint32 CRC-32C of the payload | payload
//
// where the payload is one JSON object: {"op":"put","id":N,"rec":{...}},
// {"op":"del","id":N}, {"op":"next","id":N} (the highest id given out), or
// {"op":"batch","ops":[...]}, puts and dels that are one change (a rename
// over an existing name): a frame is written whole or is torn, so a batch
// is replayed whole or not at all.
// A torn write leaves a short or mismatched last frame; reading stops at
// the first frame that does not check out and says where.
const journalMagic = "GPUSHMJ1"

// maxFrame bounds one frame's payload: a control message (a record, or a
// batch of them) plus its framing.
const maxFrame = maxControl + 64<<10

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

type journalOp struct {
	Op  string          `json:"op"`
	ID  uint64          `json:"id,omitempty"`
	Rec json.RawMessage `json:"rec,omitempty"`
	Ops []journalOp     `json:"ops,omitempty"` // a batch's puts and dels
}

// appendFrame appends one frame for op to b.
func appendFrame(b []byte, op journalOp) []byte {
	payload, err := json.Marshal(op)
	if err != nil {
		panic(err) // a journalOp always marshals
	}
	b = binary.LittleEndian.AppendUint32(b, uint32(len(payload)))
	b = binary.LittleEndian.AppendUint32(b, crc32.Checksum(payload, castagnoli))
	return append(b, payload...)
}

// encodeJournal writes the whole state as a fresh journal.
func encodeJournal(st *State) []byte {
	b := []byte(journalMagic)
	b = appendFrame(b, journalOp{Op: "next", ID: st.nextID})
	for _, id := range st.ids() {
		if e := st.entries[id]; e.rec != nil {
			b = appendFrame(b, journalOp{Op: "put", ID: id, Rec: e.rec})
		}
	}
	return b
}

// JournalError says where a journal stopped making sense; the records
// before it were read.
type JournalError struct {
	Offset int64
	Reason string
}

func (e *JournalError) Error() string {
	return fmt.Sprintf("journal unreadable at byte %d: %s", e.Offset, e.Reason)
}

// decodeJournal reads a journal into records by id and the highest id
// given out. On a bad frame it returns what it read before it, with a
// *JournalError.
func decodeJournal(b []byte) (recs map[uint64]json.RawMessage, nextID uint64, err error) {
	recs = map[uint64]json.RawMessage{}
	if len(b) < len(journalMagic) || string(b[:len(journalMagic)]) != journalMagic {
		return recs, 0, &JournalError{0, "not a gpushm journal (bad magic)"}
	}
	off := len(journalMagic)
	for off < len(b) {
		if len(b)-off < 8 {
			return recs, nextID, &JournalError{int64(off), "truncated frame header"}
		}
		n := int(binary.LittleEndian.Uint32(b[off:]))
		sum := binary.LittleEndian.Uint32(b[off+4:])
		if n > maxFrame {
			return recs, nextID, &JournalError{int64(off), fmt.Sprintf("frame of %d bytes, limit %d", n, maxFrame)}
		}
		if len(b)-off-8 < n {
			return recs, nextID, &JournalError{int64(off), fmt.Sprintf("truncated frame: %d bytes of %d", len(b)-off-8, n)}
		}
		payload := b[off+8 : off+8+n]
		if crc32.Checksum(payload, castagnoli) != sum {
			return recs, nextID, &JournalError{int64(off), "checksum mismatch"}
		}
		var op journalOp
		if err := json.Unmarshal(payload, &op); err != nil {
			return recs, nextID, &JournalError{int64(off), "bad frame: " + err.Error()}
		}
		ops := []journalOp{op}
		switch op.Op {
		case "batch":
			if len(op.Ops) == 0 {
				return recs, nextID, &JournalError{int64(off), "empty batch"}
			}
			ops = op.Ops
		case "next":
			nextID = max(nextID, op.ID)
			ops = nil
		}
		// Every part is checked before any is applied: a batch counts
		// whole or not at all.
		for _, p := range ops {
			if why := checkOp(p); why != "" {
				return recs, nextID, &JournalError{int64(off), why}
			}
		}
		for _, p := range ops {
			if p.Op == "put" {
				recs[p.ID] = p.Rec
				nextID = max(nextID, p.ID)
			} else {
				delete(recs, p.ID)
			}
		}
		off += 8 + n
	}
	return recs, nextID, nil
}

// checkOp says what is wrong with a put or del (of a batch or alone).
func checkOp(op journalOp) string {
	switch op.Op {
	case "put":
		if !isObject(op.Rec) {
			return "put without a record"
		}
	case "del":
	default:
		return "unknown op " + strconv.Quote(op.Op)
	}
	if op.ID == 0 {
		return op.Op + " without a segment id"
	}
	if len(op.Ops) > 0 {
		return op.Op + " with parts"
	}
	return ""
}

func isObject(b json.RawMessage) bool {
	var m map[string]json.RawMessage
	return len(b) > 0 && json.Unmarshal(b, &m) == nil
}

// readAll reads a journal file from its start.
func readAll(r io.ReaderAt, size int64) ([]byte, error) {
	if size > 1<<30 {
		return nil, errors.New("journal over 1 GiB")
	}
	b := make([]byte, size)
	n, err := r.ReadAt(b, 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	return b[:n], nil
}
