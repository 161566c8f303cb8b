package main

import (
	"bytes"
	"cmp"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
)

// archDoc is the page whose package table and map housecheck keeps.
const archDoc = "docs/architecture.md"

// writeCmd is the command that rewrites the package table.
const writeCmd = "go run ./scripts/housecheck -write"

// The package table lies between these lines of archDoc.
const (
	tableBegin = "<!-- package table: written by '" + writeCmd + "' from go list; edit only the \"gives\" column -->"
	tableEnd   = "<!-- end of package table -->"
)

// A pkg is a package of the module, as go list gives it.
type pkg struct {
	rel     string   // path from the module's root, "." for the root package
	doc     string   // its doc comment's first sentence
	imports []string // the packages of ours it imports (not its tests), as rel
	ext     []string // the other modules it imports, and C for cgo
}

// listPackages reads the module's packages from go list.
func listPackages() ([]pkg, error) {
	cmd := exec.Command("go", "list", "-e", "-f", "{{.ImportPath}}\t{{.Doc}}\t{{join .Imports \" \"}}", "./...")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("go list: %v: %s", err, stderr.Bytes())
	}
	var pkgs []pkg
	for line := range strings.Lines(string(out)) {
		f := strings.Split(strings.TrimSuffix(line, "\n"), "\t")
		if len(f) != 3 || rel(f[0]) == "" {
			continue
		}
		p := pkg{rel: rel(f[0]), doc: f[1]}
		for _, imp := range strings.Fields(f[2]) {
			if r := rel(imp); r != "" {
				p.imports = append(p.imports, r)
			} else if e := external(imp); e != "" && !slices.Contains(p.ext, e) {
				p.ext = append(p.ext, e)
			}
		}
		pkgs = append(pkgs, p)
	}
	return pkgs, nil
}

// external names an import from outside the module by its module, as a
// reader knows it (spf13/cobra, x/sys/unix, C for cgo); the standard
// library is "".
func external(imp string) string {
	first, _, _ := strings.Cut(imp, "/")
	switch {
	case imp == "C":
		return "C (cgo)"
	case !strings.Contains(first, "."):
		return "" // the standard library
	case strings.HasPrefix(imp, "golang.org/x/"):
		return strings.TrimPrefix(imp, "golang.org/")
	case first == "github.com":
		if f := strings.Split(imp, "/"); len(f) >= 3 {
			return f[1] + "/" + f[2]
		}
	}
	if f := strings.Split(imp, "/"); len(f) >= 2 {
		return f[0] + "/" + f[1]
	}
	return imp
}

// floors gives each package its floor: 0 for one that imports nothing of
// ours, else one above the highest it imports.
func floors(pkgs []pkg) map[string]int {
	byRel := map[string]pkg{}
	for _, p := range pkgs {
		byRel[p.rel] = p
	}
	fl := map[string]int{}
	var floor func(string) int
	floor = func(r string) int {
		if n, ok := fl[r]; ok {
			return n
		}
		fl[r] = 0 // a cycle, which go list refuses anyway, ends here
		n := 0
		for _, imp := range byRel[r].imports {
			n = max(n, floor(imp)+1)
		}
		fl[r] = n
		return n
	}
	for _, p := range pkgs {
		floor(p.rel)
	}
	return fl
}

// short names a package of ours in the table's "depends on" column.
func short(r string) string {
	if r == "." {
		return "the root package"
	}
	return strings.TrimPrefix(r, "internal/")
}

// cell names a package in the table's first column.
func cell(r string) string {
	if r == "." {
		return "`gpushm` (root)"
	}
	return "`" + r + "`"
}

// cellRel reads a package back from the table's first column.
func cellRel(c string) string {
	c = strings.TrimSpace(c)
	if c == "`gpushm` (root)" {
		return "."
	}
	c = strings.Trim(c, "`")
	// The public packages were once named by their import path.
	return strings.TrimPrefix(c, "gpushm/")
}

