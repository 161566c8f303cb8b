// Package ucx is a thin layer over UCX's UCP API for reading another
// node's memory with one-sided gets: the data path between peer daemons.
// Beside internal/cuda it is the project's second cgo package, and like it
// nothing is linked at build time.
//
//	ctx, _ := ucx.NewContext()      // ucp_init: remote memory access, wakeups
//	w, _ := ctx.NewWorker()         // ucp_worker_create, serialized mode
//	addr, _ := w.Address()          // to the peer over the control plane
//
//	// The side that owns the memory:
//	r, _ := ctx.Map(b)              // ucp_mem_map
//	key, _ := r.PackKey()           // ucp_rkey_pack; send key and r.Addr()
//	go w.Serve(ctx)                 // answer the peers' gets
//
//	// The side that reads:
//	ep, _ := w.Connect(peerAddr)    // ucp_ep_create, peer error handling
//	err := ep.Get(ctx, dst, remoteAddr, key)
//
// Invariants the rest of the project relies on:
//
//   - libucp.so.0 is loaded at run time with dlopen; the few types and
//     constants of UCX's headers that are used are copied into ucp.h, so
//     no UCX headers are needed to build, and binaries start on machines
//     without UCX, where Load reports ErrNoLibrary with how to install it.
//     A symbol the library lacks fails Load with an error naming it. Only
//     calls present from UCX 1.10 on are used (tested with 1.13; the GPU
//     machine has 1.16). The params structs are declared as prefixes of
//     UCX's, padded past their real size; TestABIMatchesUCXHeaders checks
//     the offsets and constants against installed headers.
//
//   - One lock a Context serializes every UCX call on it and on its
//     workers, endpoints, regions and requests: workers are made in UCX's
//     serialized thread mode. Waiting (Get, Serve, Close) progresses the
//     worker under the lock and sleeps outside it, on the worker's event
//     descriptor (ucp_worker_arm, then poll) or, where the transports
//     give none, for a short backoff.
//
//   - Someone must progress the worker of the memory's owner: over
//     transports without remote access in hardware, tcp among them, UCX
//     answers a get in the owner's ucp_worker_progress. Serve does that.
//
//   - Over such transports the owner copies from whatever address a get
//     names, checking neither the key nor the range: any peer that can
//     reach the worker (its address, an IP and a port for tcp, is no
//     secret) can read all of its process's memory, and kill it with an
//     unmapped address (TestPeerBadRequests). Serve only on networks that
//     only trusted nodes reach, from a process that holds nothing else
//     worth reading.
//
//   - Lifetimes nest: Regions and Workers before their Context, Endpoints
//     before their Worker; Close refuses while children are open. Close
//     of an Endpoint ends its Gets in flight with ErrClosed.
//
//   - Get never returns while UCX may still write into dst. UCX cannot
//     cancel a get, so a cancelled Get waits up to a second for its chunks
//     and then closes the endpoint by force (UCX completes them as
//     cancelled); the endpoint is then unusable, and the remote key is
//     left unreleased (UCX warns of it when the worker closes), since UCX
//     wants keys released before their endpoint.
//
//   - Endpoints use UCX's peer error handling: a peer that dies makes its
//     Gets fail (endpoint timeout, connection reset) rather than hang, and
//     the endpoint stays failed; close it and connect again.
//
//   - Every failure is an error naming the call and wrapping a Status,
//     which prints UCX's own description (ucs_status_string).
package ucx
