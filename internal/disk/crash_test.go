package disk

import (
	"bufio"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// helperEnv, set, makes the test binary the writer TestKillDuringWrite
// kills: "dir,dir;seed;size".
const helperEnv = "GPUSHM_DISK_TEST_WRITER"

// TestWriterHelper is not a test: run by TestKillDuringWrite in a process
// of its own, it writes the key "victim" and says, on standard output,
// "chunk" as each chunk is taken from the source and "done" once the
// write has returned.
func TestWriterHelper(t *testing.T) {
	arg := os.Getenv(helperEnv)
	if arg == "" {
		t.Skip("run by TestKillDuringWrite")
	}
	f := strings.Split(arg, ";")
	seed, _ := strconv.ParseUint(f[1], 10, 64)
	size, _ := strconv.ParseInt(f[2], 10, 64)
	s, err := Open(strings.Split(f[0], ","), Options{Chunk: testChunk, Log: quiet})
	if err != nil {
		fmt.Println("open:", err)
		os.Exit(1)
	}
	b := pattern(size, seed)
	src := sourceFunc(func(p []byte, off int64) error {
		fmt.Println("chunk")
		return b.ReadAt(p, off)
	})
	if _, err := s.Write(context.Background(), "victim", size, []byte(f[1]), src); err != nil {
		fmt.Println("write:", err)
		os.Exit(1)
	}
	fmt.Println("done")
	time.Sleep(time.Minute) // killed here too
}

// TestKillDuringWrite kills a process writing a copy over an older one at
// varied points, from before its first chunk to after its commit: the key
// must then read back as exactly the old bytes or the new, and Open must
// leave no file of the interrupted write.
func TestKillDuringWrite(t *testing.T) {
	dirs := tempDirs(t, "/var/tmp", 2)
	const size = 12*testChunk + 4567
	s := open(t, dirs, Options{Chunk: testChunk})
	seed := uint64(1000)
	current := write(t, s, "victim", pattern(size, seed), strconv.FormatUint(seed, 10))
	s.Close()
	r := rand.New(rand.NewPCG(1, 2))
	outcomes := map[string]int{}
	for round := range 20 {
		next := seed + 1
		chunks := round % 15 // 13 and 14: after the last chunk, in the commit
		jitter := time.Duration(r.IntN(3000)) * time.Microsecond
		if chunks == 13 {
			jitter *= 10 // the last writes, the syncs, the commit
		}
		killWriter(t, dirs, next, size, chunks, jitter)
		s := open(t, dirs, Options{Chunk: testChunk})
		e, err := s.Stat("victim")
		if err != nil {
			t.Fatalf("round %d: Stat after the kill = %v", round, err)
		}
		switch string(e.Meta) {
		case strconv.FormatUint(seed, 10):
			outcomes["old"]++
			readBack(t, s, "victim", pattern(size, seed))
		case strconv.FormatUint(next, 10):
			outcomes["new"]++
			readBack(t, s, "victim", pattern(size, next))
			seed = next
		default:
			t.Fatalf("round %d: the copy's meta is %q, want %d or %d", round, e.Meta, seed, next)
		}
		for _, d := range dirs {
			assertOnly(t, d, e)
		}
		current = e
		s.Close()
	}
	t.Logf("20 kills: %v (last generation %d)", outcomes, current.Gen)
}

// killWriter starts the writer, waits for its chunks-th chunk (or its
// "done" for more than it has), sleeps for jitter and kills it.
func killWriter(t *testing.T, dirs []string, seed uint64, size int64, chunks int, jitter time.Duration) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestWriterHelper$", "-test.count=1")
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s;%d;%d", helperEnv, strings.Join(dirs, ","), seed, size))
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	lines := bufio.NewScanner(out)
	for seen := 0; seen < chunks && lines.Scan(); {
		switch l := lines.Text(); {
		case l == "chunk":
			seen++
		case l == "done":
			seen = chunks
		case strings.HasPrefix(l, "open:"), strings.HasPrefix(l, "write:"):
			t.Fatalf("writer: %s", l)
		}
	}
	time.Sleep(jitter)
	cmd.Process.Signal(syscall.SIGKILL)
	go func() {
		for lines.Scan() {
		}
	}()
	cmd.Wait()
}
