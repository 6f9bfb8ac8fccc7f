//! `--gemm auto` by measurement: which prefill GEMM is fastest on this CPU for each weight class, timed
//! once at start-up on the model's prefill shapes, instead of the best kernel the CPU merely has (issue
//! 54: on Sapphire Rapids the AMX-INT8 tiles were picked at half the speed of the AVX-512 VNNI GEMM
//! beside them). Each candidate runs the same kernel function the dispatch runs
//! (`matmul::run_gemm`), on weights and activations made here, without touching the dispatch's state;
//! [`Calibration::apply`] then sets the per-class preference. Timings are the best of a few runs after a
//! warm-up (the candidates in turn, round after round), summed over the shapes of each band of rows
//! ([`Rows`]), which chooses on its own: a routed expert's gate/up with 16 and 32 rows (the experts of a
//! 512-token chunk get ~16–64 rows each) for [`Rows::Few`], a dense projection of 128 rows for
//! [`Rows::Many`].

use crate::dispatch::{allowed, available, kernel_name, prefer, Gemm, Rows, WeightClass};
use crate::matmul::run_gemm;
use crate::WeightView;

/// The shapes timed, `(m, n, k)`: a routed expert's gate/up at two row counts and a dense projection's
/// slice; each counts for its band of rows ([`Rows::of`]).
pub const SHAPES: [(usize, usize, usize); 3] = [(16, 512, 2048), (32, 512, 2048), (128, 1024, 2048)];
/// Timed runs per shape and kernel after one warm-up (the best counts).
const RUNS: usize = 3;

/// One candidate's time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Timing {
    /// The weight class.
    pub class: WeightClass,
    /// The band of rows.
    pub rows: Rows,
    /// The kernel.
    pub gemm: Gemm,
    /// Seconds over the band's [`SHAPES`] (best of [`RUNS`] each).
    pub secs: f64,
}

/// What a calibration measured and chose.
#[derive(Clone, Debug, PartialEq)]
pub struct Calibration {
    /// Every candidate timed (each kernel this CPU has and the ceiling allows, per class).
    pub timings: Vec<Timing>,
    /// The fastest per class and band, in [`WeightClass::ALL`] then [`Rows::ALL`] order.
    pub chosen: Vec<(WeightClass, Rows, Gemm)>,
}

impl Calibration {
    /// Makes the dispatch use the chosen kernels (and only slower-ranked ones as fallbacks).
    pub fn apply(&self) {
        for &(c, r, g) in &self.chosen {
            prefer(c, r, g);
        }
    }

