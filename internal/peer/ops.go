package peer

import (
	"context"
	"encoding/json"
)

// Operations every node serves through its Handler. The daemon adds its
// own (pull) the same way: a name, a request and a reply type.
const (
	// OpList: the names this node offers to peers. ListRequest, ListReply.
	OpList = "list"
)

// ListRequest asks a peer for the segments it offers.
type ListRequest struct {
	// Prefix, when set, keeps the names that begin with it.
	Prefix string `json:"prefix,omitempty"`
}

// ListReply is a peer's answer to OpList.
type ListReply struct {
	Offers []Offer `json:"offers"`
}

// Offer describes a segment a node offers to its peers: what a peer needs
// to decide to pull it, and to check what it got.
type Offer struct {
	Name    string          `json:"name"`
	Size    int64           `json:"size"`
	Owner   string          `json:"owner"` // a user name: uids differ between nodes
	Group   string          `json:"group,omitempty"`
	Mode    uint32          `json:"mode"` // permission bits, as a local segment's
	Version uint64          `json:"version"`
	Meta    json.RawMessage `json:"meta,omitempty"`
	// ChunkSize and CRCs: the CRC-32C (Castagnoli) of each ChunkSize bytes
	// in order, when the node knows them (a segment put with checksums, or
	// a durable one); none otherwise.
	ChunkSize int64    `json:"chunk_size,omitempty"`
	CRCs      []uint32 `json:"crcs,omitempty"`
}

// List asks peer for the segments it offers.
func (n *Node) List(ctx context.Context, peer string, req ListRequest) ([]Offer, error) {
	var r ListReply
	if err := n.Call(ctx, peer, OpList, req, &r); err != nil {
		return nil, err
	}
	return r.Offers, nil
}
