package bench

import (
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// TestFitCounts: under a hard descriptor limit of 1,000 (set for a child
// process, as a machine's would be), a crowd of 20,000 becomes what the
// limit holds, and the run says so instead of failing.
func TestFitCounts(t *testing.T) {
	if os.Getenv("BENCH_FIT_CHILD") != "" {
		got, err := fitCounts([]int{0, 100, 10000, 20000})
		if err != nil {
			t.Fatal(err)
		}
		if want := []int{0, 100, 1000 - idleSpare}; !slices.Equal(got, want) {
			t.Fatalf("fitCounts = %v, want %v", got, want)
		}
		return
	}
	args := []string{"sh", "-c", `ulimit -Sn 1000 && ulimit -Hn 1000 && exec "$0" -test.run '^TestFitCounts$' -test.v`, os.Args[0]}
	if os.Geteuid() == 0 {
		// Root may raise its hard limit again: the child runs without
		// the capability that allows it.
		setpriv, err := exec.LookPath("setpriv")
		if err != nil {
			t.Skip("as root this needs setpriv (util-linux) to drop CAP_SYS_RESOURCE")
		}
		args = append([]string{setpriv, "--bounding-set=-sys_resource", "--inh-caps=-sys_resource"}, args...)
	}
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Env = append(os.Environ(), "BENCH_FIT_CHILD=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "20000 idle connections do not fit (this machine allows 1000 descriptors): measuring 872 instead") {
		t.Fatalf("the child did not say what it measured instead:\n%s", out)
	}
}

// TestDaemonRoom: the room a serving process has for connections is its
// own descriptor limit, less what it holds and what it may open while it
// serves.
func TestDaemonRoom(t *testing.T) {
	cmd := exec.Command("sh", "-c", "ulimit -Sn 500 && exec sleep 30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	var (
		room  int
		why   string
		slept bool
	)
	proc := "/proc/" + strconv.Itoa(cmd.Process.Pid)
	for range 500 {
		// Until sh has exec'd sleep with its limit, and sleep sleeps: the
		// loader opens files on its way there, which a count taken
		// meanwhile would include and one taken later would not.
		b, _ := os.ReadFile(proc + "/cmdline")
		wchan, _ := os.ReadFile(proc + "/wchan")
		if strings.HasPrefix(string(b), "sleep") && strings.Contains(string(wchan), "nanosleep") {
			var err error
			if room, why, err = daemonRoom(cmd.Process.Pid); err != nil {
				t.Fatal(err)
			}
			slept = true
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if !slept {
		t.Fatal("sleep(1) did not reach its nanosleep within 5 s")
	}
	ents, err := os.ReadDir(proc + "/fd")
	if err != nil {
		t.Fatal(err)
	}
	if want := 500 - len(ents) - daemonSpare; room != want {
		t.Fatalf("daemonRoom = %d (%s), want %d", room, why, want)
	}
	if got := fitTo([]int{0, 100, 1000}, room, why); !slices.Equal(got, []int{0, 100, room}) {
		t.Fatalf("fitTo = %v", got)
	}
}