    /// The choices as one line for the cache, each class's few rows then many (`nvfp4=int8,int8
    /// bf16=bf16,f32`).
    pub fn choices_line(&self) -> String {
        WeightClass::ALL
            .iter()
            .map(|&c| {
                let gs: Vec<&str> = self.chosen.iter().filter(|t| t.0 == c).map(|t| t.2.name()).collect();
                format!("{}={}", c.name(), gs.join(","))
            })
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Choices read back from [`Calibration::choices_line`] (no timings); `None` for anything else.
    pub fn from_choices_line(line: &str) -> Option<Self> {
        let mut chosen = Vec::new();
        let parts: Vec<&str> = line.split_whitespace().collect();
        if parts.len() != WeightClass::ALL.len() {
            return None;
        }
        for (part, class) in parts.into_iter().zip(WeightClass::ALL) {
            let (c, gs) = part.split_once('=')?;
            let gs: Vec<&str> = gs.split(',').collect();
            if c != class.name() || gs.len() != Rows::ALL.len() {
                return None;
            }
            for (g, rows) in gs.into_iter().zip(Rows::ALL) {
                chosen.push((class, rows, g.parse::<Gemm>().ok()?));
            }
        }
        Some(Calibration { timings: Vec::new(), chosen })
    }

    /// For the log: each class's and band's choice and every time measured.
    pub fn describe(&self) -> String {
        self.chosen
            .iter()
            .map(|&(c, r, g)| {
                let times: Vec<String> = self
                    .timings
                    .iter()
                    .filter(|t| t.class == c && t.rows == r)
                    .map(|t| format!("{} {:.2} ms", kernel_name(c, t.gemm), t.secs * 1e3))
                    .collect();
                format!("{} {:?} rows {} [{}]", c.name(), r, kernel_name(c, g), times.join(", ")).to_lowercase()
            })
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// The kernels a calibration on this CPU would time, by name (`nvfp4: int8 gemm avx2, f32 sgemm; …`):
/// part of the cache key, so that a build with other kernels measures again instead of taking a choice
/// made among fewer.
pub fn candidates() -> String {
    WeightClass::ALL
        .iter()
        .map(|&class| {
            let names: Vec<&str> =
                Gemm::ALL.into_iter().filter(|&g| available(class, g)).map(|g| kernel_name(class, g)).collect();
            format!("{}: {}", class.name(), names.join(", "))
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Times every prefill GEMM this CPU has (under the ceiling) for each weight class and band of rows
/// and chooses the fastest. Tens of milliseconds; does not change the dispatch until [`Calibration::apply`].
pub fn calibrate() -> Calibration {
    let mut timings = Vec::new();
    let mut chosen = Vec::new();
    for class in WeightClass::ALL {
        let candidates: Vec<Gemm> = Gemm::ALL.into_iter().filter(|&g| available(class, g) && allowed(g)).collect();
        let mut secs = [vec![0.0; candidates.len()], vec![0.0; candidates.len()]];
        for &(m, n, k) in &SHAPES {
            // One shape's activations and weights, made once for every candidate.
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 97) as f32 / 97.0) - 0.5).collect();
            let (packed, scales, wb): (Vec<u8>, Vec<u8>, Vec<u16>) = match class {
                WeightClass::Nvfp4 => (
                    (0..n * k / 2).map(|i| (i * 131 % 256) as u8).collect(),
                    (0..n * k / 16).map(|i| 0x30 + (i % 16) as u8).collect(),
                    Vec::new(),
                ),
                WeightClass::Bf16 => (
                    Vec::new(),
                    Vec::new(),
                    (0..n * k)
                        .map(|i| half::bf16::from_f32(((i * 104729 % 89) as f32 / 89.0) - 0.5).to_bits())
                        .collect(),
                ),
            };
            let w = match class {
                WeightClass::Nvfp4 => WeightView::Nvfp4 { packed: &packed, scales: &scales, global: 0.01 },
                WeightClass::Bf16 => WeightView::Bf16(&wb),
            };
            let mut out = vec![0f32; m * n];
            let band = &mut secs[Rows::of(m) as usize];
            for (s, best) in
                band.iter_mut().zip(best_times(&candidates, |gemm| run_gemm(gemm, &x, m, w, n, k, &mut out)))
            {
                *s += best;
            }
        }
        for rows in Rows::ALL {
            let secs = &secs[rows as usize];
            timings.extend(candidates.iter().zip(secs).map(|(&gemm, &secs)| Timing { class, rows, gemm, secs }));
            // The first of equal times wins (kernels ranked higher).
            let best = candidates.iter().zip(secs).min_by(|a, b| a.1.total_cmp(b.1)).map_or(Gemm::F32, |(&g, _)| g);
            chosen.push((class, rows, best));
        }
    }
    Calibration { timings, chosen }
}

/// Each candidate's best time of [`RUNS`] runs, after a warm-up of each. The runs go round the
/// candidates in turn, so a burst of load from another process slows one round of all of them rather
/// than every run of one (which then lost to a slower kernel).
fn best_times(candidates: &[Gemm], mut run: impl FnMut(Gemm)) -> Vec<f64> {
    candidates.iter().for_each(|&g| run(g));
    let mut best = vec![f64::INFINITY; candidates.len()];
    for _ in 0..RUNS {
        for (b, &g) in best.iter_mut().zip(candidates) {
            let t = std::time::Instant::now();
            run(g);
            *b = b.min(t.elapsed().as_secs_f64());
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 54: the calibration times every kernel this CPU has for each class and chooses the fastest
    /// of what it timed (the choice compared with the timings it logged), so `--gemm auto` is never
    /// slower on these shapes than a forced path. Its choices survive the cache line.
    #[test]
    fn the_choice_is_the_fastest_kernel_timed() {
        let c = calibrate();
        for class in WeightClass::ALL {
            for rows in Rows::ALL {
                let timed: Vec<&Timing> = c.timings.iter().filter(|t| t.class == class && t.rows == rows).collect();
                let expected: Vec<Gemm> =
                    Gemm::ALL.into_iter().filter(|&g| available(class, g) && allowed(g)).collect();
                assert_eq!(timed.iter().map(|t| t.gemm).collect::<Vec<_>>(), expected, "{class:?} {rows:?}");
                let fastest = timed.iter().min_by(|a, b| a.secs.total_cmp(&b.secs)).expect("a kernel");
                let chosen = c.chosen.iter().find(|t| t.0 == class && t.1 == rows).expect("a choice").2;
                assert_eq!(chosen, fastest.gemm, "{class:?} {rows:?}: {}", c.describe());
            }
        }
        let back = Calibration::from_choices_line(&c.choices_line()).expect("parses");
        assert_eq!(back.chosen, c.chosen);
        let line = Calibration::from_choices_line("nvfp4=int8,amx bf16=bf16,f32").expect("parses");
        assert_eq!(line.chosen[1], (WeightClass::Nvfp4, Rows::Many, Gemm::Amx));
        assert_eq!(line.chosen[2], (WeightClass::Bf16, Rows::Few, Gemm::Bf16));
        assert!(Calibration::from_choices_line("nvfp4=int8").is_none());
        assert!(Calibration::from_choices_line("nvfp4=int8 bf16=bf16").is_none(), "a line of one choice a class");
        assert!(Calibration::from_choices_line("nvfp4=fast,int8 bf16=amx,amx").is_none());
        assert!(Calibration::from_choices_line("bf16=amx,amx nvfp4=int8,int8").is_none());
        eprintln!("{}", c.describe());
    }
}
