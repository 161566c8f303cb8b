// Command housecheck keeps the house's rules (docs/architecture.md, "The
// map"): it fails when a package imports what the map says it may not,
// when a function (tests' included) is longer than maxLines, when a file
// outside unsafeAllowed imports unsafe, or when docs/architecture.md's
// package table or map differs from go list (docs.go). It names the files
// longer than longFile lines, as a notice. ./scripts/test runs it:
//
//	go run ./scripts/housecheck
//
// With -write, it first rewrites the package table from go list, keeping
// each package's "gives"; the map it only checks, since its layout is
// drawn by hand:
//
//	go run ./scripts/housecheck -write
//
// It reads the imports from 'go list' and the functions with go/ast, so it
// takes a second or two and needs nothing but the Go toolchain.
package main

import (
	"bufio"
	"bytes"
	"flag"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
)

const module = "github.com/gpushm/gpushm"

// maxLines is the longest a function may be, a test's too, from its func
// keyword to its closing brace.
const maxLines = 120

// longExempt lists the files whose functions may still be longer than
// maxLines, each until it is broken up; shrink it, never grow it.
var longExempt []string

// longFile is the length past which a file is named in the output, as a
// notice to split it by what its parts do, not as a failure.
const longFile = 800

// unsafeAllowed lists the files, and the directories (ending in "/") of
// whole packages, that may import unsafe, each with the reason. Tests
// count as any other file: a test that needs a pointer's address says
// so here. Only the cgo layers, internal/cuda and internal/ucx, each a
// dlopen of one library, are meant to touch unsafe (STYLE.md, "A thin,
// dumb cgo layer"); the others are system calls, mappings at a chosen
// address and words in shared memory that need a pointer. Shrink it, never grow it without
// a reason a reviewer accepts.
var unsafeAllowed = map[string]string{
	"internal/cuda/":                    "the cgo layer: C pointers and the driver's structures",
	"internal/ucx/":                     "the second cgo layer (peers' data path, dlopen of libucp): C pointers, UCX's requests and structures",
	"internal/backend/reserve_linux.go": "the host reserve's pieces populated through a mapping made by MmapPtr",
	"internal/channel/block.go":         "a channel's control block: atomic words and futexes in shared memory",
	"internal/pull/board.go":            "a pull's board: atomic words in memory shared with another process and written by UCX",
	"internal/epoch/epoch.go":           "the epoch page: an atomic word in shared memory",
	"internal/supervisor/table.go":      "the record table: words in shared memory",
	"internal/wire/conn_linux.go":       "recvmsg without the sender's address, which unix.Recvmsg makes anew on every call",
	"internal/xfer/xfer_linux.go":       "cachestat, which x/sys/unix does not wrap (its mincore could be unix.Mincore)",
	"mapping.go":                        "host mappings placed at a reserved address (MmapPtr)",
	"remap_test.go":                     "a mapping's address, to see that a remap keeps it",
	"integration/remap_test.go":         "a mapping's address, to see that a remap keeps it",
}

// daemonPkgs are the packages that compose the daemon: the only ones that
// may import the server, the supervisor and the backends.
var daemonPkgs = []string{
	"internal/daemon",
	// A daemon in a test's process, on the host backend.
	"internal/testdaemon",
}

// daemonOnly are the packages only daemonPkgs may import.
var daemonOnly = []string{"internal/server", "internal/supervisor", "internal/backend"}

// serverCode is what the client may not import.
var serverCode = []string{"internal/server", "internal/supervisor", "internal/backend", "internal/segment"}

// clientSide are the client (the root package) and the packages built on
// it or for the command line: none imports server code, nor the daemon's
// composition.
var clientSide = []string{
	".", "checkpoint", "internal/bench",
	// The command line's helpers.
	"internal/complete", "internal/exitcode", "internal/interrupt", "internal/owner",
	"internal/progress", "internal/report", "internal/terminal",
}

// notForCommands are what the commands may not import: they reach the
// daemon through the client (the root package and checkpoint/), and run
// it through internal/daemon, not through the protocol, the copy engine,
// the bundle's layout or the daemon's parts.
var notForCommands = []string{
	"internal/segment", "internal/xfer", "internal/layout", "internal/wire", "internal/crc32c",
	"internal/server", "internal/backend", "internal/supervisor",
}

// testOnly are the packages that only tests import.
var testOnly = []string{"internal/testutil", "internal/testdaemon"}

