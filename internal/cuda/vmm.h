// The structures of the CUDA Virtual Memory Management API that gpushm
// passes to the driver (cuMemCreate's properties, cuMemSetAccess's
// descriptors), laid out as cuda.h of CUDA 13.0 (and 12.x) lays them out.
// driver.h and native/gpushm_alloc.c both include it, after declaring the
// scalar and enum types it names; where cuda.h itself is included
// (GPUSHM_CHECK_CUDA_H), only the layout checks remain, against cuda.h's own.
#ifndef GPUSHM_VMM_H
#define GPUSHM_VMM_H
#include <stddef.h>

#ifndef GPUSHM_CHECK_CUDA_H
typedef struct CUmemLocation_st {
	CUmemLocationType type;
	int id;
} CUmemLocation;

typedef struct CUmemAllocationProp_st {
	CUmemAllocationType type;
	CUmemAllocationHandleType requestedHandleTypes;
	CUmemLocation location;
	void *win32HandleMetaData;
	struct {
		unsigned char compressionType;
		unsigned char gpuDirectRDMACapable;
		unsigned short usage;
		unsigned char reserved[4];
	} allocFlags;
} CUmemAllocationProp;

typedef struct CUmemAccessDesc_st {
	CUmemLocation location;
	CUmemAccess_flags flags;
} CUmemAccessDesc;
#endif

// A wrong layout would make the driver read garbage properties or write
// past a descriptor array, so refuse to build if the compiler lays them out
// differently from the LP64 layout of cuda.h.
_Static_assert(sizeof(CUmemLocation) == 8, "CUmemLocation layout");
_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp layout");
_Static_assert(offsetof(CUmemAllocationProp, location) == 8, "CUmemAllocationProp.location");
_Static_assert(offsetof(CUmemAllocationProp, win32HandleMetaData) == 16, "CUmemAllocationProp.win32HandleMetaData");
_Static_assert(offsetof(CUmemAllocationProp, allocFlags) == 24, "CUmemAllocationProp.allocFlags");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc layout");
_Static_assert(offsetof(CUmemAccessDesc, flags) == 8, "CUmemAccessDesc.flags");
_Static_assert(sizeof(CUdeviceptr) == 8 && sizeof(CUmemGenericAllocationHandle) == 8, "64-bit handles");
#endif
