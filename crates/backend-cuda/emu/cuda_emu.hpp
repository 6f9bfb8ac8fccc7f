// The CUDA execution model for the host compiler: the same kernel bodies NVRTC compiles for a GPU run
// here on the CPU, so every CI run checks what they compute. Each thread of a block is a fiber (its own
// stack, switched by saving six registers) on one OS thread; `__syncthreads` and `__syncwarp` suspend a
// fiber until every live thread of its block (or warp) has arrived, and shuffles exchange values through a per-warp array between two
// warp barriers. Blocks run one after another, in a seeded shuffled order, and a block's threads run in a
// seeded shuffled order between barriers (a GPU promises neither order; runtime.cpp); each block has its
// own shared memory, poisoned when it starts (`SHARED`). A barrier some threads never reach
// (divergence), a shuffle from a lane that does not exist and a shuffle with a lane outside its mask fail
// the launch with a message instead of hanging or reading garbage.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

struct uint3 {
    unsigned x, y, z;
};

struct dim3 {
    unsigned x, y, z;
};

// The vector types the kernels load and store whole (16 and 8 bytes, aligned as a GPU requires).
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
struct alignas(8) float2 {
    float x, y;
};

namespace emu {

// Grid and block sizes of one launch (the C side of the Rust `LaunchConfig`).
struct Launch {
    unsigned grid[3];
    unsigned block[3];
};

extern thread_local uint3 thread_idx;
extern thread_local uint3 block_idx;
extern thread_local dim3 block_dim;
extern thread_local dim3 grid_dim;

void syncthreads();
void syncwarp();
// The 8-byte value of lane `src` of the calling warp, after every live lane has deposited its own.
uint64_t exchange(uint64_t mine, unsigned src);
unsigned lane_id();
// Fails the running launch with `msg` (the fiber does not resume).
[[noreturn]] void fault(const char* msg);
// The running block's instance of shared declaration `key`, `bytes` long (see `SHARED`).
void* shared(const void* key, std::size_t bytes);

// One cp.async copy queued by a thread: `bytes` to shared `dst` from global `src`, of which the first
// `src_bytes` are read and the rest zero-filled; `group` is the thread's commit group it belongs to.
struct AsyncCopy {
    unsigned char* dst;
    const unsigned char* src;
    unsigned bytes, src_bytes, group;
};
// The running thread's cp.async queue (runtime.cpp): queue a copy, close a group, and take the copies
// of every committed group but the `kept` newest (cp.async.wait_group `kept`), to be performed.
void async_copy(void* dst, const void* src, unsigned bytes, unsigned src_bytes);
void async_commit();
std::vector<AsyncCopy> async_ready(unsigned kept);

// Runs `body(arg)` as every thread of the grid; 0, or a nonzero code with `last_error()` set.
int run(const Launch* l, void (*body)(void*), void* arg);
const char* last_error();

template <typename T>
T shuffle(T v, unsigned src) {
    static_assert(sizeof(T) <= 8, "a shuffled value fits 8 bytes");
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    uint64_t got = exchange(bits, src);
    T out;
    std::memcpy(&out, &got, sizeof(T));
    return out;
}

template <typename... A, std::size_t... I>
void call(void (*k)(A...), void** p, std::index_sequence<I...>) {
    k(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(p[I])...);
}

// A launch of kernel `k` with `cuLaunchKernel`'s parameter array: `p[i]` points at argument `i`.
template <typename... A>
int launch(void (*k)(A...), const Launch* l, void** p) {
    struct Ctx {
        void (*k)(A...);
        void** p;
    } c{k, p};
    return run(
        l, [](void* a) {
            auto* c = static_cast<Ctx*>(a);
            call(c->k, c->p, std::index_sequence_for<A...>{});
        },
        &c);
}

}  // namespace emu

