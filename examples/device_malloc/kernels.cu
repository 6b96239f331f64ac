// Allocation persisting between kernel launches (CUDA C Programming Guide,
// "Dynamic Global Memory Allocation", example 3): the first thread of each
// block mallocs a buffer from the device heap and keeps it in a __device__
// pointer; later launches use it; the last one copies it out and frees it.
//
// The includer defines NUM_BLOCKS. Compiled with NVRTC by
// examples/device_malloc/kernels.rs (the device_malloc example and
// tests/device_heap.rs).

__device__ int* dataptr[NUM_BLOCKS];  // per-block buffer, NULL when malloc failed

// Each block asks for `bytes` (at least blockDim.x ints); a NULL answer is
// counted in *failures and leaves the block without a buffer.
extern "C" __global__ void allocmem(unsigned long long bytes, unsigned int* failures)
{
    if (threadIdx.x == 0) {
        int* p = (int*)malloc(bytes);
        dataptr[blockIdx.x] = p;
        if (p == NULL)
            atomicAdd(failures, 1u);
    }
    __syncthreads();
    int* ptr = dataptr[blockIdx.x];
    if (ptr == NULL)
        return;
    ptr[threadIdx.x] = 0;
}

// Adds the thread's index to its element.
extern "C" __global__ void usemem()
{
    int* ptr = dataptr[blockIdx.x];
    if (ptr != NULL)
        ptr[threadIdx.x] += threadIdx.x;
}

// Copies each block's buffer to out (-1 for blocks without one) and frees it.
extern "C" __global__ void freemem(int* out)
{
    int* ptr = dataptr[blockIdx.x];
    out[blockIdx.x * blockDim.x + threadIdx.x] = ptr != NULL ? ptr[threadIdx.x] : -1;
    __syncthreads();
    if (threadIdx.x == 0) {
        free(ptr);
        dataptr[blockIdx.x] = NULL;
    }
}