// packageTable is the table between tableBegin and tableEnd: a row for
// each package, by floor and then path, whose "gives" is the one the
// table had (old) or, for a package new to it, the package's doc comment.
func packageTable(pkgs []pkg, old string) string {
	gives := map[string]string{}
	for line := range strings.Lines(old) {
		// A cell's \| is a | of its text.
		cells := strings.Split(strings.ReplaceAll(line, `\|`, "\x00"), "|")
		if !strings.HasPrefix(line, "| `") || len(cells) < 5 {
			continue
		}
		// The table's columns: package, floor, gives, depends on; a
		// table without floors had package, gives, depends on.
		g := cells[len(cells)-3]
		gives[cellRel(cells[1])] = strings.ReplaceAll(strings.TrimSpace(g), "\x00", `\|`)
	}
	fl := floors(pkgs)
	pkgs = slices.Clone(pkgs)
	slices.SortFunc(pkgs, func(a, b pkg) int {
		return cmp.Or(cmp.Compare(fl[a.rel], fl[b.rel]), cmp.Compare(a.rel, b.rel))
	})
	var b strings.Builder
	b.WriteString("| package | floor | gives | depends on |\n| --- | --- | --- | --- |\n")
	for _, p := range pkgs {
		g := gives[p.rel]
		if g == "" {
			g = strings.ReplaceAll(p.doc, "|", `\|`)
		}
		// The root package first, the others by name.
		imports := slices.Clone(p.imports)
		slices.Sort(imports)
		var deps []string
		for _, imp := range imports {
			deps = append(deps, short(imp))
		}
		ext := slices.Sorted(slices.Values(p.ext))
		var on string
		switch {
		case len(deps) == 0 && len(ext) == 0:
			on = "the standard library"
		case len(deps) == 0:
			on = "nothing of ours; " + strings.Join(ext, ", ")
		case len(ext) == 0:
			on = strings.Join(deps, ", ")
		default:
			on = strings.Join(deps, ", ") + "; " + strings.Join(ext, ", ")
		}
		fmt.Fprintf(&b, "| %s | %d | %s | %s |\n", cell(p.rel), fl[p.rel], g, on)
	}
	return b.String()
}

// checkDocs holds docs/architecture.md to go list: the package table must
// be what packageTable writes (with write, it is rewritten), and the map
// must draw every package once, on its floor.
func checkDocs(root string, write bool) ([]string, error) {
	path := root + "/" + archDoc
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	doc := string(b)
	pkgs, err := listPackages()
	if err != nil {
		return nil, err
	}
	var bad []string
	before, rest, ok1 := strings.Cut(doc, tableBegin+"\n")
	old, after, ok2 := strings.Cut(rest, tableEnd+"\n")
	if !ok1 || !ok2 {
		return []string{archDoc + ": no package table between the lines " + tableBegin + " and " + tableEnd}, nil
	}
	if table := packageTable(pkgs, old); table != old {
		if write {
			if err := os.WriteFile(path, []byte(before+tableBegin+"\n"+table+tableEnd+"\n"+after), 0o644); err != nil {
				return nil, err
			}
			fmt.Println("housecheck: wrote the package table of " + archDoc)
		} else {
			line := strings.Count(before, "\n") + 2
			bad = append(bad, fmt.Sprintf("%s:%d: the package table differs from go list (- the page, + go list); '%s' rewrites it:\n%s",
				archDoc, line, writeCmd, diff(old, table)))
		}
	}
	return append(bad, checkMap(doc, pkgs)...), nil
}

