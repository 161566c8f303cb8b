package segment

import (
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// fakeAlloc hands out numbered fake descriptors and counts what is live.
type fakeAlloc struct {
	mu       sync.Mutex
	live     map[int]int64
	next     int
	capacity int64
	failWith error
}

func newFake() *fakeAlloc { return &fakeAlloc{live: map[int]int64{}, next: 100, capacity: 1 << 30} }

func (f *fakeAlloc) HandleType() string { return "fake" }

func (f *fakeAlloc) Capacity(device int) (int64, error) {
	if device != 0 {
		return 0, fmt.Errorf("%w: %d", ErrNoDevice, device)
	}
	return f.capacity, nil
}

func (f *fakeAlloc) Allocate(device int, size int64) (Memory, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.failWith != nil {
		return nil, f.failWith
	}
	f.next++
	alloc := (size + 4095) / 4096 * 4096
	f.live[f.next] = alloc
	return &fakeMem{f: f, fd: f.next, size: alloc}, nil
}

func (f *fakeAlloc) liveCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.live)
}

type fakeMem struct {
	f    *fakeAlloc
	fd   int
	size int64
}

func (m *fakeMem) FD() (int, error) { return m.fd, nil }
func (m *fakeMem) Size() int64      { return m.size }
func (m *fakeMem) Free() error {
	m.f.mu.Lock()
	defer m.f.mu.Unlock()
	if _, ok := m.f.live[m.fd]; !ok {
		panic("double free")
	}
	delete(m.f.live, m.fd)
	return nil
}

var (
	alice = Cred{UID: 1000, GID: 1000}
	bob   = Cred{UID: 1001, GID: 1000}
	eve   = Cred{UID: 1002, GID: 2000}
)

func TestCreateValidation(t *testing.T) {
	tests := []struct {
		name  string
		o     CreateOptions
		want  error
		errno syscall.Errno
	}{
		{"empty name", CreateOptions{Name: "", Size: 1}, ErrBadName, syscall.EINVAL},
		{"dot", CreateOptions{Name: ".", Size: 1}, ErrBadName, syscall.EINVAL},
		{"dotdot", CreateOptions{Name: "..", Size: 1}, ErrBadName, syscall.EINVAL},
		{"slash", CreateOptions{Name: "a/b", Size: 1}, ErrBadName, syscall.EINVAL},
		{"nul", CreateOptions{Name: "a\x00b", Size: 1}, ErrBadName, syscall.EINVAL},
		{"256 bytes", CreateOptions{Name: strings.Repeat("x", 256), Size: 1}, ErrNameLong, syscall.ENAMETOOLONG},
		{"zero size", CreateOptions{Name: "a", Size: 0}, ErrBadSize, syscall.EINVAL},
		{"negative size", CreateOptions{Name: "a", Size: -5}, ErrBadSize, syscall.EINVAL},
		{"larger than device", CreateOptions{Name: "a", Size: 1<<30 + 1}, ErrMoreThanDevice, syscall.ENOSPC},
		{"no such device", CreateOptions{Name: "a", Size: 1, Device: 3}, ErrNoDevice, syscall.ENODEV},
		{"bad mode", CreateOptions{Name: "a", Size: 1, Mode: 0o4755, UseMode: true}, ErrBadMode, syscall.EINVAL},
		{"bad meta", CreateOptions{Name: "a", Size: 1, Meta: []byte("{")}, ErrBadMeta, syscall.EINVAL},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := newFake()
			r := New(f, nil)
			_, _, err := r.Create(alice, tc.o)
			if !errors.Is(err, tc.want) || !errors.Is(err, tc.errno) {
				t.Fatalf("Create(%+v) = %v, want %v (%v)", tc.o, err, tc.want, tc.errno)
			}
			if n := f.liveCount(); n != 0 || len(r.List("", 0)) != 0 {
				t.Fatalf("failed create left %d allocations, %d names", n, len(r.List("", 0)))
			}
		})
	}
	r := New(newFake(), nil)
	if _, _, err := r.Create(alice, CreateOptions{Name: strings.Repeat("x", 255), Size: 1}); err != nil {
		t.Fatalf("255-byte name: %v", err)
	}
}

