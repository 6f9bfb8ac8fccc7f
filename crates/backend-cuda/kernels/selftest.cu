// Kernels that check the emulation itself (tests/cuda/emulator.rs): each has a twin with a planted
// bug that the emulated device must expose, as a GPU would.

// Reverses each block's 64-element slice through shared memory (a write, a barrier, a read).
// flops: none
// ptx: bar.sync, ld.shared.f32
// budget: 32 registers
extern "C" __global__ void selftest_reverse(const float* __restrict__ x, float* __restrict__ out, int sync) {
    SHARED(float, s, [64]);
    const unsigned t = threadIdx.x, base = blockIdx.x * 64;
    s[t] = x[base + t];
    if (sync) __syncthreads();  // `sync` 0: the planted bug, a read before the other threads wrote
    out[base + t] = s[63 - t];
}

// Each lane gets the sum of its warp (a butterfly of shuffles), or reads lane `bad` (a planted bug when
// `bad` is past the warp).
// flops: none
// ptx: shfl.sync.bfly.b32, shfl.sync.idx.b32
// budget: 32 registers
extern "C" __global__ void selftest_warp(const float* __restrict__ x, float* __restrict__ out, int bad) {
    float v = x[threadIdx.x];
    if (bad >= 0) v = __shfl_sync(0xffffffffu, v, bad);
    else v = warp_sum(v);
    out[threadIdx.x] = v;
}

// Half the block waits at `__syncthreads`; the other half exits (`mode` 0: allowed, exited threads
// count as arrived) or waits at `__syncwarp` instead (1: a planted deadlock).
// flops: none
// ptx: bar.sync, bar.warp.sync
// budget: 32 registers
extern "C" __global__ void selftest_diverge(float* __restrict__ out, int mode) {
    if (threadIdx.x < 16) __syncthreads();
    else if (mode == 1) __syncwarp();
    out[threadIdx.x] = 1.0f;
}

// Copies `n` values, or `n + 1` (`plant` 1: the off-by-one a bounds checker must catch). The ASan build
// of the emulated kernels (tests/cuda/asan.rs) runs it on a buffer of exactly `n`.
// flops: none
// ptx: none
// budget: 32 registers
extern "C" __global__ void selftest_copy(const float* __restrict__ x, float* __restrict__ out, unsigned n, int plant) {
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < n + (plant ? 1u : 0u); i += gridDim.x * blockDim.x)
        out[i % n] = x[i];
}

// Each lane reads the next lane's value under `mask` (all 32 lanes: allowed; a mask without some of
// them: a planted bug, since a lane outside the mask takes part).
// flops: none
// ptx: shfl.sync.idx.b32
// budget: 32 registers
extern "C" __global__ void selftest_mask(const float* __restrict__ x, float* __restrict__ out, unsigned mask) {
    const unsigned lane = threadIdx.x % 32;
    out[threadIdx.x] = __shfl_sync(mask, x[threadIdx.x], (lane + 1) % 32);
}

// Block `b` writes `b + 1` to `out[b]`; with `race` 1 it also copies `out[b - 1]` into `out[gridDim.x + b]`,
// trusting block `b - 1` to have run first: a planted inter-block race (blocks run in no order).
// flops: none
// ptx: none
// budget: 32 registers
extern "C" __global__ void selftest_blocks(float* __restrict__ out, int race) {
    if (threadIdx.x != 0) return;
    const unsigned b = blockIdx.x;
    out[b] = (float)(b + 1);
    if (race && b > 0) out[gridDim.x + b] = out[b - 1];
}

// Lanes exchange through shared memory: lane `l` writes `s[l]`, then reads `s[31 − l]`, with the warp
// barrier between when `sync` (without it, a lane may read before its partner wrote: the emulator runs
// lanes in a seeded order and gives unwritten shared memory as poison).
// flops: none
// ptx: bar.warp.sync
// budget: 32 registers
extern "C" __global__ void selftest_syncwarp(const float* __restrict__ x, float* __restrict__ out, int sync) {
    SHARED(float, s, [32]);
    const unsigned l = threadIdx.x % 32;
    s[l] = x[l];
    if (sync) __syncwarp();
    out[l] = s[31 - l];
}

// Each block writes its shared memory then reads it back; with `fresh` 0 only block 0 writes, so the
// others read what no thread of theirs wrote (on a GPU: garbage, or another block's leftovers; here,
// poison).
// flops: none
// ptx: bar.sync
// budget: 32 registers
extern "C" __global__ void selftest_stale(float* __restrict__ out, int fresh) {
    SHARED(float, s, [32]);
    const unsigned t = threadIdx.x;
    if (fresh || blockIdx.x == 0) s[t] = (float)(blockIdx.x + 1);
    __syncthreads();
    out[blockIdx.x * 32 + t] = s[t];
}

// Whether blocks run at once: thread 0 of each block counts the flags set, sets its own, and after the
// block's barrier counts again; `seen[b]` is how many other blocks set theirs while block `b` was alive
// (0 for every block when blocks run one after another).
// flops: none
// ptx: bar.sync
// budget: 40 registers
extern "C" __global__ void selftest_alive(float* __restrict__ flags, float* __restrict__ seen, unsigned blocks) {
    SHARED(float, before, [1]);
    const unsigned b = blockIdx.x;
    if (threadIdx.x == 0) {
        float n = 0.0f;
        for (unsigned i = 0; i < blocks; ++i) n += flags[i];
        before[0] = n;
        flags[b] = 1.0f;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float n = 0.0f;
        for (unsigned i = 0; i < blocks; ++i) n += flags[i];
        seen[b] = n - before[0] - 1.0f;
    }
}