// importExempt lists arrows the map forbids that are still there, each
// until it is gone; shrink it, never grow it.
var importExempt = map[string]string{}

func main() {
	write := flag.Bool("write", false, "rewrite the package table of "+archDoc+" from go list")
	flag.Parse()
	var bad []string
	imp, err := checkImports()
	if err != nil {
		fmt.Fprintln(os.Stderr, "housecheck:", err)
		os.Exit(2)
	}
	bad = append(bad, imp...)
	long, err := checkLengths(".")
	if err != nil {
		fmt.Fprintln(os.Stderr, "housecheck:", err)
		os.Exit(2)
	}
	bad = append(bad, long...)
	uns, err := checkUnsafe(".")
	if err != nil {
		fmt.Fprintln(os.Stderr, "housecheck:", err)
		os.Exit(2)
	}
	bad = append(bad, uns...)
	docs, err := checkDocs(".", *write)
	if err != nil {
		fmt.Fprintln(os.Stderr, "housecheck:", err)
		os.Exit(2)
	}
	bad = append(bad, docs...)
	notes, err := longFiles(".")
	if err != nil {
		fmt.Fprintln(os.Stderr, "housecheck:", err)
		os.Exit(2)
	}
	for _, n := range notes {
		fmt.Println(n)
	}
	for _, b := range bad {
		fmt.Println(b)
	}
	if len(bad) > 0 {
		fmt.Printf("housecheck: %d broken rules (docs/architecture.md, \"The map\")\n", len(bad))
		os.Exit(1)
	}
}

// rel names a package of the module by its path from the module's root
// ("." for the root package); other packages are "".
func rel(p string) string {
	if p == module {
		return "."
	}
	if r, ok := strings.CutPrefix(p, module+"/"); ok {
		return r
	}
	return ""
}

// under reports whether pkg is p or a package below it.
func under(pkg, p string) bool {
	return pkg == p || strings.HasPrefix(pkg, p+"/")
}

func underAny(pkg string, ps []string) bool {
	return slices.ContainsFunc(ps, func(p string) bool { return under(pkg, p) })
}

// checkImports reads every package's imports, and its tests', from go list.
func checkImports() ([]string, error) {
	cmd := exec.Command("go", "list", "-e", "-f",
		"{{.ImportPath}}|{{join .Imports \" \"}}|{{join .TestImports \" \"}} {{join .XTestImports \" \"}}", "./...")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("go list: %v: %s", err, stderr.Bytes())
	}
	var bad []string
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Split(sc.Text(), "|")
		if len(f) != 3 {
			continue
		}
		from := rel(f[0])
		for _, to := range strings.Fields(f[1]) {
			if msg := forbidden(from, rel(to), false); msg != "" {
				bad = append(bad, msg)
			}
		}
		for _, to := range strings.Fields(f[2]) {
			if msg := forbidden(from, rel(to), true); msg != "" {
				bad = append(bad, msg)
			}
		}
	}
	sort.Strings(bad)
	return slices.Compact(bad), sc.Err()
}

// forbidden says why from may not import to, or "" where it may. Tests may
// start daemons (through internal/testdaemon), so only the rules on cmd/
// and internal/cli hold for their imports. The rules, as docs/architecture.md ("The map")
// says them: nothing imports a command, and only the binary the command
// line (internal/cli); only the daemon's package imports
// the server, the supervisor and the backends; the client (the root
// package), and what is built on it, imports no server code; the commands
// import neither the protocol nor the daemon's parts; only tests import
// the test helpers.
func forbidden(from, to string, test bool) string {
	if to == "" || from == to {
		return ""
	}
	arrow := from + " -> " + to
	if _, ok := importExempt[arrow]; ok {
		return ""
	}
	switch {
	case under(to, "cmd"):
		return arrow + ": nothing imports a command"
	case under(to, "internal/cli") && !under(from, "cmd"):
		return arrow + ": only the binary (cmd/gpushm) imports the command line"
	case test:
		return ""
	case underAny(to, testOnly):
		return arrow + ": only tests import " + to
	case underAny(to, daemonOnly) && !underAny(from, daemonPkgs):
		return arrow + ": only the daemon's package imports " + to
	case from == "." && underAny(to, serverCode):
		return arrow + ": the client imports no server code"
	case slices.Contains(clientSide, from) && (underAny(to, serverCode) || under(to, "internal/daemon")):
		return arrow + ": built on the client, " + from + " imports no server code"
	case (under(from, "cmd") || under(from, "internal/cli")) && underAny(to, notForCommands):
		return arrow + ": a command reaches the daemon through the client, not " + to
	}
	return ""
}

