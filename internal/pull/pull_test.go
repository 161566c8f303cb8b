package pull

import (
	"context"
	"strings"
	"testing"
)

// TestGrantChecked: a grant that does not describe the segment (another
// size, a chunk other than this node's, a ring out of bounds, no address
// or key) is refused before
// any helper starts: a peer that lies about the size is caught here, one
// that lies about the bytes by the chunks' checksums (TestPull in
// integration/).
func TestGrantChecked(t *testing.T) {
	good := Grant{Worker: []byte{1}, RKey: []byte{2}, BoardKey: []byte{3}, Size: 3*Chunk + 1, Chunk: Chunk}
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
		{"a ring too large", func(g *Grant) { g.Ring = 1000 }, 3*Chunk + 1, "ring"},
		{"a negative ring", func(g *Grant) { g.Ring = -1 }, 3*Chunk + 1, "ring"},
		{"no chunk", func(g *Grant) { g.Chunk = 0 }, 3*Chunk + 1, "chunk"},
		{"a huge chunk", func(g *Grant) { g.Chunk = 1 << 40 }, 3*Chunk + 1, "chunk"},
		// Chunks of another size would be checked, then put at the
		// offsets of this node's chunks: the segment committed would not
		// be the lender's bytes, though every chunk passed.
		{"a larger chunk", func(g *Grant) { g.Chunk = 2 * Chunk }, 3*Chunk + 1, "chunk"},
		{"a smaller chunk", func(g *Grant) { g.Chunk = Chunk / 2 }, 3*Chunk + 1, "chunk"},
		{"no worker", func(g *Grant) { g.Worker = nil }, 3*Chunk + 1, "worker"},
		{"no key", func(g *Grant) { g.RKey = nil }, 3*Chunk + 1, "key"},
		{"no board key", func(g *Grant) { g.BoardKey = nil }, 3*Chunk + 1, "key"},
	} {
		g := good
		tc.edit(&g)
		err := Fetch(context.Background(), -1, tc.size, g, FetchOptions{Board: -1})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Fetch = %v, want an error mentioning %q", tc.name, err, tc.want)
		}
	}
	if _, err := Lend(-1, 0, Host, -1); err == nil {
		t.Error("Lend of nothing succeeded")
	}
}
