//! A small seeded generator (splitmix64) for what the benches draw: media, prompts, arrival times and
//! synthetic weights. Seeded runs must send and write the same bytes every time.

/// splitmix64 state.
#[derive(Debug)]
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Roughly N(0, 1): a sum of four uniforms, centred and scaled.
    pub(crate) fn normal(&mut self) -> f32 {
        let u: f32 = (0..4).map(|_| (self.next() >> 40) as f32 / (1u64 << 24) as f32).sum();
        (u - 2.0) * 1.732
    }
}