// goFiles calls fn with the path from root of every Go file under root,
// tests included; deploy/, a module of its own, is kept to the same
// rules.
func goFiles(root string, fn func(path, rel string) error) error {
	return filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			if n := d.Name(); path != root && (strings.HasPrefix(n, ".") || n == "testdata" || n == "node_modules") {
				return filepath.SkipDir
			}
			return nil
		}
		if !strings.HasSuffix(path, ".go") {
			return nil
		}
		rel, err := filepath.Rel(root, path)
		if err != nil {
			return err
		}
		return fn(path, filepath.ToSlash(rel))
	})
}

// lengthExempt says whether the functions of the file at rel (from the
// module's root) may be longer than maxLines.
func lengthExempt(rel string) bool {
	return slices.Contains(longExempt, rel)
}

// checkLengths lists the functions under root, tests' included, longer
// than maxLines, outside longExempt.
func checkLengths(root string) ([]string, error) {
	var bad []string
	fset := token.NewFileSet()
	err := goFiles(root, func(path, rel string) error {
		if lengthExempt(rel) {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		for _, decl := range f.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok || fn.Body == nil {
				continue
			}
			start, end := fset.Position(fn.Pos()), fset.Position(fn.End())
			if n := end.Line - start.Line + 1; n > maxLines {
				bad = append(bad, fmt.Sprintf("%s:%d: %s is %d lines (at most %d)", rel, start.Line, name(fn), n, maxLines))
			}
		}
		return nil
	})
	return bad, err
}

// checkUnsafe lists the Go files under root, tests included, that import
// unsafe and are not in unsafeAllowed, and the entries of unsafeAllowed
// that no longer import it (the list only shrinks).
func checkUnsafe(root string) ([]string, error) {
	var bad []string
	used := map[string]bool{}
	fset := token.NewFileSet()
	err := goFiles(root, func(path, rel string) error {
		f, err := parser.ParseFile(fset, path, nil, parser.ImportsOnly)
		if err != nil {
			return err
		}
		if !slices.ContainsFunc(f.Imports, func(s *ast.ImportSpec) bool { return s.Path.Value == `"unsafe"` }) {
			return nil
		}
		switch dir := filepath.ToSlash(filepath.Dir(rel)) + "/"; {
		case unsafeAllowed[rel] != "":
			used[rel] = true
		case unsafeAllowed[dir] != "":
			used[dir] = true
		default:
			bad = append(bad, rel+": imports unsafe, which only the files of unsafeAllowed (scripts/housecheck) may, each with its reason")
		}
		return nil
	})
	for _, k := range slices.Sorted(maps.Keys(unsafeAllowed)) {
		if !used[k] {
			bad = append(bad, k+": in unsafeAllowed (scripts/housecheck) but imports no unsafe: take it off the list")
		}
	}
	return bad, err
}

// longFiles names the Go files under root longer than longFile lines,
// longest first.
func longFiles(root string) ([]string, error) {
	type file struct {
		rel   string
		lines int
	}
	var long []file
	err := goFiles(root, func(path, rel string) error {
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if n := bytes.Count(b, []byte("\n")); n > longFile {
			long = append(long, file{rel, n})
		}
		return nil
	})
	sort.Slice(long, func(i, j int) bool { return long[i].lines > long[j].lines })
	var notes []string
	for _, f := range long {
		notes = append(notes, fmt.Sprintf("notice: %s is %d lines (over %d: split it by what its parts do)", f.rel, f.lines, longFile))
	}
	return notes, err
}

// name spells a function as a reader looks for it: (*conn).dispatch.
func name(fn *ast.FuncDecl) string {
	if fn.Recv == nil || len(fn.Recv.List) == 0 {
		return fn.Name.Name
	}
	t := fn.Recv.List[0].Type
	if ix, ok := t.(*ast.IndexExpr); ok {
		t = ix.X
	}
	switch t := t.(type) {
	case *ast.StarExpr:
		x := t.X
		if ix, ok := x.(*ast.IndexExpr); ok {
			x = ix.X
		}
		if id, ok := x.(*ast.Ident); ok {
			return "(*" + id.Name + ")." + fn.Name.Name
		}
	case *ast.Ident:
		return t.Name + "." + fn.Name.Name
	}
	return fn.Name.Name
}
