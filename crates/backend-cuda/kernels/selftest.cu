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

// The tensor-core primitives against their definitions (tests/cuda/emulator.rs), one warp. `a` (16 rows
// × 16 int8) and `b` (8 columns × 16 int8, a column's 16 values together) go into `mma_s8_16816`'s
// fragments read from global memory by the layouts written above it in common.cuh, and `d` (16 × 8 s32)
// comes out by them; `twin` gets the twin's answer (on a GPU the instruction's and the twin's can
// differ; on the emulated device they are the same code). `rows` (4 matrices × 8 rows × 16 bytes) goes
// through shared memory and `ldmatrix_x4`: `lm [lane][j]` is register `j` of lane `lane`. With `early`
// set, `cp` reads its staged bytes before waiting for them (the emulated device has not copied them yet);
// otherwise after: `cp [0..16)` from a whole 16-byte copy of `rows`, `cp [16..32)` from one that reads 5
// bytes and zero-fills 11, two groups waited for one after the other.
// flops: none
// ptx: mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32, ldmatrix.sync.aligned.m8n8.x4.shared.b16, cp.async.cg.shared.global
// budget: 48 registers
extern "C" __global__ void selftest_mma(const uint8_t* __restrict__ a, const uint8_t* __restrict__ b, int* __restrict__ d,
                                        int* __restrict__ twin, const uint8_t* __restrict__ rows, uint32_t* __restrict__ lm,
                                        uint8_t* __restrict__ cp, int early) {
    SHARED(uint4, stage, [32]);
    SHARED(uint4, copied, [2]);
    const unsigned lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const uint32_t a0 = *(const uint32_t*)(a + g * 16 + 4 * t), a1 = *(const uint32_t*)(a + (g + 8) * 16 + 4 * t);
    const uint32_t b0 = *(const uint32_t*)(b + g * 16 + 4 * t);
    int r[4], s[4];
    mma_s8_16816(r, a0, a1, b0);
    mma_s8_16816_twin(s, a0, a1, b0);
    const unsigned at[4] = {g * 8 + 2 * t, g * 8 + 2 * t + 1, (g + 8) * 8 + 2 * t, (g + 8) * 8 + 2 * t + 1};
    for (unsigned e = 0; e < 4; ++e) {
        d[at[e]] = r[e];
        twin[at[e]] = s[e];
    }
    stage[lane] = *(const uint4*)(rows + lane * 16);
    __syncthreads();
    uint32_t m[4];
    ldmatrix_x4(m, (const uint8_t*)stage + (lane / 8) * 128 + (lane % 8) * 16);
    for (unsigned j = 0; j < 4; ++j) lm[lane * 4 + j] = m[j];
    if (lane == 0) {
        cp_async16(&copied[0], rows, 16);
        cp_async_commit();
        cp_async16(&copied[1], rows + 16, 5);
        cp_async_commit();
        const uint8_t* c = (const uint8_t*)copied;
        if (early) {
            for (unsigned i = 0; i < 32; ++i) cp[i] = c[i];
            cp_async_wait<0>();
        } else {
            cp_async_wait<1>();
            for (unsigned i = 0; i < 16; ++i) cp[i] = c[i];
            cp_async_wait<0>();
            for (unsigned i = 16; i < 32; ++i) cp[i] = c[i];
        }
    }
}
