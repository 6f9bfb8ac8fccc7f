// The emulated kernels under AddressSanitizer and UBSan (tests/cuda/asan.rs builds and runs this): every
// kernel source in one translation unit, a launch of each family of kernels on buffers of exactly the
// size the kernel may touch, on odd shapes. An out-of-bounds read or write, or undefined behaviour,
// aborts with the sanitizer's report. `plant` runs a kernel with a planted off-by-one, which must abort.
#include "cuda_emu.hpp"
#include "common.cuh"

#include "attention.cu"
#include "delta_chunked.cu"
#include "elementwise.cu"
#include "gemm_q8.cu"
#include "linear.cu"
#include "linear_q8.cu"
#include "memory.cu"
#include "moe.cu"
#include "norm.cu"
#include "qwen4.cu"
#include "recurrent.cu"
#include "rope.cu"
#include "route.cu"
#include "sample.cu"
#include "selftest.cu"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

template <typename... A, std::size_t... I>
void launch_tuple(void (*k)(A...), const emu::Launch& l, std::tuple<A...>& vals, std::index_sequence<I...>) {
    void* p[sizeof...(A) + 1] = {static_cast<void*>(&std::get<I>(vals))...};
    if (emu::launch(k, &l, p) != 0) {
        std::fprintf(stderr, "launch failed: %s\n", emu::last_error());
        std::exit(2);
    }
}

// Launches `k` on `grid` blocks of `block` threads with `args` converted to its parameter types.
template <typename... A, typename... B>
void run(void (*k)(A...), dim3 grid, dim3 block, B... args) {
    std::tuple<A...> vals(static_cast<A>(args)...);
    emu::Launch l{{grid.x, grid.y, grid.z}, {block.x, block.y, block.z}};
    launch_tuple(k, l, vals, std::index_sequence_for<A...>{});
}

std::vector<float> vals(std::size_t n, float scale = 1.0f) {
    std::vector<float> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = scale * (static_cast<float>((i * 2654435761u) % 1000) / 500.0f - 1.0f);
    return v;
}

const dim3 one{1, 1, 1};
dim3 d1(unsigned x) { return dim3{x, 1, 1}; }

}  // namespace