func TestAllocationFailureLeavesNothing(t *testing.T) {
	f := newFake()
	f.failWith = fmt.Errorf("cuMemCreate: %w", syscall.ENOMEM)
	r := New(f, nil)
	_, _, err := r.Create(alice, CreateOptions{Name: "big", Size: 100})
	if !errors.Is(err, syscall.ENOMEM) {
		t.Fatalf("Create = %v, want ENOMEM", err)
	}
	if _, err := r.Stat("big"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Stat after failed create = %v, want ErrNotFound", err)
	}
	f.failWith = nil
	if _, created, err := r.Create(alice, CreateOptions{Name: "big", Size: 100}); err != nil || !created {
		t.Fatalf("retry Create = %v, %v", created, err)
	}
}

func TestLifecycle(t *testing.T) {
	f := newFake()
	changes := 0
	r := New(f, func() { changes++ })
	s, created, err := r.Create(alice, CreateOptions{Name: "w", Size: 5000, Open: true})
	if err != nil || !created {
		t.Fatalf("Create = %v, %v", created, err)
	}
	if inf := r.Info(s); inf.AllocSize != 8192 || inf.Size != 5000 || inf.Opens != 1 || inf.Mode != DefaultMode || inf.UID != 1000 {
		t.Fatalf("Info = %+v", inf)
	}
	if _, _, err := r.Create(alice, CreateOptions{Name: "w", Size: 5000}); !errors.Is(err, fs.ErrExist) {
		t.Fatalf("second Create = %v, want EEXIST", err)
	}
	s2, created, err := r.Create(alice, CreateOptions{Name: "w", Size: 5000, ExistOK: true, Open: true})
	if err != nil || created || s2 != s {
		t.Fatalf("Create ExistOK = %p %v %v, want the same segment", s2, created, err)
	}
	if _, _, err := r.Create(alice, CreateOptions{Name: "w", Size: 4000, ExistOK: true}); !errors.Is(err, ErrExist) {
		t.Fatalf("Create ExistOK other size = %v, want ErrExist", err)
	}
	if err := r.Unlink(alice, "w"); err != nil {
		t.Fatal(err)
	}
	if changes != 1 {
		t.Fatalf("changed called %d times, want 1", changes)
	}
	if _, err := r.Acquire(alice, "w", false); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("Acquire after unlink = %v, want ENOENT", err)
	}
	// The name is free again at once, while the old memory lives on.
	if _, _, err := r.Create(alice, CreateOptions{Name: "w", Size: 10}); err != nil {
		t.Fatalf("re-create after unlink: %v", err)
	}
	if n := f.liveCount(); n != 2 {
		t.Fatalf("%d live allocations, want 2", n)
	}
	r.Release(s)
	if n := f.liveCount(); n != 2 {
		t.Fatalf("after first release: %d live, want 2", n)
	}
	r.Release(s)
	if n := f.liveCount(); n != 1 {
		t.Fatalf("after last release: %d live, want 1", n)
	}
	if err := r.Release(s); err == nil {
		t.Fatal("Release without a lease succeeded")
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	if n := f.liveCount(); n != 0 {
		t.Fatalf("after Close: %d live", n)
	}
}

func TestPermissions(t *testing.T) {
	tests := []struct {
		mode     uint32
		who      Cred
		readOnly bool
		ok       bool
	}{
		{0o600, alice, false, true},
		{0o600, bob, true, false},
		{0o640, bob, true, true},
		{0o640, bob, false, false},
		{0o660, bob, false, true},
		{0o640, eve, true, false},
		{0o604, eve, true, true},
		{0o606, eve, false, true},
		{0o000, alice, true, false},
		{0o000, Root, false, true},
		{0o400, alice, false, false},
		{0o400, alice, true, true},
	}
	for _, tc := range tests {
		t.Run(fmt.Sprintf("%04o/uid%d/ro=%v", tc.mode, tc.who.UID, tc.readOnly), func(t *testing.T) {
			r := New(newFake(), nil)
			if _, _, err := r.Create(alice, CreateOptions{Name: "s", Size: 1, Mode: tc.mode, UseMode: true}); err != nil {
				t.Fatal(err)
			}
			_, err := r.Acquire(tc.who, "s", tc.readOnly)
			if tc.ok && err != nil || !tc.ok && !errors.Is(err, syscall.EACCES) {
				t.Fatalf("Acquire = %v, want ok=%v", err, tc.ok)
			}
		})
	}
	r := New(newFake(), nil)
	r.Create(alice, CreateOptions{Name: "s", Size: 1, Mode: 0o666, UseMode: true})
	if err := r.Unlink(bob, "s"); !errors.Is(err, syscall.EPERM) {
		t.Fatalf("Unlink by another user = %v, want EPERM", err)
	}
	if err := r.Unlink(Root, "s"); err != nil {
		t.Fatalf("Unlink by root = %v", err)
	}
}

