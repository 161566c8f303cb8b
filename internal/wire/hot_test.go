package wire

import (
	"bytes"
	"encoding/json"
	"math"
	"math/rand/v2"
	"reflect"
	"testing"
	"testing/quick"

	jsonv2 "github.com/go-json-experiment/json"
)

var hotStrings = []string{"", "w", "weights-shard-07", "llama-3-8b/layer.0", "cuda_fd", "gpu", "tx",
	"quote \" and \\ back", "tab\tnew\nline", "<html> & co", "caf\u00e9 \u2028", "bad \xff utf-8", "\x00", "del\x7f"}

var hotMetas = []json.RawMessage{nil, json.RawMessage(`{"dtype":"float16","shape":[4096,4096]}`),
	json.RawMessage(`{"a": 1}`), json.RawMessage(`["<"]`), json.RawMessage(`{"s":"\u00e9"}`), json.RawMessage(`[1,2,{"k":[]}]`)}

func pick[T any](r *rand.Rand, xs []T) T { return xs[r.IntN(len(xs))] }

func randInt(r *rand.Rand) int64 {
	switch r.IntN(4) {
	case 0:
		return 0
	case 1:
		return r.Int64N(1 << 40)
	case 2:
		return -r.Int64N(1 << 20)
	}
	return pick(r, []int64{math.MaxInt64, math.MinInt64, 1, -1})
}

func randomHotSegment(r *rand.Rand) *Segment {
	s := &Segment{ID: r.Uint64(), Name: pick(r, hotStrings), Size: randInt(r), AllocSize: randInt(r),
		Device: int(randInt(r)), UUID: pick(r, hotStrings), HandleType: pick(r, hotStrings), UID: r.Uint32(),
		GID: r.Uint32(), Mode: r.Uint32(), Opens: int(randInt(r)), Created: randInt(r), Meta: pick(r, hotMetas),
		Lifetime: pick(r, hotStrings), Idle: randInt(r), Orphan: pick(r, hotStrings), Uncommitted: r.IntN(2) == 0,
		Tier: pick(r, hotStrings), LastOpen: randInt(r), Pinned: r.IntN(2) == 0, Version: r.Uint64N(5), RDMA: r.IntN(2) == 0}
	if r.IntN(3) == 0 {
		s.Channel = &Channel{Slots: int(randInt(r)), SlotBytes: randInt(r), SlotStride: randInt(r), ControlBytes: randInt(r)}
	}
	if r.IntN(20) == 0 {
		s.TTL = 1.5
	}
	if r.IntN(20) == 0 {
		s.Versions = []HeldVersion{{ID: 1, Version: 2, Opens: 3}}
	}
	return s
}

func randomHotReply(r *rand.Rand) *Reply {
	rep := &Reply{ID: r.Uint64(), FD: r.IntN(2) == 0, Control: r.IntN(4) == 0, ControlFD: r.IntN(4) == 0}
	if r.IntN(4) == 0 {
		rep.Error = &Error{Code: pick(r, hotStrings), Message: pick(r, hotStrings)}
	}
	if r.IntN(2) == 0 {
		rep.Segment = randomHotSegment(r)
	}
	if r.IntN(3) == 0 {
		v := r.IntN(2) == 0
		rep.Created = &v
	}
	if r.IntN(3) == 0 {
		rep.Trace = &Trace{TotalNS: randInt(r)}
		if r.IntN(4) > 0 {
			rep.Trace.Steps = []TraceStep{}
			for range r.IntN(4) {
				rep.Trace.Steps = append(rep.Trace.Steps, TraceStep{Step: pick(r, hotStrings), NS: randInt(r)})
			}
		}
	}
	if r.IntN(10) == 0 {
		rep.Backend = "host" // not a hot reply
	}
	return rep
}

func randomHotRequest(r *rand.Rand) *Request {
	req := &Request{ID: r.Uint64(), Op: pick(r, []string{OpOpen, OpClose, OpCreate, "x\"y"}), Name: pick(r, hotStrings),
		ReadOnly: r.IntN(2) == 0, Role: pick(r, hotStrings), Trace: r.IntN(2) == 0}
	if r.IntN(2) == 0 {
		req.Segment = r.Uint64()
	}
	switch r.IntN(8) {
	case 0:
		req.Size = 4096
	case 1:
		d := 0
		req.Device = &d // set, though zero: written all the same
	case 2:
		req.Wait = 0.25
	case 3:
		req.Open = true
	}
	return req
}

// TestHotEncode holds the hand-written encoders to json.Marshal: every
// message they take comes out byte for byte as it would, and every other
// goes to json.Marshal.
func TestHotEncode(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	hot := 0
	check := func(v any, fast func() ([]byte, bool)) {
		t.Helper()
		want, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		if got, ok := fast(); ok {
			hot++
			if !bytes.Equal(got, want) {
				t.Fatalf("hand-written:\n got %s\nwant %s", got, want)
			}
		}
		if got, err := Encode(v); err != nil || !bytes.Equal(got, want) {
			t.Fatalf("Encode:\n got %s, %v\nwant %s", got, err, want)
		}
	}
	for range 20000 {
		req := randomHotRequest(r)
		check(req, func() ([]byte, bool) { return appendRequest(nil, req) })
		rep := randomHotReply(r)
		check(rep, func() ([]byte, bool) { return appendReply(nil, rep) })
	}
	t.Logf("%d of 40000 the hand-written way", hot)
	if hot < 2000 {
		t.Fatalf("only %d of 40000 messages took the hand-written way", hot)
	}
}