int main(int argc, char** argv) {
    if (argc > 1 && std::strcmp(argv[1], "plant") == 0) {
        auto x = vals(37), out = vals(37);
        run(selftest_copy, d1(1), d1(64), x.data(), out.data(), 37u, 1);
        std::puts("the planted off-by-one went unnoticed");
        return 0;
    }
    // Element-wise, norms, rotary on 3 rows of 100 (not a multiple of 32).
    const unsigned rows = 3, cols = 100, n = rows * cols;
    auto x = vals(n), y = vals(n, 0.5f), g = vals(rows), w = vals(cols), z = vals(n, 0.3f), b = vals(cols);
    run(add_f32, d1(2), d1(256), x.data(), y.data(), n);
    run(add_bias_f32, d1(2), d1(256), x.data(), b.data(), n, cols);
    run(silu_mul_f32, d1(2), d1(256), x.data(), y.data(), n);
    run(sigmoid_mul_f32, d1(2), d1(256), x.data(), y.data(), n);
    run(scale_f32, d1(2), d1(256), x.data(), 0.37f, n);
    run(activate_f32, d1(2), d1(256), x.data(), n, 0);
    run(activate_f32, d1(2), d1(256), x.data(), n, 1);
    run(add_sigmoid_gated_f32, d1(2), d1(256), x.data(), y.data(), g.data(), n, cols);
    run(gelu_f32, d1(2), d1(256), x.data(), n, 1);
    run(rms_norm_f32, d1(rows), d1(128), x.data(), w.data(), z.data(), cols, cols, cols, 1e-6f, 1, 0);
    run(rms_norm_f32, d1(rows * 4), d1(32), x.data(), w.data(), z.data(), cols, 25u, 25u, 1e-6f, 0, 1);
    run(l2_norm_f32, d1(rows * 4), d1(32), x.data(), 25u, 1e-6f);
    auto normed = vals(rows * cols);
    run(add_rms_norm_f32, d1(rows), d1(128), x.data(), z.data(), w.data(), normed.data(), cols, 1e-6f, 1);
    run(layer_norm_f32, d1(rows), d1(128), x.data(), w.data(), b.data(), cols, 1e-6f);
    auto cs = vals(rows * 10), sn = vals(rows * 10);
    run(rotate_half_f32, d1(1), d1(256), x.data(), cs.data(), sn.data(), rows, cols, 25u, 10u);

    // Linear over every weight type: m = 3, n = 20, k = 48 (NVFP4: whole blocks of 16).
    const unsigned m = 3, on = 20, k = 48;
    auto xs = vals(m * k), out = vals(m * on);
    auto wf = vals(on * k);
    std::vector<uint16_t> wh(on * k, 0x3c00);
    std::vector<uint8_t> codes(on * k / 2, 0x5a), scales(on * k / 16, 0x38);
    run(linear_tiled, dim3{2, 1, 1}, dim3{16, 16, 1}, xs.data(), static_cast<const void*>(wf.data()), scales.data(), 1.0f, 0,
        out.data(), m, on, k);
    run(linear_tiled, dim3{2, 1, 1}, dim3{16, 16, 1}, xs.data(), static_cast<const void*>(wh.data()), scales.data(), 1.0f, 1,
        out.data(), m, on, k);
    run(linear_tiled, dim3{2, 1, 1}, dim3{16, 16, 1}, xs.data(), static_cast<const void*>(codes.data()), scales.data(), 0.5f, 3,
        out.data(), m, on, k);
    run(linear_gemv, d1(3), d1(256), xs.data(), static_cast<const void*>(wh.data()), scales.data(), 1.0f, 2, out.data(), m,
        on, k);
    run(linear_gemv, d1(3), d1(256), xs.data(), static_cast<const void*>(codes.data()), scales.data(), 0.5f, 3, out.data(), m,
        on, k);
    std::vector<float> out2(m * on);
    // Three weights of one width, each its own type and column count (4, 20, 12), the fourth absent.
    std::vector<float> out3(m * 12);
    run(linear_gemv_many, d1(5), d1(256), xs.data(), m, k, static_cast<const void*>(wf.data()), scales.data(), 1.0f, 0,
        out2.data(), 4u, static_cast<const void*>(wh.data()), scales.data(), 1.0f, 1, out.data(), on,
        static_cast<const void*>(codes.data()), scales.data(), 0.5f, 3, out3.data(), 12u,
        static_cast<const void*>(wf.data()), scales.data(), 1.0f, 0, out2.data(), 0u);
    run(linear_gemv_swiglu, d1(3), d1(256), xs.data(), static_cast<const void*>(wh.data()), scales.data(), 1.0f,
        static_cast<const void*>(wh.data()), scales.data(), 0.5f, 1, out.data(), m, on, k);
    // A width that is not whole 8-column steps: one column a lane a step.
    run(linear_gemv, d1(3), d1(256), xs.data(), static_cast<const void*>(wf.data()), scales.data(), 1.0f, 0, out.data(), m,
        on, 45u);

    // The grouped GEMM of an expert wave: two groups of 2 and 1 rows over two NVFP4 weights.
    std::vector<uint8_t> codes2(on * k / 2, 0x35), scales2(on * k / 16, 0x40);
    std::vector<uint64_t> wptrs = {reinterpret_cast<uint64_t>(codes.data()), reinterpret_cast<uint64_t>(codes2.data())};
    std::vector<uint64_t> sptrs = {reinterpret_cast<uint64_t>(scales.data()), reinterpret_cast<uint64_t>(scales2.data())};
    std::vector<float> globals = {0.5f, 0.25f};
    std::vector<uint32_t> row0 = {0, 2}, counts = {2, 1};
    run(linear_grouped, dim3{2, 1, 2}, dim3{16, 16, 1}, xs.data(), wptrs.data(), sptrs.data(), globals.data(), row0.data(),
        counts.data(), 3, out.data(), on, k);
    run(linear_grouped_gemv, dim3{3, 1, 2}, d1(256), xs.data(), wptrs.data(), sptrs.data(), globals.data(), row0.data(),
        counts.data(), 3, out.data(), on, k);

    // The int8 decode path (widths in whole 32-column segments): the quantisation, plain and gathering;
    // the dense GEMV; the fused expert kernels over the same two groups (2 and 1 rows), hidden 64, inter 32.
    {
        const unsigned qk = 64, qn = 20, qi = 32;
        auto qx = vals(3 * qk), qo = vals(3 * qn);
        std::vector<uint8_t> q(3 * qk), hq(3 * qi);
        std::vector<float> d(3 * qk / 16), hd(3 * qi / 16);
        std::vector<int32_t> qids = {2, 0, 2}, entries = {1, 0, 2};
        run(quantize_q8, d1(1), d1(256), qx.data(), qids.data(), 0, q.data(), d.data(), 3u, qk);
        run(quantize_q8, d1(1), d1(256), qx.data(), qids.data(), 1, q.data(), d.data(), 3u, qk);
        std::vector<uint8_t> wq(qn * qk / 2, 0x5a), sq(qn * qk / 16, 0x38);
        run(linear_q8_gemv, d1(3), d1(256), q.data(), d.data(), wq.data(), sq.data(), 0.5f, qo.data(), 3u, qn, qk);
        std::vector<std::vector<uint8_t>> ew, es;  // gate, up, down of the two experts
        for (unsigned p = 0; p < 6; ++p) {
            ew.emplace_back(qi * qk / 2, static_cast<uint8_t>(0x35 + p));
            es.emplace_back(qi * qk / 16, 0x40);
        }
        std::vector<uint64_t> wt, st;
        for (unsigned p = 0; p < 6; ++p) {
            wt.push_back(reinterpret_cast<uint64_t>(ew[p].data()));
            st.push_back(reinterpret_cast<uint64_t>(es[p].data()));
        }
        std::vector<float> gl = {0.5f, 0.25f, 1.0f, 0.5f, 0.25f, 2.0f}, weights = vals(3), parts = vals(3 * qk);
        run(moe_gate_up_q8, dim3{qi / 16, 1, 2}, d1(512), qx.data(), qids.data(), wt.data(), st.data(), gl.data(), row0.data(),
            counts.data(), 2u, hq.data(), hd.data(), qi, qk);
        run(moe_down_q8, dim3{qk / 8, 1, 2}, d1(256), hq.data(), hd.data(), wt.data(), st.data(), gl.data(), row0.data(),
            counts.data(), 2u, entries.data(), weights.data(), parts.data(), qk, qi);
    }

    // The tensor-core GEMM (k a multiple of 32): 70 rows × 72 columns (a partial tile each way), k = 64;
    // grouped: the two groups of 2 and 1 rows. Then the primitives' selftest.
    {
        const unsigned mm = 70, mn = 72, mk = 64;
        std::vector<uint8_t> q(mm * mk, 0x11), wq(mn * mk / 2, 0x5a), sq(mn * mk / 16, 0x38);
        std::vector<float> d(mm * mk / 16, 0.25f), mo(mm * mn);
        run(linear_mma_q8, dim3{2, 2, 1}, d1(128), q.data(), d.data(), wq.data(), sq.data(), 0.5f, mo.data(), mm, mn, mk);
        std::vector<uint64_t> wt = {reinterpret_cast<uint64_t>(wq.data()), reinterpret_cast<uint64_t>(wq.data())};
        std::vector<uint64_t> st = {reinterpret_cast<uint64_t>(sq.data()), reinterpret_cast<uint64_t>(sq.data())};
        std::vector<float> gl = {0.5f, 0.25f};
        std::vector<float> go(3 * mn);
        run(linear_grouped_mma_q8, dim3{1, 1, 2}, d1(128), q.data(), d.data(), wt.data(), st.data(), gl.data(), row0.data(),
            counts.data(), go.data(), mn, mk);
        std::vector<uint8_t> ta(256, 3), tb(128, 250), rows(512, 7), cp(32);
        std::vector<int> td(128), tt(128);
        std::vector<uint32_t> lm(128);
        run(selftest_mma, d1(1), d1(32), ta.data(), tb.data(), td.data(), tt.data(), rows.data(), lm.data(), cp.data(), 0);
    }

    // Memory: gathers, scatters, splits, bf16 rows, embeddings.
    std::vector<int32_t> ids = {2, 0, 2};
    auto gathered = vals(3 * cols);
    run(gather_rows, d1(4), d1(256), reinterpret_cast<const uint8_t*>(x.data()), ids.data(),
        reinterpret_cast<uint8_t*>(gathered.data()), 3u, cols, 4u);
    auto part = vals(rows * 2 * 10);
    run(split_cols_f32, d1(1), d1(256), x.data(), part.data(), part.data(), part.data(), part.data(), rows, 2u, 50u, 40u, 10u,
        0u, 0u, 0u);
    auto p0 = vals(rows * 2 * 10), p1 = vals(rows * 2 * 15), p2 = vals(rows * 2 * 25);
    run(split_cols_f32, d1(1), d1(256), x.data(), p0.data(), p1.data(), p2.data(), p0.data(), rows, 2u, 50u, 0u, 10u, 15u,
        25u, 0u);
    std::vector<uint16_t> half(n);
    run(f32_to_bf16_rows, d1(2), d1(256), x.data(), half.data(), n);
    auto emb = vals(3 * cols);
    std::vector<uint16_t> widened(on * k);
    run(nvfp4_to_bf16, d1(4), d1(256), codes.data(), scales.data(), 0.5f, widened.data(), on * k);
    run(embed_rows, d1(2), d1(256), static_cast<const void*>(half.data()), 1, ids.data(), emb.data(), 3u, cols);

    // Attention: 2 rows after 19 tokens, pages of 8, 4 heads over 2 KV heads of 16, f32 and bf16 pools.
    const unsigned past = 19, qn = 2, heads = 4, kvh = 2, hd = 16, ps = 8, pages = 3;
    std::vector<int32_t> table = {2, 0, 1};
    auto q = vals(qn * heads * hd), ao = vals(qn * heads * hd), pool = vals(pages * 2 * ps * kvh * hd);
    // Flash attention: one split writing the output (both heads of a KV head in a block), then two
    // splits of 16 positions with a head a block into the partial sums, joined by the combine.
    // Each row names its page table, its rows of q and out (in reverse here), its positions and split.
    const auto table_at = static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(table.data()));
    std::vector<FlashRow> one = {{table_at, 1u, past + 1, 32u, 0u}, {table_at, 0u, past + 2, 32u, 0u}};
    run(attention_flash, dim3{qn, kvh, 1}, d1(128), q.data(), ao.data(), static_cast<const void*>(pool.data()), 0,
        one.data(), ps, qn, 2 * past + 3, heads, kvh, hd, 0.25f, 2u, ao.data());
    std::vector<uint16_t> pool16(pool.size(), 0x3f80);
    std::vector<float> parts(qn * heads * 2 * (hd + 2));
    std::vector<FlashRow> two = {{table_at, 1u, past + 1, 16u, 0u}, {table_at, 0u, past + 2, 16u, 0u}};
    run(attention_flash, dim3{qn, kvh * 2, 2}, d1(128), q.data(), ao.data(), static_cast<const void*>(pool16.data()), 1,
        two.data(), ps, qn, 2 * past + 3, heads, kvh, hd, 0.25f, 1u, parts.data());
    run(attention_combine, d1(qn * heads), d1(32), parts.data(), ao.data(), two.data(), qn, heads, hd, 2u);
    // K and V rows into the pools (K normed and rotated: 16-wide heads, 4 dims rotated), rows 1 and 0
    // of the step to page 2 slot 3 and page 0 slot 7; q's norm and rotation in place.
    auto kn = vals(hd), kc = vals(qn * 2), ks = vals(qn * 2), kk = vals(qn * kvh * hd), kv = vals(qn * kvh * hd);
    std::vector<uint32_t> slots = {1u, 2 * 2 * ps + 3, 0u, 7u};
    run(kv_write_rope, d1(qn * kvh), d1(32), kk.data(), kv.data(), static_cast<void*>(pool.data()), 0, slots.data(), ps,
        kvh, hd, kn.data(), kc.data(), ks.data(), 2u, 1e-6f, 1);
    run(kv_write_rope, d1(qn * kvh), d1(32), kk.data(), kv.data(), static_cast<void*>(pool16.data()), 1, slots.data(), ps,
        kvh, hd, kn.data(), kc.data(), ks.data(), 2u, 1e-6f, 0);
    run(rms_norm_rope_f32, d1(qn * heads), d1(32), q.data(), kn.data(), kc.data(), ks.data(), heads, hd, 2u, 1e-6f, 1);
    auto kf = vals(5 * kvh * hd), vf = vals(5 * kvh * hd), fq = vals(5 * heads * hd), fo = vals(5 * heads * hd);
    std::vector<float> fs(3 * heads * 3);
    run(attention_full, d1(3 * heads), d1(128), fq.data(), kf.data(), vf.data(), fo.data(), 1u, 3u, 0u, heads, kvh, hd,
        0.25f, fs.data());
    // A band: the last two query rows only, into a scratch of two rows' scores.
    run(attention_full, d1(2 * heads), d1(128), fq.data(), kf.data(), vf.data(), fo.data(), 1u, 3u, 1u, heads, kvh, hd,
        0.25f, fs.data());

    // Gated DeltaNet: conv from a state, gates, the delta rule.
    const unsigned c = 40, kern = 4, t = 3;
    auto cx = vals((t + 1) * c), cw = vals(c * kern), cst = vals((kern - 1) * c), co = vals(t * c);
    run(causal_conv_silu, d1(1), d1(64), cx.data(), 1u, t, c, cw.data(), kern, cst.data(), co.data());
    const unsigned nk = 2, nv = 4, dk = 8, dv = 8;
    auto ga = vals((t + 1) * nv), gb = vals((t + 1) * nv), na = vals(nv), dt = vals(nv), beta = vals(t * nv), gg = vals(t * nv);
    run(delta_gates, d1(1), d1(64), ga.data(), gb.data(), 1u, t, nv, na.data(), dt.data(), beta.data(), gg.data());
    auto dq = vals(t * nk * dk), dkv = vals(t * nk * dk), dvv = vals(t * nv * dv), st = vals(nv * dk * dv), dout = vals(t * nv * dv);
    // The recurrent rule on one state over three tokens (a slab of 8 of a block's 32 columns).
    run(gated_delta_slab, dim3{nv, 1, 1}, d1(32), dq.data(), dkv.data(), dvv.data(), gg.data(), beta.data(),
        st.data(), 0u, dout.data(), t, nk, nv, dk, dv);
    // The decode forms over two sequences: each row continues its own state.
    auto cst2 = vals((kern - 1) * c);
    std::vector<uint64_t> conv_states = {reinterpret_cast<uint64_t>(cst.data()), reinterpret_cast<uint64_t>(cst2.data())};
    run(causal_conv_silu_rows, d1(1), d1(64), cx.data(), 2u, c, cw.data(), kern, conv_states.data(), co.data());
    auto st2 = vals(nv * dk * dv);
    std::vector<uint64_t> delta_states = {reinterpret_cast<uint64_t>(st.data()), reinterpret_cast<uint64_t>(st2.data())};
    run(gated_delta_slab, dim3{nv, 2, 1}, d1(32), dq.data(), dkv.data(), dvv.data(), gg.data(), beta.data(),
        delta_states.data(), 1u, dout.data(), 2u, nk, nv, dk, dv);
    // A decode step from the conv's output (rows 1 and 2 of the gates), two sequences, then one.
    auto sconv = vals(2 * (2 * nk * dk + nv * dv));
    run(gated_delta_step, dim3{nv, 2, 1}, d1(32), sconv.data(), ga.data(), gb.data(), 1u, na.data(), dt.data(), 0.35f,
        delta_states.data(), 1u, dout.data(), nk, nv, dk, dv);
    run(gated_delta_step, dim3{nv, 1, 1}, d1(32), sconv.data(), ga.data(), gb.data(), 2u, na.data(), dt.data(), 0.35f,
        st2.data(), 0u, dout.data(), nk, nv, dk, dv);
    // The chunked form over 70 tokens: a window of two chunks (64 + 6), then the state's part.
    const unsigned tn = 70, windows = 2;
    auto cq = vals(tn * nk * dk, 0.2f), ck = vals(tn * nk * dk, 0.2f), cv = vals(tn * nv * dv), cg = vals(tn * nv, 0.1f),
         cb = vals(tn * nv, 0.5f), co2 = vals(tn * nv * dv);
    std::vector<float> sx(windows * nv * 64 * dv), sy_chunk(windows * nv * 64 * dk), sa(windows * nv * 64 * 64), sc(windows * nv * 64);
    run(gated_delta_chunk_prep, dim3{nv, windows, 1}, d1(256), cq.data(), ck.data(), cv.data(), cg.data(), cb.data(), 0u, tn,
        sx.data(), sy_chunk.data(), sa.data(), sc.data(), nk, nv, dk, dv);
    run(gated_delta_chunk_state, d1(nv), d1(512), cq.data(), ck.data(), sx.data(), sy_chunk.data(), sa.data(), sc.data(),
        st.data(), co2.data(), 0u, tn, windows, nk, nv, dk, dv);

    // Router and experts: 3 tokens over 10 experts, top 3; entries into partials; the combine.
    auto logits = vals(3 * 10);
    std::vector<int32_t> rid(3 * 3);
    auto rw = vals(3 * 3);
    run(route_topk, d1(1), d1(64), logits.data(), rid.data(), rw.data(), 3u, 10u, 3u, 1);
    // Sampling: a greedy row and a row with every cut, an edit and a grammar mask (`pack`'s layout).
    auto bits = [](float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; };
    std::vector<uint32_t> sp(2 * 12, 0);
    const uint64_t u_half = 0x3fe0000000000000ull;  // u = 0.5
    uint32_t row1[12] = {bits(1.0f), 3u, bits(0.9f), bits(0.05f), bits(1.2f), 1u, 24u, 28u, 1u, 1u, (uint32_t)u_half, (uint32_t)(u_half >> 32)};
    std::memcpy(sp.data() + 12, row1, sizeof row1);
    sp.insert(sp.end(), {4u, 7u, bits(0.5f), bits(1.0f), 0x3ffu});
    auto sy_sample = vals(2 * 10);
    std::vector<double> sm(2 * 10);
    std::vector<int32_t> best(3);
    run(sample_rows, d1(2), d1(64), logits.data(), sp.data(), sy_sample.data(), sm.data(), best.data(), 2u, 10u, 0u);
    auto partials = vals(9 * 16), dd = vals(2 * 16), comb = vals(3 * 16);
    std::vector<int32_t> entries = {8, 0};
    run(moe_scatter_rows, d1(1), d1(64), partials.data(), entries.data(), rw.data(), dd.data(), 2u, 16u);
    run(moe_combine, d1(1), d1(64), partials.data(), comb.data(), 3u, 3u, 16u, 0, static_cast<const float*>(nullptr),
        static_cast<const float*>(nullptr));
    auto shared16 = vals(3 * 16), gate3 = vals(3);
    run(moe_combine, d1(1), d1(64), partials.data(), comb.data(), 3u, 3u, 16u, 1, shared16.data(), gate3.data());
    // The groups of the router's ids on the device: 3 tokens × 3 entries over 10 experts in 10 slots
    // (slot = 9 − expert), at most 9 groups, every output exactly its size.
    std::vector<int32_t> slot_of(10);
    for (int e = 0; e < 10; ++e) slot_of[e] = 9 - e;
    std::vector<uint64_t> slot_w(3 * 10, 1), slot_s(3 * 10, 2), gw(3 * 9), gs(3 * 9);
    std::vector<float> slot_g(3 * 10, 0.5f), group_g(3 * 9);
    std::vector<uint32_t> gr0(9), grows(9);
    std::vector<int32_t> gent(9), gtok(9);
    run(moe_align, d1(1), d1(32), rid.data(), slot_of.data(), 9u, 3u, 10u, 9u, slot_w.data(), slot_s.data(), slot_g.data(),
        gr0.data(), grows.data(), gw.data(), gs.data(), group_g.data(), gent.data(), gtok.data());

    // qwen4_exp: hyper-connections, PLE, the dilated conv, QSA over the paged pool above.
    const unsigned hn = 2, hc = 4, hh = 12;
    auto hm = vals(hn * hc * hh), hx = vals(hn * hc * hh), ho = vals(hn * hh), hi = vals(hn * hc), hcomb = vals(hn * hh);
    run(hc_combine, d1(1), d1(64), hm.data(), hx.data(), hcomb.data(), hn, hc, hh);
    run(hc_inject, d1(1), d1(128), hm.data(), ho.data(), hi.data(), hn, hc, hh);
    auto ple = vals(hn * hc * hh);
    run(ple_gate, d1(hn * hc), d1(32), hm.data(), hx.data(), ho.data(), ple.data(), hc, hh);
    auto dx = vals(3 * c), dw = vals(c * 3), dst = vals(2 * 2 * c), dco = vals(3 * c);
    run(causal_conv_dilated_silu, d1(1), d1(64), dx.data(), 3u, c, dw.data(), 3u, 2u, dst.data(), dco.data());
    auto mean = vals(hd);
    run(mean_rows, d1(1), d1(32), kf.data(), 1u, 3u, hd, mean.data());
    const unsigned ratio = 4, top = 2;
    auto keys = vals(((past + qn) / ratio) * hd);
    std::vector<int32_t> blocks(qn * top);
    run(qsa_select, d1(1), d1(64), q.data(), 0u, qn, keys.data(), past, ratio, top, heads, hd, 0.2f, blocks.data());
    std::vector<float> ss(qn * heads * (top * ratio + ratio));
    run(attention_selected, d1(qn * heads), d1(128), q.data(), ao.data(), static_cast<const void*>(pool.data()), 0,
        table.data(), ps, blocks.data(), top, 0u, past, ratio, heads, kvh, hd, 0.2f, ss.data(), top * ratio + ratio);

    std::puts("every kernel ran within its buffers");
    return 0;
}