func TestList(t *testing.T) {
	r := New(newFake(), nil)
	for _, n := range []string{"c", "a", "b", "d"} {
		if _, _, err := r.Create(alice, CreateOptions{Name: n, Size: 1, Meta: []byte(`{"k":1}`)}); err != nil {
			t.Fatal(err)
		}
	}
	var got []string
	after := ""
	for {
		page := r.List(after, 3)
		if len(page) == 0 {
			break
		}
		for _, inf := range page {
			if inf.Meta != nil {
				t.Errorf("List returned meta for %s", inf.Name)
			}
			got = append(got, inf.Name)
		}
		after = page[len(page)-1].Name
	}
	if strings.Join(got, ",") != "a,b,c,d" {
		t.Fatalf("paged List = %v", got)
	}
	if inf, _ := r.Stat("a"); string(inf.Meta) != `{"k":1}` {
		t.Fatalf("Stat meta = %s", inf.Meta)
	}
}

// TestConcurrentOpenOrCreate has many goroutines race to open-or-create the
// same names: each name must get exactly one allocation.
func TestConcurrentOpenOrCreate(t *testing.T) {
	f := newFake()
	r := New(f, nil)
	var wg sync.WaitGroup
	created := make([]int, 8)
	var mu sync.Mutex
	for g := range 64 {
		wg.Go(func() {
			for i := range 8 {
				s, c, err := r.Create(Cred{UID: 7}, CreateOptions{Name: fmt.Sprint("n", i), Size: 4096, ExistOK: true, Open: true})
				if err != nil {
					t.Errorf("goroutine %d: %v", g, err)
					return
				}
				if c {
					mu.Lock()
					created[i]++
					mu.Unlock()
				}
				r.Release(s)
			}
		})
	}
	wg.Wait()
	for i, n := range created {
		if n != 1 {
			t.Errorf("name n%d created %d times, want 1", i, n)
		}
	}
	if u := r.Usage(); u.Segments != 8 || u.Opens != 0 {
		t.Fatalf("Usage = %+v", u)
	}
	for i := range 8 {
		if err := r.Unlink(Cred{UID: 7}, fmt.Sprint("n", i)); err != nil {
			t.Fatal(err)
		}
	}
	if n := f.liveCount(); n != 0 {
		t.Fatalf("%d allocations live after unlinking all", n)
	}
}

func TestDiscard(t *testing.T) {
	f := newFake()
	r := New(f, nil)
	s, _, _ := r.Create(alice, CreateOptions{Name: "d", Size: 1, Open: true})
	r.Release(s)
	if err := r.Discard(s); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Stat("d"); !errors.Is(err, ErrNotFound) || f.liveCount() != 0 {
		t.Fatalf("after Discard: Stat = %v, %d live", err, f.liveCount())
	}
	// Discard of a segment whose name was reused leaves the new one alone.
	s1, _, _ := r.Create(alice, CreateOptions{Name: "d", Size: 1})
	r.Unlink(alice, "d")
	r.Create(alice, CreateOptions{Name: "d", Size: 1})
	r.Discard(s1)
	if _, err := r.Stat("d"); err != nil {
		t.Fatalf("Discard of an old segment removed the new one: %v", err)
	}
}

