package peer

import (
	"net"
	"sync"
	"sync/atomic"
	"testing"
)

// proxy stands between a dialer and a listener, frame by frame, and plays
// the man in the middle: edit may change, drop, repeat or send back each
// frame; while frozen, frames vanish and nothing is closed, as in a
// partition.
type proxy struct {
	ln     net.Listener
	target string
	// edit gets the frame's connection (0 for the first), direction (up:
	// from the dialer) and index in that direction, and returns the frames
	// to pass on and those to send back. Nil passes every frame.
	edit   func(conn int, up bool, i int, body []byte) (fwd, back [][]byte)
	frozen atomic.Bool
	wg     sync.WaitGroup
}

func newProxy(t *testing.T, target string) *proxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &proxy{ln: ln, target: target}
	p.wg.Add(1)
	go p.accept()
	t.Cleanup(func() {
		ln.Close()
		p.wg.Wait()
	})
	return p
}

func (p *proxy) addr() string { return p.ln.Addr().String() }

func (p *proxy) accept() {
	defer p.wg.Done()
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for n := 0; ; n++ {
		down, err := p.ln.Accept()
		if err != nil {
			return
		}
		up, err := net.Dial("tcp", p.target)
		if err != nil {
			down.Close()
			continue
		}
		conns = append(conns, down, up)
		var dmu, umu sync.Mutex
		p.wg.Add(2)
		go p.pump(n, true, down, up, &umu, &dmu)
		go p.pump(n, false, up, down, &dmu, &umu)
	}
}

// pump carries frames from src to dst (writes under dmu), and those edit
// sends back to src (under smu).
func (p *proxy) pump(n int, up bool, src, dst net.Conn, dmu, smu *sync.Mutex) {
	defer p.wg.Done()
	defer dst.Close()
	defer src.Close()
	for i := 0; ; i++ {
		body, err := readFrame(src, 1<<24)
		if err != nil {
			return
		}
		if p.frozen.Load() {
			continue
		}
		fwd, back := [][]byte{body}, [][]byte(nil)
		if p.edit != nil {
			fwd, back = p.edit(n, up, i, body)
		}
		if !write(dst, dmu, fwd) || !write(src, smu, back) {
			return
		}
	}
}

func write(c net.Conn, mu *sync.Mutex, frames [][]byte) bool {
	mu.Lock()
	defer mu.Unlock()
	for _, f := range frames {
		if _, err := c.Write(appendFrame(nil, f)); err != nil {
			return false
		}
	}
	return true
}
