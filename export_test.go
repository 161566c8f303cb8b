package gpushm

// FakeSockets makes the socket candidates those of a user of euid on a
// node whose daemon listens at system, until restore.
func FakeSockets(euid int, system string) (restore func()) {
	oldSystem, oldEuid := systemSocket, geteuid
	systemSocket, geteuid = system, func() int { return euid }
	return func() { systemSocket, geteuid = oldSystem, oldEuid }
}

// HandOverUnwritten hands a producer's message over without its filled
// flag, as a GPU producer's CPU does before its stream has run the
// message's writes: for tests of a producer that dies then.
func (m *Message) HandOverUnwritten() {
	ch := m.ch
	ch.mu.Lock()
	defer ch.mu.Unlock()
	ch.out = nil
	ch.blk.Sent(m.seq)
	ch.last = m.seq + 1
}