func TestQuotas(t *testing.T) {
	f := newFake()
	r := New(f, nil)
	r.SetLimits(Limits{DeviceBytes: map[int]int64{0: 64 << 10}, UserBytes: 16 << 10, UserSegments: 3})
	// alice: 3 segments of 4 KiB, then the count limit.
	for i := range 3 {
		if _, _, err := r.Create(alice, CreateOptions{Name: fmt.Sprint("a", i), Size: 4096}); err != nil {
			t.Fatal(err)
		}
	}
	_, _, err := r.Create(alice, CreateOptions{Name: "a3", Size: 1})
	if !errors.Is(err, syscall.ENOSPC) || !strings.Contains(err.Error(), "3 held, limit 3") {
		t.Fatalf("4th segment = %v, want ENOSPC naming the count", err)
	}
	// bob: the byte limit, with what was asked, used and allowed.
	if _, _, err := r.Create(bob, CreateOptions{Name: "b0", Size: 12 << 10}); err != nil {
		t.Fatal(err)
	}
	_, _, err = r.Create(bob, CreateOptions{Name: "b1", Size: 8 << 10})
	if !errors.Is(err, ErrQuota) || !strings.Contains(err.Error(), "asked 8192 bytes, 12288 in use, limit 16384") {
		t.Fatalf("over the user limit = %v", err)
	}
	// Root is held to the device limit only: 12 KiB + 12 KiB used, 40 KiB more fits, 41 does not.
	if _, _, err := r.Create(Root, CreateOptions{Name: "r0", Size: 40 << 10}); err != nil {
		t.Fatalf("root within the device limit: %v", err)
	}
	_, _, err = r.Create(Root, CreateOptions{Name: "r1", Size: 1})
	if !errors.Is(err, ErrQuota) || !strings.Contains(err.Error(), "device 0") {
		t.Fatalf("over the device limit = %v", err)
	}
	if n := f.liveCount(); n != 5 {
		t.Fatalf("%d allocations live, want 5: refusals must allocate nothing", n)
	}
	// An unlinked segment still open still counts; freeing it makes room.
	s, _ := r.Acquire(bob, "b0", false)
	r.Unlink(bob, "b0")
	if _, _, err := r.Create(bob, CreateOptions{Name: "b1", Size: 8 << 10}); !errors.Is(err, ErrQuota) {
		t.Fatalf("create while an unlinked segment is open = %v, want ErrQuota", err)
	}
	r.Release(s)
	// Freed, but with root's 40 KiB the 8 KiB would reach into the top
	// quarter of the device limit, kept for users holding little (112
	// bytes each) and root (internal/fairshare).
	_, _, err = r.Create(bob, CreateOptions{Name: "b1", Size: 8 << 10})
	if !errors.Is(err, ErrQuota) || !strings.Contains(err.Error(), "fair share of bytes on device 0: uid 1001 holds 0 and asked for 8192 more, while the daemon holds 53248 of its limit of 65536") {
		t.Fatalf("create into the reserve = %v, want the fair share refusal", err)
	}
	if err := r.Unlink(Root, "r0"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := r.Create(bob, CreateOptions{Name: "b1", Size: 8 << 10}); err != nil {
		t.Fatalf("create after the last close = %v", err)
	}
	q := r.Quotas()
	if len(q) != 5 { // device 0; alice and bob: bytes and segments
		t.Fatalf("Quotas = %+v", q)
	}
}

func TestExpire(t *testing.T) {
	f := newFake()
	r := New(f, nil)
	start := time.Now()
	r.Create(alice, CreateOptions{Name: "ttl", Size: 1, TTL: time.Minute})
	r.Create(alice, CreateOptions{Name: "forever", Size: 1})
	s, _ := r.Acquire(alice, "ttl", true)
	// In use at +2m: the clock restarts then.
	if got := r.Expire(start.Add(2 * time.Minute)); len(got) != 0 {
		t.Fatalf("Expire of an open segment = %v", got)
	}
	r.Release(s)
	if got := r.Expire(start.Add(2*time.Minute + 59*time.Second)); len(got) != 0 {
		t.Fatalf("Expire before the TTL ran out = %v", got)
	}
	if got := r.Expire(start.Add(3*time.Minute + time.Second)); len(got) != 1 || got[0] != "ttl" {
		t.Fatalf("Expire after the TTL = %v, want [ttl]", got)
	}
	if f.liveCount() != 1 {
		t.Fatalf("%d live, want only 'forever'", f.liveCount())
	}
	if inf, _ := r.Stat("forever"); inf.TTL != 0 {
		t.Fatalf("forever has TTL %v", inf.TTL)
	}
}

func TestDaemonAndDeviceQuotas(t *testing.T) {
	f := newFake()
	r := New(f, nil)
	r.SetLimits(Limits{Segments: 3, UserDeviceBytes: map[int]int64{0: 8 << 10}})
	// The per-device share, for a user: 8 KiB on device 0.
	if _, _, err := r.Create(alice, CreateOptions{Name: "a0", Size: 8 << 10}); err != nil {
		t.Fatal(err)
	}
	_, _, err := r.Create(alice, CreateOptions{Name: "a1", Size: 1})
	if !errors.Is(err, syscall.ENOSPC) || !strings.Contains(err.Error(), "bytes per user on device 0") ||
		!strings.Contains(err.Error(), "8192 in use, limit 8192") {
		t.Fatalf("over the device share = %v", err)
	}
	// The daemon's count holds for root too: 3 segments in all.
	for _, name := range []string{"r0", "r1"} {
		if _, _, err := r.Create(Root, CreateOptions{Name: name, Size: 1 << 20}); err != nil {
			t.Fatal(err)
		}
	}
	_, _, err = r.Create(Root, CreateOptions{Name: "r2", Size: 1})
	if !errors.Is(err, ErrQuota) || !strings.Contains(err.Error(), "segments of the daemon") || !strings.Contains(err.Error(), "3 held, limit 3") {
		t.Fatalf("over the daemon's segments = %v", err)
	}
	if n := f.liveCount(); n != 3 {
		t.Fatalf("%d allocations live, want 3: refusals allocate nothing", n)
	}
	// A freed segment makes room.
	if err := r.Unlink(Root, "r0"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := r.Create(Root, CreateOptions{Name: "r2", Size: 1}); err != nil {
		t.Fatalf("after an unlink: %v", err)
	}
	var kinds []string
	for _, q := range r.Quotas() {
		kinds = append(kinds, q.Kind+":"+q.Scope)
	}
	if got := strings.Join(kinds, " "); got != "segments: user_device_bytes:"+fmt.Sprint(alice.UID)+"/0" {
		t.Fatalf("Quotas = %s", got)
	}
}

// TestUsersAndQuotasFor: Users says what each uid holds on each device,
// empty segments counted as segments of no bytes; QuotasFor lists the
// asker's user limits even before it holds anything.
func TestUsersAndQuotasFor(t *testing.T) {
	r := New(newFake(), nil)
	r.SetLimits(Limits{UserBytes: 1 << 20, UserSegments: 10})
	if _, _, err := r.Create(alice, CreateOptions{Name: "a", Size: 4096}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := r.Create(alice, CreateOptions{Name: "e", AllowEmpty: true}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := r.Create(Root, CreateOptions{Name: "r", Size: 8192}); err != nil {
		t.Fatal(err)
	}
	want := []UserUse{{UID: 0, Device: 0, Bytes: 8192, Segments: 1}, {UID: alice.UID, Device: 0, Bytes: 4096, Segments: 2}}
	if got := r.Users(); !slices.Equal(got, want) {
		t.Errorf("Users = %+v, want %+v", got, want)
	}
	has := func(qs []QuotaUse, scope string) bool {
		return slices.ContainsFunc(qs, func(q QuotaUse) bool { return q.Kind == "user_bytes" && q.Scope == scope })
	}
	if q := r.Quotas(); !has(q, "1000") || has(q, "1001") || has(q, "0") {
		t.Errorf("Quotas = %+v, want alice's user limits only", q)
	}
	if q := r.QuotasFor(bob.UID); !has(q, "1001") || !has(q, "1000") {
		t.Errorf("QuotasFor(bob) = %+v, want bob's user limits, holding nothing, beside alice's", q)
	}
	if q := r.QuotasFor(Root.UID); has(q, "0") {
		t.Errorf("QuotasFor(root) = %+v: root is held to no user limit", q)
	}
}
