// The global-memory traffic of emulated launches, for the speed model (`osprey bench roofline`, issue 51).
// build.rs compiles the kernel translation units with `-fsanitize=thread`: the compiler then calls
// `__tsan_readN(addr)` / `__tsan_writeN(addr)` before every load and store it keeps, and this file — not
// ThreadSanitizer's runtime, which is never linked — defines those hooks. The NVRTC build is unchanged.
//
// While a launch is measured, an access inside a registered device allocation marks its 32-byte sectors
// (a GPU's DRAM transaction) in a per-launch bitmap; accesses elsewhere (a fiber's stack, `__shared__`
// statics) are not global memory and are ignored. A launch's bytes are its distinct sectors read and
// written — what DRAM serves if the caches catch every reuse within the launch, the roofline's
// assumption — and its raw bytes count every access. A window (the work between two host waits) sums
// the distinct sectors of all its launches once: the bytes a step must move at the least.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

namespace {

struct Bits {
    std::vector<uint64_t> w;
    void set(std::size_t i) { w[i >> 6] |= 1ull << (i & 63); }
    uint64_t count() const {
        uint64_t n = 0;
        for (uint64_t x : w) n += static_cast<uint64_t>(__builtin_popcountll(x));
        return n;
    }
};

struct Region {
    uintptr_t base = 0, end = 0;
    // Sectors read and written by the launch under way, and by the window under way.
    Bits launch_rd, launch_wr, window_rd, window_wr;
    bool in_launch = false, in_window = false;
    void size(Bits& b) {
        if (b.w.empty()) b.w.assign(((end - base + 31) / 32 + 63) / 64, 0);
    }
};

struct Traffic {
    std::map<uintptr_t, std::unique_ptr<Region>> regions;  // by base
    std::vector<Region*> launch_touched, window_touched;
    Region* last = nullptr;
    uint64_t raw_rd = 0, raw_wr = 0;
    // Distinct bytes of closed windows, and of regions freed inside the window under way.
    uint64_t window_done_rd = 0, window_done_wr = 0;

    Region* find(uintptr_t p) {
        if (last && p >= last->base && p < last->end) return last;
        auto it = regions.upper_bound(p);
        if (it == regions.begin()) return nullptr;
        --it;
        Region* r = it->second.get();
        if (p >= r->end) return nullptr;
        last = r;
        return r;
    }

    void mark(uintptr_t p, std::size_t n, bool write) {
        (write ? raw_wr : raw_rd) += n;
        Region* r = find(p);
        if (!r) return;
        if (!r->in_launch) {
            r->in_launch = true;
            r->size(r->launch_rd);
            r->size(r->launch_wr);
            launch_touched.push_back(r);
        }
        Bits& b = write ? r->launch_wr : r->launch_rd;
        const uintptr_t last_byte = p + n - 1 < r->end ? p + n - 1 : r->end - 1;
        for (uintptr_t s = (p - r->base) / 32; s <= (last_byte - r->base) / 32; ++s) b.set(s);
    }

    // Ends a launch: its distinct sectors, merged into the window's.
    void end_launch(uint64_t out[4]) {
        uint64_t rd = 0, wr = 0;
        for (Region* r : launch_touched) {
            rd += r->launch_rd.count();
            wr += r->launch_wr.count();
            if (!r->in_window) {
                r->in_window = true;
                r->size(r->window_rd);
                r->size(r->window_wr);
                window_touched.push_back(r);
            }
            for (std::size_t i = 0; i < r->launch_rd.w.size(); ++i) {
                r->window_rd.w[i] |= r->launch_rd.w[i];
                r->window_wr.w[i] |= r->launch_wr.w[i];
                r->launch_rd.w[i] = r->launch_wr.w[i] = 0;
            }
            r->in_launch = false;
        }
        launch_touched.clear();
        out[0] = rd * 32, out[1] = wr * 32, out[2] = raw_rd, out[3] = raw_wr;
        raw_rd = raw_wr = 0;
    }

