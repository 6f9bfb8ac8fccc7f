//! Sampling on the device (`sample_rows`, issue 51) against the CPU backend, which runs the host
//! sampler's own rule (`osprey_backend::sampling`).
//!
//! Greedy ids must be equal exactly. A draw sums the candidates' masses in another order (a tree in
//! double, not left to right), so the two can disagree only where the uniform number lies within
//! rounding (~1e-15 of the mass) of a boundary between two candidates' cumulative probabilities: the
//! test draws with u at the middle of candidates' intervals at least 1e-6 of the mass wide (the first,
//! the second, a middle one, the last, so every cut — top-k, top-p, min-p — is where the host puts it)
//! and demands the same token.

use osprey_backend::sampling::{self, edits, RowSampling};
use osprey_backend::{BackendRef, HostVec, Tensor};

use crate::common::{backends, data};

fn ids(b: &BackendRef, logits: &[&Tensor], rows: &[RowSampling]) -> Vec<i32> {
    let rows: Vec<&RowSampling> = rows.iter().collect();
    match b.download(&b.sample_rows(logits, &rows).expect("sample_rows")).expect("ids") {
        HostVec::I32(v) => v,
        other => panic!("{other:?}"),
    }
}

/// Both backends' ids for `rows` of `cols` logits (`v`, row-major), uploaded as tensors of 1, 2, 3, …
/// rows (each launch writes its ids at its offset).
fn both_ids(v: &[f32], cols: usize, rows: &[RowSampling]) -> (Vec<i32>, Vec<i32>) {
    let (cpu, gpu) = backends();
    let (mut c, mut g, mut at, mut n) = (Vec::new(), Vec::new(), 0, 1);
    while at < rows.len() {
        let k = n.min(rows.len() - at);
        let part = &v[at * cols..(at + k) * cols];
        c.push(cpu.upload_f32(part, &[k, cols]).expect("cpu"));
        g.push(gpu.upload_f32(part, &[k, cols]).expect("gpu"));
        (at, n) = (at + k, n + 1);
    }
    let (c, g): (Vec<&Tensor>, Vec<&Tensor>) = (c.iter().collect(), g.iter().collect());
    (ids(&cpu, &c, rows), ids(&gpu, &g, rows))
}

/// Greedy: the first index of each row's maximum, exactly the CPU's, on ties, NaN entries, a row of NaN,
/// one column, rows wider than a block, and after a mask, penalties and a bias that move the maximum.
#[test]
pub(crate) fn greedy_rows_take_the_first_maximum_on_ties_nan_and_wide_rows() {
    for cols in [1usize, 7, 300, 5000] {
        let n = 7;
        let mut v = data(950 + cols as u64, n * cols);
        let mut rows = vec![RowSampling::greedy(); n];
        if cols > 1 {
            let max = v[..cols].iter().fold(f32::MIN, |m, x| m.max(*x)) + 1.0;
            (v[cols - 1], v[cols / 2]) = (max, max); // a tie: the lower index wins
            v[cols] = f32::NAN; // NaN never wins
            v[2 * cols..3 * cols].iter_mut().for_each(|x| *x = f32::NAN);
            v[3 * cols..4 * cols].iter_mut().for_each(|x| *x = 0.5); // all equal: index 0
                                                                     // Row 4: the mask forbids the maximum and every odd token; row 5: penalties and a bias move it.
            let best = sampling::first_max(&v[4 * cols..5 * cols]) as u32;
            let mut mask = vec![0x5555_5555u32; cols.div_ceil(32)];
            mask[best as usize / 32] &= !(1 << (best % 32));
            rows[4].allowed = Some(mask);
            let row5 = &v[5 * cols..6 * cols];
            let best5 = sampling::first_max(row5) as u32;
            rows[5].repetition_penalty = 3.0;
            rows[5].edits = edits([best5, 0, 1], &[best5, best5], (3.0, 0.5, 0.25), &[(cols as u32 - 1, 2.5)]);
        }
        let (want, got) = both_ids(&v, cols, &rows);
        assert_eq!(got, want, "{cols} columns");
        if cols > 1 {
            assert_eq!((want[0], want[2], want[3]), (cols as i32 / 2, 0, 0), "{cols}: a tie, NaN, all equal");
            assert!(want[4] % 2 == 0 && want[4] != sampling::first_max(&v[4 * cols..5 * cols]) as i32, "{cols}: mask");
        }
    }
}