// checkMap checks the map (the first block under "## The map"): every
// package of the module drawn once, on the floor its imports give it, and
// nothing drawn that is not one.
func checkMap(doc string, pkgs []pkg) []string {
	_, m, _ := strings.Cut(doc, "\n## The map\n")
	start := strings.Index(m, "\n```\n")
	if start < 0 {
		return []string{archDoc + `: no map (a block under "## The map")`}
	}
	m = m[start+len("\n```\n"):]
	m, _, _ = strings.Cut(m, "\n```")
	fix := fmt.Sprintf("move it there by hand (the floor column of the package table, which '%s' writes, has every package's floor)", writeCmd)
	fl := floors(pkgs)
	drawn := map[string]int{}
	var bad []string
	floor := -1
	for line := range strings.Lines(m) {
		if f, ok := strings.CutPrefix(line, "floor "); ok {
			n, _, _ := strings.Cut(f, " ")
			if v, err := strconv.Atoi(n); err == nil {
				floor = v
			}
		}
		for _, name := range mapNames(line) {
			r := strings.TrimSuffix(name, "/")
			if r == "gpushm (root)" {
				r = "."
			}
			want, ok := fl[r]
			switch {
			case !ok && !strings.HasPrefix(r, "internal/") && !strings.HasPrefix(r, "cmd/") && !strings.HasPrefix(r, "scripts/"):
				continue // a word with a slash: put/get
			case !ok:
				bad = append(bad, fmt.Sprintf("%s: the map draws %s, which is not a package of the module", archDoc, name))
			case drawn[r] > 0:
				bad = append(bad, fmt.Sprintf("%s: the map draws %s twice", archDoc, name))
			case floor != want:
				bad = append(bad, fmt.Sprintf("%s: the map draws %s on floor %d, its imports put it on floor %d; %s", archDoc, name, floor, want, fix))
			}
			drawn[r]++
		}
	}
	for _, p := range pkgs {
		if drawn[p.rel] == 0 {
			bad = append(bad, fmt.Sprintf("%s: the map does not draw %s, whose imports put it on floor %d; draw it there by hand (a package at the module's root with its slash, as checkpoint/)", archDoc, p.rel, fl[p.rel]))
		}
	}
	return bad
}

// mapNames are the words of a line of the map that may name packages:
// "gpushm (root)", and the words with a slash (internal/wire,
// checkpoint/: a package at the module's root is drawn with its slash).
func mapNames(line string) []string {
	var names []string
	if strings.Contains(line, "gpushm (root)") {
		names = append(names, "gpushm (root)")
		line = strings.ReplaceAll(line, "gpushm (root)", "")
	}
	for _, w := range strings.FieldsFunc(line, func(r rune) bool {
		return !('a' <= r && r <= 'z' || '0' <= r && r <= '9' || r == '_' || r == '-' || r == '/' || r == '.')
	}) {
		w = strings.TrimRight(w, ".")
		if strings.Contains(w, "/") {
			names = append(names, w)
		}
	}
	return names
}

// diff is a line diff of a and b: the lines only a has marked -, those
// only b has +, each with a line of context on either side.
func diff(a, b string) string {
	x, y := strings.SplitAfter(a, "\n"), strings.SplitAfter(b, "\n")
	// The longest common subsequence, by dynamic programming: tables
	// are tens of lines.
	l := make([][]int, len(x)+1)
	for i := range l {
		l[i] = make([]int, len(y)+1)
	}
	for i := len(x) - 1; i >= 0; i-- {
		for j := len(y) - 1; j >= 0; j-- {
			if x[i] == y[j] {
				l[i][j] = l[i+1][j+1] + 1
			} else {
				l[i][j] = max(l[i+1][j], l[i][j+1])
			}
		}
	}
	type op struct {
		mark byte
		line string
	}
	var ops []op
	i, j := 0, 0
	for i < len(x) || j < len(y) {
		switch {
		case i < len(x) && j < len(y) && x[i] == y[j]:
			ops = append(ops, op{' ', x[i]})
			i, j = i+1, j+1
		case j < len(y) && (i == len(x) || l[i][j+1] >= l[i+1][j]):
			ops = append(ops, op{'+', y[j]})
			j++
		default:
			ops = append(ops, op{'-', x[i]})
			i++
		}
	}
	var out strings.Builder
	for k, o := range ops {
		near := func(d int) bool { return k+d >= 0 && k+d < len(ops) && ops[k+d].mark != ' ' }
		if o.mark == ' ' && !near(-1) && !near(1) || o.line == "" {
			continue
		}
		out.WriteByte(o.mark)
		out.WriteString(strings.TrimSuffix(o.line, "\n"))
		out.WriteByte('\n')
	}
	return strings.TrimSuffix(out.String(), "\n")
}
