package server_test

import (
	"slices"
	"testing"
	"time"

	"github.com/gpushm/gpushm/internal/backend"
	"github.com/gpushm/gpushm/internal/server"
	"github.com/gpushm/gpushm/internal/testdaemon"
	"github.com/gpushm/gpushm/internal/testutil"
	"github.com/gpushm/gpushm/internal/wire"
)

// steps lists a trace's step names, and checks that the steps fit in its
// total.
func steps(t *testing.T, rep *wire.Reply) []string {
	t.Helper()
	if rep.Error != nil {
		t.Fatalf("reply %+v", rep.Error)
	}
	if rep.Trace == nil {
		t.Fatal("no trace in the reply of a request that asked for one")
	}
	var names []string
	var sum int64
	for _, st := range rep.Trace.Steps {
		if st.NS < 0 {
			t.Errorf("step %q took %d ns", st.Step, st.NS)
		}
		names = append(names, st.Step)
		sum += st.NS
	}
	if sum > rep.Trace.TotalNS || rep.Trace.TotalNS <= 0 {
		t.Errorf("steps add up to %d ns, the whole request %d ns", sum, rep.Trace.TotalNS)
	}
	return names
}

// TestTrace: a create or open that asks for a trace gets the daemon's
// steps in order, and says whether the memory came from the pool; a
// request that does not ask gets none.
func TestTrace(t *testing.T) {
	d := testdaemon.StartWith(t, "host", func(_ *server.Server, b backend.Backend) { b.Pool(64 << 20) })
	r := testutil.DialRaw(t, d.Socket)
	r.Hello()
	if rep := r.Call(`{"id":2,"op":"create","name":"a","size":8192}`, -1); rep.Error != nil || rep.Trace != nil {
		t.Fatalf("create without trace = %+v, trace %+v", rep.Error, rep.Trace)
	}
	if rep := r.Call(`{"id":2,"op":"create","name":"a2","size":8192}`, -1); rep.Error != nil {
		t.Fatal(rep.Error)
	}
	// The first creates of the size allocated; the pool makes the next.
	for deadline := time.Now().Add(30 * time.Second); ; {
		inf := r.Call(`{"id":3,"op":"info"}`, -1)
		if inf.Pool != nil && inf.Pool.Ready > 0 && inf.Pool.Filling == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the pool never made an allocation of 8192 bytes: %+v", inf.Pool)
		}
		time.Sleep(time.Millisecond)
	}
	got := steps(t, r.Call(`{"id":4,"op":"create","name":"b","size":8192,"open":true,"trace":true}`, -1))
	if want := []string{"decode", "options", "check", "alloc-pool", "export", "journal", "handout"}; !slices.Equal(got, want) {
		t.Errorf("create steps %v, want %v", got, want)
	}
	got = steps(t, r.Call(`{"id":5,"op":"create","name":"c","size":12288,"trace":true}`, -1))
	if want := []string{"decode", "options", "check", "alloc", "export", "journal"}; !slices.Equal(got, want) {
		t.Errorf("create steps of a size not pooled yet %v, want %v", got, want)
	}
	got = steps(t, r.Call(`{"id":6,"op":"open","name":"a","trace":true}`, -1))
	if want := []string{"decode", "lookup", "handout"}; !slices.Equal(got, want) {
		t.Errorf("open steps %v, want %v", got, want)
	}
	// A failed request is traced as far as it went.
	rep := r.Call(`{"id":7,"op":"open","name":"nope","trace":true}`, -1)
	if code(rep) != "ENOENT" || rep.Trace == nil || len(rep.Trace.Steps) == 0 || rep.Trace.Steps[0].Step != "decode" {
		t.Errorf("failed open = %+v, trace %+v", rep.Error, rep.Trace)
	}
	if rep := r.Call(`{"id":8,"op":"open","name":"a","trace":1}`, -1); code(rep) != "EPROTO" {
		t.Errorf("trace of 1 = %+v, want EPROTO", rep.Error)
	}
}
