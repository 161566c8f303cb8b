/*
 * gpushm_alloc: a CUDA allocator whose every allocation can be exported as a
 * POSIX file descriptor (CUDA VMM, cuMemCreate), so that memory a program
 * already allocated, PyTorch tensors included, can be published through
 * gpushm without a copy. See docs/allocator.md.
 *
 * The library needs no CUDA toolkit: it loads libcuda.so.1 on first use.
 * All functions are thread-safe. The allocation table lives for the process;
 * nothing here survives fork() (CUDA itself does not).
 */
#ifndef GPUSHM_ALLOC_H
#define GPUSHM_ALLOC_H

#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * PyTorch pluggable-allocator entry points:
 *   torch.cuda.memory.CUDAPluggableAllocator(path, "gpushm_malloc", "gpushm_free")
 *
 * gpushm_malloc returns size bytes (rounded up to the device's VMM
 * granularity, 2 MiB on current GPUs) of pinned memory on device, or NULL
 * (gpushm_last_error says why). In this process the memory is readable and
 * writable from that device and from every device that can access it as a
 * peer (cuDeviceCanAccessPeer), or from that device only when the
 * environment has GPUSHM_PEER_ACCESS=0 (faster; docs/allocator.md). The
 * stream is not used: the memory is ready when the call returns.
 *
 * gpushm_free waits for all work on ptr's device (as cudaFree does: cuMemUnmap
 * does not wait by itself) and then unmaps and releases it. ptr must be a
 * pointer gpushm_malloc returned; size, device and stream are not needed.
 * A failure is written to stderr and to gpushm_last_error.
 */
void *gpushm_malloc(ssize_t size, int device, void *stream);
void gpushm_free(void *ptr, ssize_t size, int device, void *stream);

/*
 * gpushm_export finds the live allocation that contains ptr (any address
 * inside it) and exports it as a new file descriptor, owned by the caller
 * and opened close-on-exec; *base, *alloc_size and *device describe the
 * allocation, so a tensor's offset is ptr - *base. The descriptor keeps the
 * memory allocated until it is closed, even after gpushm_free.
 *
 * Returns 0; a CUresult (> 0) from the driver; -EINVAL for a NULL output
 * pointer; -ENOENT when no live gpushm allocation contains ptr; -EMFILE and
 * the like when the descriptor could not be made close-on-exec.
 */
int gpushm_export(uint64_t ptr, int *fd, uint64_t *base, uint64_t *alloc_size, int *device);

/* Live allocations and their bytes (after rounding); either may be NULL. Returns 0. */
int gpushm_alloc_stats(uint64_t *live_allocations, uint64_t *live_bytes);

/*
 * The last failure on the calling thread, as "cuMemCreate:
 * CUDA_ERROR_OUT_OF_MEMORY (2)"; "" if none. Successful calls leave it
 * alone, as they leave errno.
 */
const char *gpushm_last_error(void);

/*
 * The library also defines cudaMalloc and cudaFree (the CUDA runtime ABI) for
 * LD_PRELOAD. They route to this allocator only when the environment has
 * GPUSHM_PRELOAD=1, and forward to the real runtime otherwise. They are not
 * declared here, so that this header can be included next to
 * cuda_runtime.h.
 */

#ifdef __cplusplus
}
#endif

#endif
