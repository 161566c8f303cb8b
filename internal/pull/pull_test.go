package pull

import (
	"context"
	"strings"
	"testing"
)

// TestGrantChecked: a grant that does not describe the segment (another
// size, chunks that do not add up, no address or key) is refused before
// any helper starts: a peer that lies about the size is caught here, one
// that lies about the bytes by the chunks' checksums (TestPull in
// integration/).
func TestGrantChecked(t *testing.T) {
	good := Grant{Worker: []byte{1}, RKey: []byte{2}, Size: 3*Chunk + 1, Chunk: Chunk, CRCs: make([]uint32, 4)}
	if err := good.check(good.Size); err != nil {
		t.Fatalf("a good grant: %v", err)
	}
	for _, tc := range []struct {
		name string
		edit func(*Grant)
		size int64
		want string
	}{
		{"another size", func(*Grant) {}, 3 * Chunk, "offers"},
		{"too few checksums", func(g *Grant) { g.CRCs = g.CRCs[:3] }, 3*Chunk + 1, "checksums"},
		{"no chunk", func(g *Grant) { g.Chunk = 0 }, 3*Chunk + 1, "chunk"},
		{"a huge chunk", func(g *Grant) { g.Chunk = 1 << 40 }, 3*Chunk + 1, "chunk"},
		{"no worker", func(g *Grant) { g.Worker = nil }, 3*Chunk + 1, "worker"},
		{"no key", func(g *Grant) { g.RKey = nil }, 3*Chunk + 1, "key"},
	} {
		g := good
		g.CRCs = append([]uint32(nil), good.CRCs...)
		tc.edit(&g)
		err := Fetch(context.Background(), -1, tc.size, g)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Fetch = %v, want an error mentioning %q", tc.name, err, tc.want)
		}
	}
	if _, err := Lend(-1, 0); err == nil {
		t.Error("Lend of nothing succeeded")
	}
}