    void close_region(Region* r) {
        window_done_rd += r->window_rd.count() * 32;
        window_done_wr += r->window_wr.count() * 32;
        r->window_rd.w.clear();
        r->window_wr.w.clear();
        r->in_window = false;
    }

    void close_window() {
        for (Region* r : window_touched) close_region(r);
        window_touched.clear();
    }
};

thread_local Traffic* current = nullptr;

inline void note(const void* p, std::size_t n, bool write) {
    if (current) current->mark(reinterpret_cast<uintptr_t>(p), n, write);
}

}  // namespace

extern "C" {

// The hooks `-fsanitize=thread` calls (see the header comment).
void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_read1(void* p) { note(p, 1, false); }
void __tsan_read2(void* p) { note(p, 2, false); }
void __tsan_read4(void* p) { note(p, 4, false); }
void __tsan_read8(void* p) { note(p, 8, false); }
void __tsan_read16(void* p) { note(p, 16, false); }
void __tsan_write1(void* p) { note(p, 1, true); }
void __tsan_write2(void* p) { note(p, 2, true); }
void __tsan_write4(void* p) { note(p, 4, true); }
void __tsan_write8(void* p) { note(p, 8, true); }
void __tsan_write16(void* p) { note(p, 16, true); }
void __tsan_unaligned_read2(void* p) { note(p, 2, false); }
void __tsan_unaligned_read4(void* p) { note(p, 4, false); }
void __tsan_unaligned_read8(void* p) { note(p, 8, false); }
void __tsan_unaligned_read16(void* p) { note(p, 16, false); }
void __tsan_unaligned_write2(void* p) { note(p, 2, true); }
void __tsan_unaligned_write4(void* p) { note(p, 4, true); }
void __tsan_unaligned_write8(void* p) { note(p, 8, true); }
void __tsan_unaligned_write16(void* p) { note(p, 16, true); }
void __tsan_read_range(void* p, unsigned long n) { note(p, n, false); }
void __tsan_write_range(void* p, unsigned long n) { note(p, n, true); }
void __tsan_vptr_read(void**) {}
void __tsan_vptr_update(void**, void*) {}

void* osprey_emu_traffic_new() { return new Traffic(); }
void osprey_emu_traffic_drop(void* t) { delete static_cast<Traffic*>(t); }

// A device allocation made (`live` 1) or freed (0).
void osprey_emu_traffic_region(void* t, uint64_t base, uint64_t len, int live) {
    auto* tr = static_cast<Traffic*>(t);
    if (live) {
        auto r = std::make_unique<Region>();
        r->base = base, r->end = base + len;
        tr->regions[base] = std::move(r);
        return;
    }
    auto it = tr->regions.find(base);
    if (it == tr->regions.end()) return;
    Region* r = it->second.get();
    if (r->in_window) {
        tr->close_region(r);
        tr->window_touched.erase(std::remove(tr->window_touched.begin(), tr->window_touched.end(), r), tr->window_touched.end());
    }
    if (tr->last == r) tr->last = nullptr;
    tr->regions.erase(it);
}

// Measures the launches that follow on this thread until `osprey_emu_traffic_end`.
void osprey_emu_traffic_begin(void* t) { current = static_cast<Traffic*>(t); }

// An access the device makes outside a kernel (a copy, a memset, an emulated cuBLAS GEMM), between
// `begin` and `end`.
void osprey_emu_traffic_touch(void* t, uint64_t p, uint64_t len, int write) {
    if (len) static_cast<Traffic*>(t)->mark(p, len, write != 0);
}

// Ends what `begin` started: distinct bytes read and written, raw bytes read and written.
void osprey_emu_traffic_end(void* t, uint64_t out[4]) {
    static_cast<Traffic*>(t)->end_launch(out);
    current = nullptr;
}

// Closes the window under way (a host wait); returns the distinct bytes read and written by every window
// closed so far.
void osprey_emu_traffic_window(void* t, uint64_t out[2]) {
    auto* tr = static_cast<Traffic*>(t);
    tr->close_window();
    out[0] = tr->window_done_rd, out[1] = tr->window_done_wr;
}

}  // extern "C"