/// The settings a test row draws under (u set per draw).
fn settings(cols: usize, seed: u64) -> Vec<(&'static str, RowSampling)> {
    let s =
        |temperature, top_k, top_p, min_p| RowSampling { temperature, top_k, top_p, min_p, ..RowSampling::greedy() };
    let mut pen = s(1.1, 0, 1.0, 0.0);
    let d = data(seed, 64);
    let seen: Vec<u32> = d[..16].iter().map(|x| ((x.abs() * 1e4) as usize % cols) as u32).collect();
    let output: Vec<u32> = d[16..32].iter().map(|x| ((x.abs() * 1e4) as usize % cols) as u32).collect();
    let bias: Vec<(u32, f32)> = vec![(0, 3.0), ((cols / 2) as u32, -4.0), ((cols - 1) as u32, 1.5)];
    pen.repetition_penalty = 1.3;
    pen.edits = edits(seen.iter().chain(&output).copied(), &output, (1.3, 0.4, 0.2), &bias);
    let words = cols.div_ceil(32);
    pen.allowed = Some((0..words).map(|i| if i == words / 2 { 0 } else { 0xF0F0_FFFF }).collect());
    vec![
        ("temperature", s(0.7, 0, 1.0, 0.0)),
        ("top-k", s(1.0, 5, 1.0, 0.0)),
        ("top-p", s(1.3, 0, 0.8, 0.0)),
        ("min-p", s(1.0, 0, 1.0, 0.2)),
        ("all cuts", s(0.9, 40, 0.9, 0.05)),
        ("penalties, bias, mask", pen),
        ("k past the vocabulary", s(2.0, cols as u32 + 3, 1.0, 0.0)),
    ]
}

/// u at the middle of candidate `i`'s interval of the host's cumulative distribution, when it is at
/// least 1e-6 of the mass wide.
fn middles(logits: &[f32], s: &RowSampling) -> Vec<f64> {
    let (cand, probs) = sampling::distribution(&sampling::processed(logits, s), s);
    let total: f64 = probs.iter().sum();
    let n = cand.len();
    let mut picks = vec![0, 1, n / 2, n.saturating_sub(1)];
    picks.dedup();
    let start = |i: usize| probs[..i].iter().sum::<f64>() / total;
    picks
        .into_iter()
        .filter(|&i| i < n && probs[i] / total >= 1e-6)
        .map(|i| start(i) + probs[i] / total / 2.0)
        .collect()
}

/// Draws: temperature, top-k, top-p, min-p, all three, penalties with a bias and a grammar mask, and
/// top-k past the vocabulary, on rows of 7, 300 and 5,000 columns (wider than a block) and on rows whose
/// values tie in steps of 0.25 (a cut inside a tie keeps the lower indices): the device draws the host
/// sampler's token for every u away from rounding.
#[test]
pub(crate) fn draws_match_the_host_sampler_away_from_rounding() {
    for (cols, ties) in [(7usize, false), (300, false), (5000, false), (300, true)] {
        let (mut v, mut rows, mut what) = (Vec::new(), Vec::new(), Vec::new());
        for (i, (name, s)) in settings(cols, cols as u64).into_iter().enumerate() {
            let mut row: Vec<f32> = data(4000 + cols as u64 + i as u64, cols).iter().map(|x| x * 6.0).collect();
            if ties {
                row.iter_mut().for_each(|x| *x = (*x * 4.0).round() / 4.0);
            }
            for u in middles(&row, &s) {
                v.extend_from_slice(&row);
                rows.push(RowSampling { uniform: u, ..s.clone() });
                what.push(format!("{name}, {cols} columns{}, u = {u:.6}", if ties { ", ties" } else { "" }));
            }
        }
        let (want, got) = both_ids(&v, cols, &rows);
        for ((w, g), what) in want.iter().zip(&got).zip(&what) {
            assert_eq!(g, w, "{what}");
        }
        // The rows drew more than one token: the test is not one candidate everywhere.
        assert!(want.iter().collect::<std::collections::BTreeSet<_>>().len() > 3, "{cols}: {want:?}");
    }
}

/// Boundaries the arithmetic holds exactly (equal logits, masses of powers of two): u on a boundary
/// draws the later candidate (the host's `u < q`), and top-p keeps the shortest prefix that reaches it
/// (`acc >= top_p`), as the host does.
#[test]
pub(crate) fn exact_boundaries_fall_as_on_the_host() {
    let cols = 40;
    let v: Vec<f32> = (0..3 * cols).map(|i| if i % cols < 20 { -1.0 } else { 2.0 }).collect();
    let only = |tokens: &[u32]| Some(vec![tokens.iter().fold(0u32, |m, t| m | 1 << t), 0]);
    let s =
        |top_p, uniform, allowed| RowSampling { temperature: 1.0, top_p, uniform, allowed, ..RowSampling::greedy() };
    // Tokens 3 and 5 equal: u = 0.5 is their boundary. Four equal tokens, top-p 0.5: two kept, u = 0.75
    // draws the second (with three kept it would draw the third).
    let rows = vec![s(1.0, 0.5, only(&[3, 5])), s(0.5, 0.75, only(&[2, 4, 6, 8])), s(1.0, 0.0, only(&[9, 1]))];
    let (want, got) = both_ids(&v, cols, &rows);
    assert_eq!(want, vec![5, 4, 1]);
    assert_eq!(got, want);
}
