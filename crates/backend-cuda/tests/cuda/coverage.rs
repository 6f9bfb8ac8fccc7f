//! Every op of the seam is covered, derived from `Op::ALL` (as ggml's `test-backend-ops` covers every op):
//! each op has parity cases against the CPU backend ([`parity_cases`]: a `match` with no wildcard arm,
//! so an op added to the seam without one does not compile), and every kernel those cases launch on the
//! emulated device has a case in the AddressSanitizer harness (`emu/asan_harness.cpp`). Every kernel in
//! `kernels/` is launched by some op's cases (none is dead) and every harness case names a kernel.

use std::collections::{BTreeMap, BTreeSet};

use osprey_backend::Op;

use crate::{batched, ops, q8, sample, sequence};

/// The tests that check `op` on the CUDA backend against the CPU backend.
fn parity_cases(op: Op) -> &'static [fn()] {
    match op {
        Op::Memory => &[ops::embeddings_memory_ops_rotary_and_the_router_match],
        Op::Fences => &[sequence::routed_experts_in_slots_match_in_waves_with_reuse_and_an_empty_wave],
        Op::LinearDense => &[
            ops::linears_agree_within_the_dot_product_bound_for_every_weight_type,
            ops::fast_linears_run_as_bf16_gemms_within_the_rounding_bound,
        ],
        Op::LinearNvfp4 => &[
            ops::linears_agree_within_the_dot_product_bound_for_every_weight_type,
            ops::fast_linears_run_as_bf16_gemms_within_the_rounding_bound,
            q8::int8_decode_linears_take_the_cpus_integers,
            q8::int8_prefill_linears_take_the_cpus_integers_on_tensor_cores,
        ],
        Op::Embed => &[ops::embeddings_memory_ops_rotary_and_the_router_match],
        Op::Elementwise => &[ops::element_wise_ops_agree_to_a_few_ulps],
        Op::Norms => &[ops::norms_agree_within_the_sum_bound],
        Op::Rotary => &[
            ops::embeddings_memory_ops_rotary_and_the_router_match,
            batched::k_and_v_go_into_the_pool_normed_and_rotated_in_one_launch,
        ],
        Op::AttentionPaged => &[
            sequence::paged_attention_matches_on_partial_pages_gqa_and_a_bf16_pool,
            batched::sequences_attend_in_one_launch_with_the_bits_each_gets_alone,
            batched::k_and_v_go_into_the_pool_normed_and_rotated_in_one_launch,
        ],
        Op::AttentionBidirectional => &[sequence::bidirectional_attention_matches_the_vision_shapes],
        Op::GatedDeltaNet => &[
            sequence::gated_deltanet_decodes_to_the_bit_and_prefills_within_the_chunked_bound,
            sequence::gated_deltanet_rows_advance_each_sequence_as_its_own_decode_step,
            sequence::gated_delta_steps_from_the_conv_fuse_the_cpus_ops_to_the_bit,
        ],
        Op::Router => &[ops::embeddings_memory_ops_rotary_and_the_router_match],
        Op::Sample => &[
            sample::greedy_rows_take_the_first_maximum_on_ties_nan_and_wide_rows,
            sample::draws_match_the_host_sampler_away_from_rounding,
            sample::exact_boundaries_fall_as_on_the_host,
        ],
        Op::ExpertSlots => &[
            sequence::routed_experts_in_slots_match_in_waves_with_reuse_and_an_empty_wave,
            sequence::routed_experts_from_device_ids_match_the_host_routed_ones,
            q8::int8_decode_experts_fuse_to_the_bits_of_the_dense_kernels,
            q8::int8_prefill_experts_group_to_the_bits_of_the_dense_kernels,
        ],
        Op::GroupedNorms | Op::HyperConnections | Op::Ple | Op::AttentionSelected => {
            &[sequence::qwen4_exp_ops_match_the_cpu_backend]
        }
    }
}

/// The kernels `asan_harness.cpp` runs (`run(NAME, …)`).
fn harness_kernels() -> BTreeSet<String> {
    let src = include_str!("../../emu/asan_harness.cpp");
    src.match_indices("run(")
        .filter_map(|(at, _)| {
            let name: String = src[at + 4..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
            (!name.is_empty() && src[at + 4 + name.len()..].starts_with(',')).then_some(name)
        })
        .collect()
}

#[test]
fn every_op_has_parity_cases_and_every_kernel_they_run_has_an_asan_case() {
    if crate::common::on_device() {
        return; // the launch log is the emulated device's; on a card the cases run as their own tests
    }
    let harness = harness_kernels();
    // Each case runs once, whichever ops share it.
    let mut ran: BTreeMap<usize, Vec<&'static str>> = BTreeMap::new();
    let mut by_op: Vec<(Op, BTreeSet<&'static str>)> = Vec::new();
    for &op in Op::ALL {
        let cases = parity_cases(op);
        assert!(!cases.is_empty(), "{op:?} has no parity case");
        let mut kernels = BTreeSet::new();
        for &case in cases {
            let launched = ran.entry(case as usize).or_insert_with(|| osprey_backend_cuda::emu::launches_of(case));
            kernels.extend(launched.iter().copied());
        }
        by_op.push((op, kernels));
    }
    let (mut launched, mut gaps) = (BTreeSet::new(), Vec::new());
    for (op, kernels) in &by_op {
        for k in kernels {
            if !harness.contains(*k) {
                gaps.push(format!("{op:?}'s cases run kernel {k}, which the ASan harness never runs"));
            }
            launched.insert(k.to_string());
        }
    }
    for k in osprey_backend_cuda::kernels::all().filter(|k| k.source != "selftest") {
        if !launched.contains(k.name) {
            gaps.push(format!("kernel {} is run by no op's parity cases", k.name));
        }
    }
    let all: BTreeSet<String> = osprey_backend_cuda::kernels::all().map(|k| k.name.to_string()).collect();
    gaps.extend(
        harness.iter().filter(|k| !all.contains(*k)).map(|k| format!("the ASan harness runs {k}, not a kernel")),
    );
    gaps.sort();
    gaps.dedup();
    assert!(gaps.is_empty(), "{}", gaps.join("\n"));
}
