package wire

import (
	"bytes"
	"encoding/json"
	"math"
	"strconv"
	"unicode/utf8"

	"github.com/go-json-experiment/json/jsontext"
)

// The hot messages: an open, a close and their replies (and a create's,
// which is an open's with more fields) are most of what crosses the
// socket, and reflection was most of the cost of encoding and decoding
// them (with both ends' JSON about a third of an open's round trip on an
// H200 machine). They are spelled out and read here by hand, in the
// protocol's JSON, byte for byte what encoding/json writes; anything else,
// or anything unusual in them (a string that needs escaping, a float, a
// member out of place, white space), goes the general way, so the wire
// format does not change and every client keeps working. Tests hold each
// to encoding/json (and the decoders to it over fuzzed input).

// appendRequest appends r as json.Marshal writes it, if it is a hot
// request; ok is false for any other, which the caller marshals.
func appendRequest(b []byte, r *Request) (_ []byte, ok bool) {
	const hot = fName | fReadOnly | fSegment | fRole | fTrace
	if setFields(r)&^hot != 0 || r.Device != nil || r.Mode != nil || r.UID != nil || r.GID != nil ||
		r.Meta != nil || !plain(r.Op) || !plain(r.Name) || !plain(r.Role) {
		return b, false
	}
	b = strconv.AppendUint(append(b, `{"id":`...), r.ID, 10)
	b = appendStr(b, "op", r.Op)
	if r.Name != "" {
		b = appendStr(b, "name", r.Name)
	}
	if r.ReadOnly {
		b = append(b, `,"readonly":true`...)
	}
	if r.Segment != 0 {
		b = strconv.AppendUint(append(b, `,"segment":`...), r.Segment, 10)
	}
	if r.Role != "" {
		b = appendStr(b, "role", r.Role)
	}
	if r.Trace {
		b = append(b, `,"trace":true`...)
	}
	return append(b, '}'), true
}

// appendReply appends r as json.Marshal writes it, if it is a hot reply
// (an error, an acknowledgement, or a segment with what comes with it);
// ok is false for any other.
func appendReply(b []byte, r *Reply) (_ []byte, ok bool) {
	if r.Version != 0 || r.Server != "" || r.Epoch || r.Backend != "" || r.Devices != nil || r.Usage != nil ||
		r.Pool != nil || r.Tiers != nil || r.PID != 0 || r.SupervisorPID != 0 || r.Restarts != nil ||
		r.Grace != 0 || r.GPU != nil || r.Users != nil || r.Quotas != nil || r.Segments != nil || r.Next != "" ||
		r.Bytes != 0 || r.CopySeconds != 0 || r.Copiers != 0 || r.Direct != 0 || r.CRC32C != "" || r.Peer != nil ||
		r.Peers != nil {
		return b, false
	}
	start := len(b)
	b = strconv.AppendUint(append(b, `{"id":`...), r.ID, 10)
	if e := r.Error; e != nil {
		if !plain(e.Code) || !plain(e.Message) {
			return b[:start], false
		}
		b = append(append(append(b, `,"error":{"code":"`...), e.Code...), '"')
		b = append(appendStr(b, "message", e.Message), '}')
	}
	if t := r.Trace; t != nil {
		b = strconv.AppendInt(append(b, `,"trace":{"total_ns":`...), t.TotalNS, 10)
		if t.Steps == nil {
			b = append(b, `,"steps":null}`...)
		} else {
			b = append(b, `,"steps":[`...)
			for i, s := range t.Steps {
				if !plain(s.Step) {
					return b[:start], false
				}
				if i > 0 {
					b = append(b, ',')
				}
				b = append(b, `{"step":"`...)
				b = append(b, s.Step...)
				b = strconv.AppendInt(append(b, `","ns":`...), s.NS, 10)
				b = append(b, '}')
			}
			b = append(b, "]}"...)
		}
	}
	if s := r.Segment; s != nil {
		b, ok = appendSegment(append(b, `,"segment":`...), s)
		if !ok {
			return b[:start], false
		}
	}
	if r.Created != nil {
		b = strconv.AppendBool(append(b, `,"created":`...), *r.Created)
	}
	if r.FD {
		b = append(b, `,"fd":true`...)
	}
	if r.Control {
		b = append(b, `,"control":true`...)
	}
	if r.ControlFD {
		b = append(b, `,"control_fd":true`...)
	}
	return append(b, '}'), true
}

