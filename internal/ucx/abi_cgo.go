//go:build linux && cgo

package ucx

// The layouts of ucp.h, for tests that compare them with real UCX headers.

// #include "ucp.h"
import "C"

import "unsafe"

// abiFacts reports the sizes, offsets and constants of the declarations in
// ucp.h, keyed as testdata/abi_check.c prints them from real headers. For
// the params structs it reports the padded size as "room": the real
// struct must fit in it.
func abiFacts() map[string]int64 {
	var p C.gsucx_params_t
	var wp C.gsucx_worker_params_t
	var ep C.gsucx_ep_params_t
	var mp C.gsucx_mem_map_params_t
	var rp C.gsucx_request_param_t
	var eh C.ucp_err_handler_t
	room := int64(C.GSUCX_PARAMS_SIZE)
	return map[string]int64{
		"sizeof.ucs_status_t":                       int64(unsafe.Sizeof(C.ucs_status_t(0))),
		"room.ucp_params_t":                         room,
		"offsetof.ucp_params_t.field_mask":          int64(unsafe.Offsetof(p.p.field_mask)),
		"offsetof.ucp_params_t.features":            int64(unsafe.Offsetof(p.p.features)),
		"room.ucp_worker_params_t":                  room,
		"offsetof.ucp_worker_params_t.field_mask":   int64(unsafe.Offsetof(wp.p.field_mask)),
		"offsetof.ucp_worker_params_t.thread_mode":  int64(unsafe.Offsetof(wp.p.thread_mode)),
		"sizeof.ucs_thread_mode_t":                  int64(unsafe.Sizeof(wp.p.thread_mode)),
		"room.ucp_ep_params_t":                      room,
		"offsetof.ucp_ep_params_t.field_mask":       int64(unsafe.Offsetof(ep.p.field_mask)),
		"offsetof.ucp_ep_params_t.address":          int64(unsafe.Offsetof(ep.p.address)),
		"offsetof.ucp_ep_params_t.err_mode":         int64(unsafe.Offsetof(ep.p.err_mode)),
		"sizeof.ucp_err_handling_mode_t":            int64(unsafe.Sizeof(ep.p.err_mode)),
		"offsetof.ucp_ep_params_t.err_handler":      int64(unsafe.Offsetof(ep.p.err_handler)),
		"sizeof.ucp_err_handler_t":                  int64(unsafe.Sizeof(eh)),
		"offsetof.ucp_err_handler_t.cb":             int64(unsafe.Offsetof(eh.cb)),
		"offsetof.ucp_err_handler_t.arg":            int64(unsafe.Offsetof(eh.arg)),
		"room.ucp_mem_map_params_t":                 room,
		"offsetof.ucp_mem_map_params_t.field_mask":  int64(unsafe.Offsetof(mp.p.field_mask)),
		"offsetof.ucp_mem_map_params_t.address":     int64(unsafe.Offsetof(mp.p.address)),
		"offsetof.ucp_mem_map_params_t.length":      int64(unsafe.Offsetof(mp.p.length)),
		"room.ucp_request_param_t":                  room,
		"offsetof.ucp_request_param_t.op_attr_mask": int64(unsafe.Offsetof(rp.p.op_attr_mask)),
		"offsetof.ucp_request_param_t.flags":        int64(unsafe.Offsetof(rp.p.flags)),
		"UCS_OK":                                    C.GSUCX_OK,
		"UCS_INPROGRESS":                            C.GSUCX_INPROGRESS,
		"UCS_ERR_NO_ELEM":                           C.GSUCX_ERR_NO_ELEM,
		"UCS_ERR_BUSY":                              C.GSUCX_ERR_BUSY,
		"UCS_ERR_CANCELED":                          C.GSUCX_ERR_CANCELED,
		"UCS_ERR_CONNECTION_RESET":                  C.GSUCX_ERR_CONNECTION_RESET,
		"UCS_ERR_ENDPOINT_TIMEOUT":                  int64(StatusEndpointTimeout),
		"UCS_ERR_LAST":                              C.GSUCX_ERR_LAST,
		"UCP_PARAM_FIELD_FEATURES":                  C.UCP_PARAM_FIELD_FEATURES,
		"UCP_FEATURE_RMA":                           C.UCP_FEATURE_RMA,
		"UCP_FEATURE_WAKEUP":                        C.UCP_FEATURE_WAKEUP,
		"UCP_WORKER_PARAM_FIELD_THREAD_MODE":        C.UCP_WORKER_PARAM_FIELD_THREAD_MODE,
		"UCS_THREAD_MODE_SERIALIZED":                C.UCS_THREAD_MODE_SERIALIZED,
		"UCP_EP_PARAM_FIELD_REMOTE_ADDRESS":         C.UCP_EP_PARAM_FIELD_REMOTE_ADDRESS,
		"UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE":      C.UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE,
		"UCP_EP_PARAM_FIELD_ERR_HANDLER":            C.UCP_EP_PARAM_FIELD_ERR_HANDLER,
		"UCP_ERR_HANDLING_MODE_PEER":                C.UCP_ERR_HANDLING_MODE_PEER,
		"UCP_MEM_MAP_PARAM_FIELD_ADDRESS":           C.UCP_MEM_MAP_PARAM_FIELD_ADDRESS,
		"UCP_MEM_MAP_PARAM_FIELD_LENGTH":            C.UCP_MEM_MAP_PARAM_FIELD_LENGTH,
		"UCP_OP_ATTR_FIELD_FLAGS":                   C.UCP_OP_ATTR_FIELD_FLAGS,
		"UCP_EP_CLOSE_FLAG_FORCE":                   C.UCP_EP_CLOSE_FLAG_FORCE,
		"UCP_API_MAJOR":                             1,
		"UCP_API_MINOR.atleast13":                   1,
	}
}
