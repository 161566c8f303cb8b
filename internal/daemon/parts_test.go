package daemon

import (
	"strings"
	"testing"

	"github.com/gpushm/gpushm/internal/backend"
	"github.com/gpushm/gpushm/internal/segment"
)

// TestJoinParts: a restart joins the parts of evicted memory that its
// segment's record lists, and nothing else: a part missing, or one that
// names another segment, makes the segment an orphan; a part that no
// record lists stays for the registry to free.
func TestJoinParts(t *testing.T) {
	host, err := backend.NewHost()
	if err != nil {
		t.Fatal(err)
	}
	spill := backend.NewSpill(host, 0)
	mem := func(n int64) segment.Memory {
		m, err := spill.Allocate(0, n)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Free() })
		return m
	}
	const a, b = 8 << 10, 4 << 10
	parent := func(parts ...segment.Part) segment.Restored {
		var total int64
		for _, p := range parts {
			total += p.Size
		}
		return segment.Restored{Record: segment.Record{ID: 1, Name: "w", Linked: true, Alloc: total, Tier: "host", Parts: parts},
			Memory: mem(parts[0].Size)}
	}
	part := func(id, of uint64, n int64) segment.Restored {
		return segment.Restored{Record: segment.Record{ID: id, PartOf: of, Alloc: n, Tier: "host"}, Memory: mem(n)}
	}
	three := []segment.Part{{ID: 1, Size: a}, {ID: 5, Size: b}, {ID: 6, Size: a}}

	out := joinParts([]segment.Restored{part(9, 1, b), part(6, 1, a), parent(three...), part(5, 1, b)})
	if len(out) != 2 || out[0].Record.ID != 9 || out[1].Record.ID != 1 || out[1].Problem != "" || out[1].Memory.Size() != 2*a+b {
		t.Fatalf("joined: %+v", out)
	}
	if _, ok := out[1].Memory.(segment.Parted); !ok {
		t.Fatalf("joined memory %T is not in parts", out[1].Memory)
	}

	for _, tc := range []struct {
		name  string
		items []segment.Restored
		want  string
	}{
		{"missing", []segment.Restored{parent(three...), part(5, 1, b)}, "part 2 of its host memory (record 6) is missing"},
		{"another's", []segment.Restored{parent(three...), part(5, 1, b), part(6, 2, a)}, "record 6) is not usable"},
		{"another size", []segment.Restored{parent(three...), part(5, 1, b), part(6, 1, b)}, "record 6) is not usable"},
		{"listed twice", []segment.Restored{parent(segment.Part{ID: 1, Size: a}, segment.Part{ID: 5, Size: b}, segment.Part{ID: 5, Size: b}), part(5, 1, b)}, "record 5) is missing"},
		{"not its own first", []segment.Restored{parent(segment.Part{ID: 4, Size: a}, segment.Part{ID: 5, Size: b}), part(5, 1, b)}, "lists the parts of its host memory wrongly"},
	} {
		out := joinParts(tc.items)
		var p *segment.Restored
		for i := range out {
			if out[i].Record.ID == 1 {
				p = &out[i]
			}
		}
		if p == nil || !strings.Contains(p.Problem, tc.want) || len(out) != len(tc.items) {
			t.Errorf("%s: %+v, want the segment an orphan (%q) and every part left", tc.name, out, tc.want)
		}
	}
}