func appendSegment(b []byte, s *Segment) (_ []byte, ok bool) {
	if s.TTL != 0 || s.Versions != nil || s.Sources != nil || !plain(s.Name) || !plain(s.UUID) || !plain(s.HandleType) ||
		!plain(s.Lifetime) || !plain(s.Orphan) || !plain(s.Tier) || !plainJSON(s.Meta) {
		return b, false
	}
	b = strconv.AppendUint(append(b, `{"id":`...), s.ID, 10)
	b = appendStr(b, "name", s.Name)
	b = appendInt(b, "size", s.Size)
	b = appendInt(b, "alloc_size", s.AllocSize)
	b = appendInt(b, "device", int64(s.Device))
	if s.UUID != "" {
		b = appendStr(b, "uuid", s.UUID)
	}
	b = appendStr(b, "handle_type", s.HandleType)
	b = appendInt(b, "uid", int64(s.UID))
	b = appendInt(b, "gid", int64(s.GID))
	b = appendInt(b, "mode", int64(s.Mode))
	b = appendInt(b, "opens", int64(s.Opens))
	b = appendInt(b, "created", s.Created)
	if len(s.Meta) > 0 {
		b = append(append(b, `,"meta":`...), s.Meta...)
	}
	if s.Lifetime != "" {
		b = appendStr(b, "lifetime", s.Lifetime)
	}
	if s.Idle != 0 {
		b = appendInt(b, "idle_since", s.Idle)
	}
	if s.Orphan != "" {
		b = appendStr(b, "orphan", s.Orphan)
	}
	if c := s.Channel; c != nil {
		b = strconv.AppendInt(append(b, `,"channel":{"slots":`...), int64(c.Slots), 10)
		b = appendInt(b, "slot_bytes", c.SlotBytes)
		b = appendInt(b, "slot_stride", c.SlotStride)
		b = appendInt(b, "control_bytes", c.ControlBytes)
		b = append(b, '}')
	}
	if s.Uncommitted {
		b = append(b, `,"uncommitted":true`...)
	}
	if s.Tier != "" {
		b = appendStr(b, "tier", s.Tier)
	}
	if s.LastOpen != 0 {
		b = appendInt(b, "last_open", s.LastOpen)
	}
	if s.Pinned {
		b = append(b, `,"pinned":true`...)
	}
	if s.Persist {
		b = append(b, `,"persist":true`...)
	}
	if s.Synced != 0 {
		b = appendInt(b, "synced", s.Synced)
	}
	if s.Stale {
		b = append(b, `,"stale":true`...)
	}
	if s.Offer {
		b = append(b, `,"offer":true`...)
	}
	if s.Version != 0 {
		b = strconv.AppendUint(append(b, `,"version":`...), s.Version, 10)
	}
	if s.RDMA {
		b = append(b, `,"rdma":true`...)
	}
	return append(b, '}'), true
}

func appendStr(b []byte, key, s string) []byte {
	b = append(append(append(b, ',', '"'), key...), `":"`...)
	return append(append(b, s...), '"')
}

func appendInt(b []byte, key string, v int64) []byte {
	b = append(append(append(b, ',', '"'), key...), '"', ':')
	return strconv.AppendInt(b, v, 10)
}

// plain says whether encoding/json writes s as it is between quotes:
// printable ASCII without a quote, a backslash or the characters it
// escapes for HTML.
func plain(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c >= utf8.RuneSelf || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			return false
		}
	}
	return true
}