// TestHotEncodeAnyField sets the fields of requests and replies at random,
// all of them: a field the hand-written encoders do not know of (one added
// later, say) must send the message to json.Marshal, not be left out.
func TestHotEncodeAnyField(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for i := range 5000 {
		for _, typ := range []reflect.Type{reflect.TypeFor[Request](), reflect.TypeFor[Reply]()} {
			v, ok := quick.Value(typ, r2(r))
			if !ok {
				t.Fatalf("cannot make a %s", typ)
			}
			// Keep one field in a few, so that some messages are hot.
			for f := range typ.NumField() {
				if r.IntN(6) > 0 {
					v.Field(f).SetZero()
				}
			}
			p := v.Addr().Interface()
			want, err := json.Marshal(p)
			if err != nil {
				continue // quick's meta is not JSON
			}
			if got, err := Encode(p); err != nil || !bytes.Equal(got, want) {
				t.Fatalf("message %d: Encode\n got %s, %v\nwant %s", i, got, err, want)
			}
		}
	}
}

// r2 is a math/rand source for testing/quick, drawn from r.
func r2(r *rand.Rand) *oldRand { return newOldRand(r.Int64()) }

// TestHotDecode decodes encoded messages, hot or not, and messages that
// are nearly hot, and checks that the hand-written decoders read what the
// general decoder reads, or give up.
func TestHotDecode(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	hot := 0
	for range 20000 {
		b, _ := json.Marshal(randomHotReply(r))
		if _, ok := decodeHotReply(b); ok {
			hot++
		}
		checkHotReply(t, b)
		checkHotReply(t, mutate(r, b))
		b, _ = json.Marshal(randomHotRequest(r))
		if _, ok := decodeHotRequest(b); ok {
			hot++
		}
		checkHotRequest(t, b)
		checkHotRequest(t, mutate(r, b))
	}
	t.Logf("%d of 40000 the hand-written way", hot)
	if hot < 2000 {
		t.Fatalf("only %d of 40000 messages were read the hand-written way", hot)
	}
}

// mutate changes, deletes or inserts a byte, or swaps two members.
func mutate(r *rand.Rand, b []byte) []byte {
	b = bytes.Clone(b)
	i := r.IntN(len(b))
	switch r.IntN(3) {
	case 0:
		b[i] = pick(r, []byte(`{}[]":,-0123456789eE.+ \tnulltruefalsex`))
		return b
	case 1:
		return append(b[:i], b[i+1:]...)
	}
	return append(b[:i], append([]byte{pick(r, []byte(`{}":,-09 `))}, b[i:]...)...)
}

func checkHotRequest(t *testing.T, b []byte) {
	t.Helper()
	got, ok := decodeHotRequest(b)
	if !ok {
		return
	}
	var want Request
	if err := jsonv2.Unmarshal(b, &want, jsonv2.RejectUnknownMembers(true)); err != nil {
		t.Fatalf("%s: read the hand-written way as %+v; the general decoder refuses it: %v", b, got, err)
	}
	if !reflect.DeepEqual(got, &want) {
		t.Fatalf("%s:\n hand-written %+v\n     general %+v", b, got, &want)
	}
}

func checkHotReply(t *testing.T, b []byte) {
	t.Helper()
	got, ok := decodeHotReply(b)
	if !ok {
		return
	}
	want := Reply{CtlFD: -1}
	if err := jsonv2.Unmarshal(b, &want); err != nil {
		t.Fatalf("%s: read the hand-written way as %+v; the general decoder refuses it: %v", b, got, err)
	}
	if !reflect.DeepEqual(got, &want) {
		gj, _ := json.Marshal(got)
		wj, _ := json.Marshal(&want)
		t.Fatalf("%s:\n hand-written %s\n     general %s", b, gj, wj)
	}
}

func FuzzHotDecode(f *testing.F) {
	r := rand.New(rand.NewPCG(9, 10))
	for range 20 {
		b, _ := json.Marshal(randomHotReply(r))
		f.Add(b)
		b, _ = json.Marshal(randomHotRequest(r))
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		checkHotReply(t, b)
		checkHotRequest(t, b)
	})
}

func BenchmarkHot(b *testing.B) {
	seg := &Segment{ID: 123456, Name: "weights-shard-07", Size: 2 << 20, AllocSize: 2 << 20, UUID: "GPU-12345678-1234-1234-1234-123456789abc",
		HandleType: HandleCUDA, UID: 1000, GID: 1000, Mode: 0o644, Opens: 3, Created: 1764140000123456789, Tier: "gpu",
		LastOpen: 1764140000123456789, Version: 1, RDMA: true}
	req := &Request{ID: 12345, Op: OpOpen, Name: "weights-shard-07", ReadOnly: true}
	rep := &Reply{ID: 12345, Segment: seg, FD: true}
	reqB, _ := json.Marshal(req)
	repB, _ := json.Marshal(rep)
	for _, c := range []struct {
		name string
		fn   func() error
	}{
		{"EncodeOpen", func() error { _, err := Encode(req); return err }},
		{"DecodeOpen", func() error { _, err := DecodeRequest(reqB); return err }},
		{"EncodeOpenReply", func() error { _, err := Encode(rep); return err }},
		{"DecodeOpenReply", func() error { _, err := DecodeReply(repB); return err }},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if err := c.fn(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
