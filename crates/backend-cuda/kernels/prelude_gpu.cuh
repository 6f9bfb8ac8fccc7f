// Prepended to every kernel source NVRTC compiles (the host build gets emu/cuda_emu.hpp instead).
// Kernels are header-free: NVRTC finds no CUDA header without a toolkit, so the fixed-width types are
// declared here and bf16 / f16 / e4m3 / e2m1 are converted with bit operations (common.cuh).
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned long long uint64_t;
typedef long long int64_t;
#define OSPREY_GPU 1
// Shared memory: `SHARED(float, red, [32]);` is `__shared__ float red[32];` here; the emulated device
// gives each block its own instance, poisoned on entry (emu/cuda_emu.hpp).
#define SHARED(T, name, dims) __shared__ T name dims