// plainJSON says whether encoding/json writes raw (valid JSON, which meta
// always is: the daemon checks it when it is set) as it is: no white
// space to compact away (no byte at or below a space at all, so none in a
// string either) and nothing it escapes.
func plainJSON(raw json.RawMessage) bool {
	for _, c := range raw {
		if c <= ' ' || c >= utf8.RuneSelf || c == '<' || c == '>' || c == '&' {
			return false
		}
	}
	return !bytes.Contains(raw, []byte(`\u`)) // json.Marshal rewrites some \u escapes
}

// hotScan reads the hot messages as appendRequest and appendReply write
// them: members in any order, but no white space, strings without
// escapes, integers without fraction or exponent, no null. Any other
// JSON makes it give up (ok false) and the caller decodes the general
// way, which also reports what is wrong with it; what it accepts, it
// reads as the general decoder would.
type hotScan struct {
	b  []byte
	i  int
	ok bool
}

func (s *hotScan) fail() { s.ok = false }

// next consumes c if it comes next.
func (s *hotScan) next(c byte) bool {
	if s.ok && s.i < len(s.b) && s.b[s.i] == c {
		s.i++
		return true
	}
	return false
}

// key reads the name of the object's next member and the colon after
// it, or returns nil at the object's end (or on anything amiss); first
// says whether the object's brace was just read. mark then catches a
// name given twice, which the general decoder refuses.
func (s *hotScan) key(first bool) []byte {
	if s.next('}') {
		return nil
	}
	if !first && !s.next(',') {
		s.fail()
		return nil
	}
	name := s.rawString()
	if !s.next(':') {
		s.fail()
		return nil
	}
	return name
}

// mark records member bit (0: a name it does not know) as seen.
func (s *hotScan) mark(seen *uint64, bit uint64) {
	if bit == 0 || *seen&bit != 0 {
		s.fail()
	}
	*seen |= bit
}

// object reads '{' and reports whether it came.
func (s *hotScan) object() bool {
	if !s.next('{') {
		s.fail()
		return false
	}
	return true
}

// rawString reads a string without escapes, of printable ASCII.
func (s *hotScan) rawString() []byte {
	if !s.next('"') {
		s.fail()
		return nil
	}
	start := s.i
	for ; s.i < len(s.b); s.i++ {
		c := s.b[s.i]
		if c == '"' {
			s.i++
			return s.b[start : s.i-1]
		}
		if c < 0x20 || c >= utf8.RuneSelf || c == '\\' {
			break
		}
	}
	s.fail()
	return nil
}

func (s *hotScan) str() string { return string(s.rawString()) }

// op reads an operation's name, without allocating for a known one.
func (s *hotScan) op() string {
	b := s.rawString()
	switch string(b) {
	case OpOpen:
		return OpOpen
	case OpClose:
		return OpClose
	case OpCreate:
		return OpCreate
	case OpStat:
		return OpStat
	}
	return string(b)
}

// digits reads an unsigned integer of at most 19 digits (no overflow
// of int64), without leading zeros.
func (s *hotScan) digits() uint64 {
	start := s.i
	var v uint64
	for s.i < len(s.b) && s.b[s.i] >= '0' && s.b[s.i] <= '9' {
		v = v*10 + uint64(s.b[s.i]-'0')
		s.i++
	}
	n := s.i - start
	if n == 0 || n > 19 || (n > 1 && s.b[start] == '0') {
		s.fail()
	}
	return v
}

func (s *hotScan) uint64() uint64 { return s.digits() }

func (s *hotScan) int64() int64 {
	neg := s.next('-')
	v := s.digits()
	if v > math.MaxInt64 || (neg && v == 0) {
		s.fail() // out of range, or -0: the general decoder's to judge
	}
	if neg {
		return -int64(v)
	}
	return int64(v)
}

func (s *hotScan) int() int { return int(s.int64()) }

func (s *hotScan) uint32() uint32 {
	v := s.digits()
	if v > 1<<32-1 {
		s.fail()
	}
	return uint32(v)
}

func (s *hotScan) bool() bool {
	rest := s.b[s.i:]
	switch {
	case bytes.HasPrefix(rest, []byte("true")):
		s.i += 4
		return true
	case bytes.HasPrefix(rest, []byte("false")):
		s.i += 5
		return false
	}
	s.fail()
	return false
}

