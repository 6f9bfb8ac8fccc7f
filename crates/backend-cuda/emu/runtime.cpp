// The fiber scheduler behind cuda_emu.hpp (see its header comment). A context switch is six
// callee-saved registers and the stack pointer (x86-64 System V): glibc's swapcontext also saves and
// restores the signal mask with a system call each time, which made the emulator spend most of its time
// in the kernel.
#include "cuda_emu.hpp"

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <utility>
#include <vector>

#if !defined(__x86_64__)
#error "the emulated device's context switch is written for x86-64"
#endif

// Saves the callee-saved registers on the current stack, stores its pointer in *from, and resumes the
// context whose stack pointer is `to` (one that `emu_switch` saved, or a fresh one from `fresh_stack`).
extern "C" void emu_switch(void** from, void* to);
asm(R"(
    .text
    .globl emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch
)");

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

namespace emu {

thread_local uint3 thread_idx;
thread_local uint3 block_idx;
thread_local dim3 block_dim;
thread_local dim3 grid_dim;

namespace {

enum class Wait { None, Block, Warp, Done };

// 64 KiB of stack per CUDA thread: kernels keep a few registers' worth of locals.
constexpr std::size_t kStack = 64 * 1024;

// The order blocks run in, and threads between barriers, is seeded and shuffled (a GPU promises neither),
// so a kernel that depends on one fails here as it would on a card. Seed: `OSPREY_EMU_SEED`, else a
// fixed one; each launch of a thread draws the next, so a test's launches replay alike.
uint64_t next_random(uint64_t& s) {
    s += 0x9E3779B97F4A7C15ull;
    uint64_t z = s;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

thread_local uint64_t launch_seed = [] {
    const char* e = std::getenv("OSPREY_EMU_SEED");
    return e ? std::strtoull(e, nullptr, 0) : 0x05B7E7ull;
}();

template <typename T>
void shuffle_in_place(std::vector<T>& v, uint64_t& s) {
    for (std::size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[next_random(s) % i]);
}

struct Fiber {
    void* sp;    // saved stack pointer while suspended
    void* fake;  // AddressSanitizer's fake stack while suspended (ASan builds only)
    uint3 tid;
    uint3 bid;
    unsigned block;  // which of the blocks alive at once
    unsigned local;  // its index in its block
    Wait wait;
    unsigned gen;  // shuffles done: picks one of two exchange buffers
    // Its cp.async copies not yet performed, and the groups it has committed (cuda_emu.hpp).
    std::vector<emu::AsyncCopy> copies;
    unsigned committed;
};

// Blocks alive at once: their threads interleave, each block with its own barriers and shared memory.
constexpr unsigned kAlive = 4;

struct Sched {
    void* main;  // the scheduler's saved stack pointer
    // AddressSanitizer must be told of every stack switch (the ASan build of the emulated kernels):
    // the scheduler's stack bounds and fake stack, learnt at the first switch.
    const void* main_bottom = nullptr;
    std::size_t main_size = 0;
    void* main_fake = nullptr;
    std::vector<Fiber> fibers;
    std::vector<std::unique_ptr<char[]>> stacks;
    std::vector<uint64_t> xchg;  // [blocks alive][warps][2][32]
    unsigned threads = 0;        // per block
    std::size_t cur = 0;
    void (*body)(void*) = nullptr;
    void* arg = nullptr;
    char error[256] = {0};
    bool failed = false;
    // Each alive block's shared memory: (declaration key, its instance).
    std::vector<std::vector<std::pair<const void*, std::vector<unsigned char>>>> shared;
};

thread_local Sched* S = nullptr;
thread_local char last[256];

// From the running fiber back to the scheduler (`dying`: the fiber will never resume).
void yield_to_main(bool dying = false) {
    Fiber& f = S->fibers[S->cur];
#if EMU_ASAN
    __sanitizer_start_switch_fiber(dying ? nullptr : &f.fake, S->main_bottom, S->main_size);
#else
    (void)dying;
#endif
    emu_switch(&f.sp, S->main);
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(f.fake, &S->main_bottom, &S->main_size);
#endif
}

// From the scheduler into fiber `i`.
void resume(std::size_t i, char* stack) {
#if EMU_ASAN
    __sanitizer_start_switch_fiber(&S->main_fake, stack, kStack);
#else
    (void)stack;
#endif
    emu_switch(&S->main, S->fibers[i].sp);
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(S->main_fake, nullptr, nullptr);
#endif
}

// Where a fiber starts: runs the kernel body, then gives control back for good.
[[noreturn]] void fiber_entry() {
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &S->main_bottom, &S->main_size);
#endif
    S->body(S->arg);
    S->fibers[S->cur].wait = Wait::Done;
    yield_to_main(true);
    __builtin_unreachable();  // a finished fiber is never resumed
}

// A stack pointer that `emu_switch` resumes into `fiber_entry`: six zeroed registers, then the entry as
// the return address, with the stack aligned as at a call (rsp ≡ 8 mod 16 on entry).
void* fresh_stack(char* base, std::size_t size) {
    auto top = reinterpret_cast<std::uintptr_t>(base + size) & ~static_cast<std::uintptr_t>(15);
    auto* sp = reinterpret_cast<void**>(top - 64);
    for (int i = 0; i < 6; ++i) sp[i] = nullptr;
    sp[6] = reinterpret_cast<void*>(&fiber_entry);
    sp[7] = nullptr;
    return sp;
}

void fail(const char* msg) {
    S->failed = true;
    std::snprintf(S->error, sizeof S->error, "%s", msg);
}

// Releases what can be released in the block whose fibers are `[b0, b0 + n)` after every runnable fiber
// has run: whole warps waiting at a warp barrier, else the block at `__syncthreads` once every live
// thread waits there. False: nothing could move.
bool release(unsigned b0, unsigned n) {
    bool any = false;
    for (unsigned w = 0; w * 32 < n; ++w) {
        unsigned end = (w + 1) * 32 < n ? (w + 1) * 32 : n;
        bool all = true, some = false;
        for (unsigned i = b0 + w * 32; i < b0 + end; ++i) {
            Wait s = S->fibers[i].wait;
            if (s == Wait::Warp) some = true;
            else if (s != Wait::Done) all = false;
        }
        if (some && all) {
            for (unsigned i = b0 + w * 32; i < b0 + end; ++i)
                if (S->fibers[i].wait == Wait::Warp) S->fibers[i].wait = Wait::None;
            any = true;
        }
    }
    if (any) return true;
    bool all = true, some = false;
    for (unsigned i = b0; i < b0 + n; ++i) {
        Wait s = S->fibers[i].wait;
        if (s == Wait::Block) some = true;
        else if (s != Wait::Done) all = false;
    }
    if (some && all) {
        for (unsigned i = b0; i < b0 + n; ++i)
            if (S->fibers[i].wait == Wait::Block) S->fibers[i].wait = Wait::None;
        return true;
    }
    return false;
}

// Runs `blocks` (at most kAlive) at once, `n` threads each: every thread a fiber, all of them in one
// seeded shuffled order between barriers, so the blocks' threads interleave.
bool run_blocks(const std::vector<uint3>& blocks, unsigned n) {
    const unsigned bx = block_dim.x, by = block_dim.y, k = static_cast<unsigned>(blocks.size());
    const std::size_t total = static_cast<std::size_t>(k) * n;
    while (S->stacks.size() < total) S->stacks.emplace_back(new char[kStack]);
    S->fibers.assign(total, Fiber{});
    S->threads = n;
    S->xchg.assign(k * ((n + 31) / 32) * 64, 0);
    S->shared.assign(k, {});  // fresh, poisoned instances per block (`shared`)
    for (unsigned b = 0; b < k; ++b)
        for (unsigned i = 0; i < n; ++i) {
            Fiber& f = S->fibers[b * n + i];
            f.tid = uint3{i % bx, (i / bx) % by, i / (bx * by)};
            f.bid = blocks[b];
            f.block = b;
            f.local = i;
            f.wait = Wait::None;
            f.copies.clear();
            f.committed = 0;
            f.sp = fresh_stack(S->stacks[b * n + i].get(), kStack);
        }
    std::vector<unsigned> order(total);
    for (unsigned i = 0; i < total; ++i) order[i] = i;
    uint64_t seed = next_random(launch_seed);
    for (;;) {
        bool ran = false, live = false, moved = false;
        shuffle_in_place(order, seed);
        for (unsigned i : order) {
            if (S->fibers[i].wait != Wait::None) continue;
            ran = true;
            S->cur = i;
            thread_idx = S->fibers[i].tid;
            block_idx = S->fibers[i].bid;
            resume(i, S->stacks[i].get());
            if (S->failed) return false;
        }
        for (std::size_t i = 0; i < total; ++i) live |= S->fibers[i].wait != Wait::Done;
        if (!live) return true;
        for (unsigned b = 0; b < k; ++b) moved |= release(b * n, n);
        if (!moved && !ran) {
            fail("deadlock: threads wait at barriers that the others never reach (divergent __syncthreads/__syncwarp)");
            return false;
        }
    }
}

}  // namespace

void async_copy(void* dst, const void* src, unsigned bytes, unsigned src_bytes) {
    Fiber& me = S->fibers[S->cur];
    me.copies.push_back(AsyncCopy{static_cast<unsigned char*>(dst), static_cast<const unsigned char*>(src), bytes,
                                  src_bytes, me.committed});
}

void async_commit() { ++S->fibers[S->cur].committed; }

std::vector<AsyncCopy> async_ready(unsigned kept) {
    Fiber& me = S->fibers[S->cur];
    std::vector<AsyncCopy> ready, waiting;
    for (const AsyncCopy& c : me.copies) (c.group + kept < me.committed ? ready : waiting).push_back(c);
    me.copies = std::move(waiting);
    return ready;
}

void syncthreads() {
    S->fibers[S->cur].wait = Wait::Block;
    yield_to_main();
}

void syncwarp() {
    S->fibers[S->cur].wait = Wait::Warp;
    yield_to_main();
}

unsigned lane_id() { return S->fibers[S->cur].local % 32; }

[[noreturn]] void fault(const char* msg) {
    fail(msg);
    S->fibers[S->cur].wait = Wait::Done;
    yield_to_main(true);
    __builtin_unreachable();  // the scheduler never resumes a faulted fiber
}

void* shared(const void* key, std::size_t bytes) {
    auto& mine = S->shared[S->fibers[S->cur].block];
    for (auto& [k, mem] : mine)
        if (k == key) return mem.data();
    mine.emplace_back(key, std::vector<unsigned char>(bytes, 0xFF));
    return mine.back().second.data();
}

uint64_t exchange(uint64_t mine, unsigned src) {
    Fiber& me = S->fibers[S->cur];
    const std::size_t warp = me.local / 32, lane = me.local % 32;
    const std::size_t n = S->threads, warps = (n + 31) / 32;
    const std::size_t lanes = (warp + 1) * 32 <= n ? 32 : n - warp * 32;
    if (src >= lanes) fault("a shuffle read a lane that does not exist in its warp");
    const std::size_t buf = ((me.block * warps + warp) * 2 + (me.gen++ & 1)) * 32;
    S->xchg[buf + lane] = mine;
    syncwarp();  // every lane has deposited
    return S->xchg[buf + src];
}

int run(const Launch* l, void (*body)(void*), void* arg) {
    thread_local Sched sched;
    Sched* outer = S;
    S = &sched;
    S->body = body;
    S->arg = arg;
    S->failed = false;
    grid_dim = dim3{l->grid[0], l->grid[1], l->grid[2]};
    block_dim = dim3{l->block[0], l->block[1], l->block[2]};
    const unsigned n = l->block[0] * l->block[1] * l->block[2];
    int rc = 0;
    if (n == 0 || n > 1024) {
        fail("a block has 1 to 1024 threads");
        rc = 1;
    }
    std::vector<uint3> blocks;
    for (unsigned z = 0; rc == 0 && z < l->grid[2]; ++z)
        for (unsigned y = 0; y < l->grid[1]; ++y)
            for (unsigned x = 0; x < l->grid[0]; ++x) blocks.push_back(uint3{x, y, z});
    uint64_t seed = next_random(launch_seed);
    shuffle_in_place(blocks, seed);
    for (std::size_t b0 = 0; b0 < blocks.size(); b0 += kAlive) {
        const std::size_t b1 = b0 + kAlive < blocks.size() ? b0 + kAlive : blocks.size();
        if (!run_blocks(std::vector<uint3>(blocks.begin() + b0, blocks.begin() + b1), n)) {
            rc = 1;
            break;
        }
    }
    if (rc) std::snprintf(last, sizeof last, "%s", S->error);
    S = outer;
    return rc;
}

const char* last_error() { return last; }

}  // namespace emu

extern "C" const char* osprey_emu_last_error() { return emu::last_error(); }
