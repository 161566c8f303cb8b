// Package gpushm is the Go client of the gpushm daemon: named GPU (or host)
// memory segments shared between processes without copies.
//
//	c, err := gpushm.Dial(ctx, "")                 // $GPUSHM_SOCKET, else SocketCandidates
//	seg, err := c.Create(ctx, "weights", 1<<30, nil)
//	m, err := seg.Map()                            // m.DevicePtr() on cuda, m.Bytes() on host
//	...
//	seg.Close()                                    // unmaps and ends the lease
//
// A Segment is a lease: the memory stays allocated while any process holds
// one, even after Unlink. Opening a name that this Client already holds open
// reuses the same lease and mapping without a round trip to the daemon, as
// long as the name still names the same segment (the daemon's epoch page
// says so). Mappings are made in this process: cuda segments are imported
// with cuMemImportFromShareableHandle and mapped with cuMemMap; host segments
// are mmapped. The descriptor a mapping came from is closed once it is mapped.
//
// A Client is safe for concurrent use.
package gpushm
