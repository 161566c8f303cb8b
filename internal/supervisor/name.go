package supervisor

import (
	"os"
	"path/filepath"
	"strings"
)

// Both processes of a daemon are this one binary, so that ps, top and
// pgrep tell them apart each has a name of its own: its comm (what ps -e,
// top and pgrep read; 15 bytes at most), which each process sets when it
// starts, and argv[0] (what ps -o args shows first), which its parent
// chooses when it execs it:
//
//	supervisor       comm gpushm        args gpushm daemon --socket ...
//	serving process  comm gpushm-serve  args gpushm-serve daemon --socket ...
//
// So pgrep gpushm finds both, pgrep -x gpushm the supervisor (and any
// gpushm command running at the time) and pgrep -x gpushm-serve the
// serving process. The supervisor a user starts keeps the argv[0] it was
// given. A supervisor that a serving process starts in place of one that
// died is exec'd through /proc/self/exe (heal.go), which the kernel would
// name "exe": it names itself, as the first did. argv[0] is only a name:
// no version of gpushm reads it, so a supervisor and a serving process of
// different versions (an upgrade) start each other as before.
const (
	SupervisorName = "gpushm"
	ServingName    = "gpushm-serve"
)

// SetName sets this process's comm to name, on every thread it has:
// threads started later copy theirs from the thread that starts them, so
// it goes over them again until it finds none left with another name. A
// process without /proc keeps its name: the name is a courtesy to
// whoever reads ps, never needed.
func SetName(name string) {
	name = name[:min(len(name), 15)] // what the kernel keeps
	for range 3 {
		tasks, _ := filepath.Glob("/proc/self/task/*/comm")
		renamed := false
		for _, p := range tasks {
			if b, err := os.ReadFile(p); err != nil || strings.TrimSuffix(string(b), "\n") == name {
				continue // a thread that ended, or one named already
			}
			f, err := os.OpenFile(p, os.O_WRONLY, 0)
			if err != nil {
				continue
			}
			f.WriteString(name)
			f.Close()
			renamed = true
		}
		if !renamed {
			return
		}
	}
}