// rawValue reads any JSON value (meta) as the general decoder would: its
// bytes as they are, valid as it requires.
func (s *hotScan) rawValue() json.RawMessage {
	if !s.ok || s.i >= len(s.b) || (s.b[s.i] != '{' && s.b[s.i] != '[') {
		s.fail()
		return nil
	}
	start, depth, inStr := s.i, 0, false
	for ; s.i < len(s.b); s.i++ {
		c := s.b[s.i]
		switch {
		case inStr && c == '\\':
			s.i++
		case c == '"':
			inStr = !inStr
		case inStr:
		case c == '{' || c == '[':
			depth++
		case c == '}' || c == ']':
			depth--
		}
		if depth == 0 {
			s.i++
			v := s.b[start:s.i]
			if !jsontext.Value(v).IsValid() {
				s.fail()
				return nil
			}
			return bytes.Clone(v)
		}
	}
	s.fail()
	return nil
}

// end says whether the scan read all of b and nothing was amiss.
func (s *hotScan) end() bool { return s.ok && s.i == len(s.b) }

// decodeHotRequest reads a hot request, as DecodeRequest would before its
// own checks; ok is false when it is not one.
func decodeHotRequest(b []byte) (r *Request, ok bool) {
	r = &Request{}
	s := hotScan{b: b, ok: true}
	var seen uint64
	s.object()
	for k := s.key(true); k != nil; k = s.key(false) {
		var bit uint64
		switch string(k) {
		case "id":
			r.ID, bit = s.uint64(), 1<<0
		case "op":
			r.Op, bit = s.op(), 1<<1
		case "name":
			r.Name, bit = s.str(), 1<<2
		case "readonly":
			r.ReadOnly, bit = s.bool(), 1<<3
		case "segment":
			r.Segment, bit = s.uint64(), 1<<4
		case "role":
			r.Role, bit = s.str(), 1<<5
		case "trace":
			r.Trace, bit = s.bool(), 1<<6
		}
		s.mark(&seen, bit)
	}
	return r, s.end()
}

// decodeHotReply reads a hot reply, as DecodeReply would; ok is false
// when it is not one.
func decodeHotReply(b []byte) (r *Reply, ok bool) {
	r = &Reply{CtlFD: -1}
	s := hotScan{b: b, ok: true}
	var seen uint64
	s.object()
	for k := s.key(true); k != nil; k = s.key(false) {
		var bit uint64
		switch string(k) {
		case "id":
			r.ID, bit = s.uint64(), 1<<0
		case "error":
			r.Error, bit = s.error(), 1<<1
		case "trace":
			r.Trace, bit = s.trace(), 1<<2
		case "segment":
			r.Segment, bit = s.segment(), 1<<3
		case "created":
			v := s.bool()
			r.Created, bit = &v, 1<<4
		case "fd":
			r.FD, bit = s.bool(), 1<<5
		case "control":
			r.Control, bit = s.bool(), 1<<6
		case "control_fd":
			r.ControlFD, bit = s.bool(), 1<<7
		}
		s.mark(&seen, bit)
	}
	return r, s.end()
}

func (s *hotScan) error() *Error {
	e := &Error{}
	var seen uint64
	s.object()
	for k := s.key(true); k != nil; k = s.key(false) {
		var bit uint64
		switch string(k) {
		case "code":
			e.Code, bit = s.str(), 1<<0
		case "message":
			e.Message, bit = s.str(), 1<<1
		}
		s.mark(&seen, bit)
	}
	return e
}

func (s *hotScan) trace() *Trace {
	t := &Trace{}
	var seen uint64
	s.object()
	for k := s.key(true); k != nil; k = s.key(false) {
		var bit uint64
		switch string(k) {
		case "total_ns":
			t.TotalNS, bit = s.int64(), 1<<0
		case "steps":
			t.Steps, bit = s.steps(), 1<<1
		}
		s.mark(&seen, bit)
	}
	return t
}

