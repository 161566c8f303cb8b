// Prints the layouts and constants that cuda_cgo.go copies from cuda.h, as
// the real header defines them, one "key value" per line. The keys match
// abiFacts; TestABIMatchesCudaHeader compiles this against an installed
// CUDA toolkit and compares the two.
#include <stddef.h>
#include <stdio.h>
#include <cuda.h>

#define SIZE(t) printf("sizeof.%s %zu\n", #t, sizeof(t))
#define OFF(t, f) printf("offsetof.%s.%s %zu\n", #t, #f, offsetof(t, f))
#define FLAGOFF(f) printf("offsetof.allocFlags.%s %zu\n", #f, \
	offsetof(CUmemAllocationProp, allocFlags.f) - offsetof(CUmemAllocationProp, allocFlags))
#define CONST(c) printf("%s %lld\n", #c, (long long)(c))

int main(void) {
	CUmemAllocationProp p;
	CUmemAccessDesc a;

	SIZE(CUresult);
	SIZE(CUdevice);
	SIZE(CUdeviceptr);
	SIZE(CUmemGenericAllocationHandle);
	SIZE(CUuuid);
	SIZE(CUmemLocation);
	OFF(CUmemLocation, type);
	OFF(CUmemLocation, id);
	SIZE(CUmemAllocationProp);
	OFF(CUmemAllocationProp, type);
	OFF(CUmemAllocationProp, requestedHandleTypes);
	OFF(CUmemAllocationProp, location);
	OFF(CUmemAllocationProp, win32HandleMetaData);
	OFF(CUmemAllocationProp, allocFlags);
	printf("sizeof.CUmemAllocationProp.allocFlags %zu\n", sizeof p.allocFlags);
	FLAGOFF(gpuDirectRDMACapable);
	FLAGOFF(usage);
	FLAGOFF(reserved);
	SIZE(CUmemAccessDesc);
	OFF(CUmemAccessDesc, location);
	OFF(CUmemAccessDesc, flags);
	printf("sizeof.CUmemAccess_flags %zu\n", sizeof a.flags);
	printf("sizeof.CUmemAllocationHandleType %zu\n", sizeof p.requestedHandleTypes);
	CONST(CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED);
	CONST(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED);
	CONST(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
	CONST(CU_MEM_HANDLE_TYPE_FABRIC);
	CONST(CU_MEM_ACCESS_FLAGS_PROT_READ);
	CONST(CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
	CONST(CU_MEM_LOCATION_TYPE_DEVICE);
	CONST(CU_MEM_ALLOCATION_TYPE_PINNED);
	CONST(CU_MEM_ALLOC_GRANULARITY_MINIMUM);
	CONST(CU_STREAM_NON_BLOCKING);
	CONST(CU_EVENT_DEFAULT);
	CONST(CU_EVENT_BLOCKING_SYNC);
	CONST(CU_EVENT_DISABLE_TIMING);
	return 0;
}