#define threadIdx emu::thread_idx
#define blockIdx emu::block_idx
#define blockDim emu::block_dim
#define gridDim emu::grid_dim
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
// `SHARED(T, name, dims)` (the kernels' shared memory, `__shared__ T name dims` for NVRTC): the running
// block's own instance of the declaration, poisoned with 0xFF bytes (NaN, −1) when the block starts, so a
// kernel that reads what its block did not write — left by another block, or not yet written — reads
// poison, as a GPU would give it garbage. A static key per declaration names the instance.
#define SHARED(T, name, dims)                  \
    static const char emu_shared_##name = 0; \
    T(&name) dims = *static_cast<T(*) dims>(emu::shared(&emu_shared_##name, sizeof(T dims)))
#define __syncthreads() emu::syncthreads()
#define __syncwarp(...) emu::syncwarp()

namespace emu {
// A shuffle's mask names the lanes that take part: the calling lane and the lane it reads must be in it
// (on a GPU, reading a lane outside the mask is undefined).
inline void check_mask(unsigned mask, unsigned src) {
    const unsigned me = lane_id();
    if (!((mask >> me) & 1u) || src >= 32 || !((mask >> src) & 1u)) fault("a shuffle with a lane outside its mask");
}
}  // namespace emu
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    (void)width;
    const unsigned src = emu::lane_id() ^ static_cast<unsigned>(lane_mask);
    emu::check_mask(mask, src);
    return emu::shuffle(v, src);
}
template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    (void)width;
    emu::check_mask(mask, static_cast<unsigned>(src));
    return emu::shuffle(v, static_cast<unsigned>(src));
}
inline float __int_as_float(int v) {
    float f;
    std::memcpy(&f, &v, 4);
    return f;
}
inline int __float_as_int(float f) {
    int v;
    std::memcpy(&v, &f, 4);
    return v;
}
inline unsigned __float_as_uint(float f) {
    unsigned v;
    std::memcpy(&v, &f, 4);
    return v;
}
inline float __uint_as_float(unsigned v) {
    float f;
    std::memcpy(&f, &v, 4);
    return f;
}
inline double __longlong_as_double(long long v) {
    double d;
    std::memcpy(&d, &v, 8);
    return d;
}
inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
// A load of a `T` from an address not aligned to its size faults on a GPU ("misaligned address"); here
// too, so a vector load the host lays out wrongly fails on the emulated device as it would on a card.
template <typename T>
inline T __ldg(const T* p) {
    if (reinterpret_cast<std::uintptr_t>(p) % alignof(T) != 0) emu::fault("a misaligned load");
    return *p;
}
// `__byte_perm(x, y, s)` (PTX `prmt.b32`, as NVRTC emits it: selectors masked to 3 bits): byte `n` of the
// result is byte `(s >> 4n) & 7` of the eight bytes of `x` (0..3) and `y` (4..7).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const uint64_t both = (static_cast<uint64_t>(y) << 32) | x;
    unsigned out = 0;
    for (unsigned n = 0; n < 4; ++n) out |= static_cast<unsigned>((both >> (8 * ((s >> (4 * n)) & 7u))) & 0xffu) << (8 * n);
    return out;
}
// cp.async (sm_80+) on the emulated device: a copy is queued, not made, and made when the thread waits
// for its group (`cp_async_wait<N>`), so a kernel that reads its staged tile before waiting for it reads
// what was there before, as a GPU may give it. Addresses must be aligned to the copy's size (a GPU
// faults otherwise). The source is read here, in the kernel's translation unit, so the traffic meter
// counts it.
inline void cp_async_n(void* dst, const void* src, unsigned bytes, unsigned src_bytes) {
    if (reinterpret_cast<std::uintptr_t>(dst) % bytes != 0 || reinterpret_cast<std::uintptr_t>(src) % bytes != 0)
        emu::fault("a misaligned cp.async");
    emu::async_copy(dst, src, bytes, src_bytes);
}
inline void cp_async16(void* dst, const void* src, unsigned src_bytes) { cp_async_n(dst, src, 16, src_bytes); }
inline void cp_async8(void* dst, const void* src, unsigned src_bytes) { cp_async_n(dst, src, 8, src_bytes); }
inline void cp_async_commit() { emu::async_commit(); }
template <int N>
inline void cp_async_wait() {
    for (const emu::AsyncCopy& c : emu::async_ready(N))
        for (unsigned i = 0; i < c.bytes; ++i) c.dst[i] = i < c.src_bytes ? c.src[i] : 0;
}
// `__dp4a(a, b, c)` (PTX `dp4a.s32.s32`): `c` plus the four products of the signed bytes of `a` and `b`,
// wrapping as the hardware's 32-bit sum does.
inline int __dp4a(int a, int b, int c) {
    int64_t s = c;
    for (unsigned n = 0; n < 4; ++n) s += static_cast<int8_t>(a >> (8 * n)) * static_cast<int8_t>(b >> (8 * n));
    return static_cast<int>(static_cast<uint32_t>(s));
}
// Threads of several blocks interleave, but only at barriers and shuffles (a fiber never yields inside
// a call), so this read-modify-write is indivisible as a GPU's atomic is; what a non-atomic `+=` across
// a barrier would lose shows (the blocks interleave). No kernel uses it yet.
inline float atomicAdd(float* p, float v) {
    float old = *p;
    *p = old + v;
    return old;
}
#include <math.h>  // expf, sqrtf, tanhf, erff … at global scope, as a GPU kernel names them