func (s *hotScan) steps() []TraceStep {
	if !s.next('[') {
		s.fail()
		return nil
	}
	steps := []TraceStep{}
	if s.next(']') {
		return steps
	}
	for s.ok {
		var st TraceStep
		var seen uint64
		s.object()
		for k := s.key(true); k != nil; k = s.key(false) {
			var bit uint64
			switch string(k) {
			case "step":
				st.Step, bit = s.str(), 1<<0
			case "ns":
				st.NS, bit = s.int64(), 1<<1
			}
			s.mark(&seen, bit)
		}
		steps = append(steps, st)
		if s.next(']') {
			break
		}
		if !s.next(',') {
			s.fail()
		}
	}
	return steps
}

func (s *hotScan) channel() *Channel {
	c := &Channel{}
	var seen uint64
	s.object()
	for k := s.key(true); k != nil; k = s.key(false) {
		var bit uint64
		switch string(k) {
		case "slots":
			c.Slots, bit = s.int(), 1<<0
		case "slot_bytes":
			c.SlotBytes, bit = s.int64(), 1<<1
		case "slot_stride":
			c.SlotStride, bit = s.int64(), 1<<2
		case "control_bytes":
			c.ControlBytes, bit = s.int64(), 1<<3
		}
		s.mark(&seen, bit)
	}
	return c
}

func (s *hotScan) segment() *Segment {
	g := &Segment{}
	var seen uint64
	s.object()
	for k := s.key(true); k != nil; k = s.key(false) {
		var bit uint64
		switch string(k) {
		case "id":
			g.ID, bit = s.uint64(), 1<<0
		case "name":
			g.Name, bit = s.str(), 1<<1
		case "size":
			g.Size, bit = s.int64(), 1<<2
		case "alloc_size":
			g.AllocSize, bit = s.int64(), 1<<3
		case "device":
			g.Device, bit = s.int(), 1<<4
		case "uuid":
			g.UUID, bit = s.str(), 1<<5
		case "handle_type":
			g.HandleType, bit = s.handleType(), 1<<6
		case "uid":
			g.UID, bit = s.uint32(), 1<<7
		case "gid":
			g.GID, bit = s.uint32(), 1<<8
		case "mode":
			g.Mode, bit = s.uint32(), 1<<9
		case "opens":
			g.Opens, bit = s.int(), 1<<10
		case "created":
			g.Created, bit = s.int64(), 1<<11
		case "meta":
			g.Meta, bit = s.rawValue(), 1<<12
		case "lifetime":
			g.Lifetime, bit = s.str(), 1<<13
		case "idle_since":
			g.Idle, bit = s.int64(), 1<<14
		case "orphan":
			g.Orphan, bit = s.str(), 1<<15
		case "channel":
			g.Channel, bit = s.channel(), 1<<16
		case "uncommitted":
			g.Uncommitted, bit = s.bool(), 1<<17
		case "tier":
			g.Tier, bit = s.tier(), 1<<18
		case "last_open":
			g.LastOpen, bit = s.int64(), 1<<19
		case "pinned":
			g.Pinned, bit = s.bool(), 1<<20
		case "version":
			g.Version, bit = s.uint64(), 1<<21
		case "rdma":
			g.RDMA, bit = s.bool(), 1<<22
		case "persist":
			g.Persist, bit = s.bool(), 1<<23
		case "synced":
			g.Synced, bit = s.int64(), 1<<24
		case "stale":
			g.Stale, bit = s.bool(), 1<<25
		case "offer":
			g.Offer, bit = s.bool(), 1<<26
		}
		s.mark(&seen, bit)
	}
	return g
}

// handleType and tier read the few values these take without allocating.
func (s *hotScan) handleType() string {
	b := s.rawString()
	switch string(b) {
	case HandleCUDA:
		return HandleCUDA
	case HandleMemfd:
		return HandleMemfd
	}
	return string(b)
}

func (s *hotScan) tier() string {
	b := s.rawString()
	switch string(b) {
	case "gpu":
		return "gpu"
	case "host":
		return "host"
	}
	return string(b)
}
