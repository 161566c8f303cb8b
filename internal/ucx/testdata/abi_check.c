// Prints the layouts and constants that ucp.h copies from UCX's headers, as
// the real headers define them, one "key value" per line. The keys match
// abiFacts; TestABIMatchesUCXHeaders compiles this against installed UCX
// headers and compares the two. For each params struct it prints "room"
// as 1 when the real struct fits in the padded copy (512 bytes).
#include <stddef.h>
#include <stdio.h>
#include <ucp/api/ucp.h>

#define SIZE(t) printf("sizeof.%s %zu\n", #t, sizeof(t))
#define OFF(t, f) printf("offsetof.%s.%s %zu\n", #t, #f, offsetof(t, f))
#define ROOM(t) printf("room.%s %d\n", #t, sizeof(t) <= 512 ? 512 : (int)sizeof(t))
#define CONST(c) printf("%s %lld\n", #c, (long long)(c))

int main(void) {
	ucp_ep_params_t ep;

	SIZE(ucs_status_t);
	ROOM(ucp_params_t);
	OFF(ucp_params_t, field_mask);
	OFF(ucp_params_t, features);
	ROOM(ucp_worker_params_t);
	OFF(ucp_worker_params_t, field_mask);
	OFF(ucp_worker_params_t, thread_mode);
	SIZE(ucs_thread_mode_t);
	ROOM(ucp_ep_params_t);
	OFF(ucp_ep_params_t, field_mask);
	OFF(ucp_ep_params_t, address);
	OFF(ucp_ep_params_t, err_mode);
	printf("sizeof.ucp_err_handling_mode_t %zu\n", sizeof ep.err_mode);
	OFF(ucp_ep_params_t, err_handler);
	SIZE(ucp_err_handler_t);
	OFF(ucp_err_handler_t, cb);
	OFF(ucp_err_handler_t, arg);
	ROOM(ucp_mem_map_params_t);
	OFF(ucp_mem_map_params_t, field_mask);
	OFF(ucp_mem_map_params_t, address);
	OFF(ucp_mem_map_params_t, length);
	ROOM(ucp_request_param_t);
	OFF(ucp_request_param_t, op_attr_mask);
	OFF(ucp_request_param_t, flags);
	CONST(UCS_OK);
	CONST(UCS_INPROGRESS);
	CONST(UCS_ERR_NO_ELEM);
	CONST(UCS_ERR_BUSY);
	CONST(UCS_ERR_CANCELED);
	CONST(UCS_ERR_CONNECTION_RESET);
	CONST(UCS_ERR_ENDPOINT_TIMEOUT);
	CONST(UCS_ERR_LAST);
	CONST(UCP_PARAM_FIELD_FEATURES);
	CONST(UCP_FEATURE_RMA);
	CONST(UCP_FEATURE_WAKEUP);
	CONST(UCP_WORKER_PARAM_FIELD_THREAD_MODE);
	CONST(UCS_THREAD_MODE_SERIALIZED);
	CONST(UCP_EP_PARAM_FIELD_REMOTE_ADDRESS);
	CONST(UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE);
	CONST(UCP_EP_PARAM_FIELD_ERR_HANDLER);
	CONST(UCP_ERR_HANDLING_MODE_PEER);
	CONST(UCP_MEM_MAP_PARAM_FIELD_ADDRESS);
	CONST(UCP_MEM_MAP_PARAM_FIELD_LENGTH);
	CONST(UCP_OP_ATTR_FIELD_FLAGS);
	CONST(UCP_EP_CLOSE_FLAG_FORCE);
	// ucp_init_version is called with API version 1.13 (ucp.h); a header
	// older than that would mean the declarations come from a newer API.
	CONST(UCP_API_MAJOR);
	printf("UCP_API_MINOR.atleast13 %d\n", UCP_API_MAJOR > 1 || UCP_API_MINOR >= 13);
	return 0;
}
