//! Scalar activations, written as torch computes them in f32.

/// `x * sigmoid(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `1 / (1 + e^-x)`.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// torch `F.softplus` with beta 1 and threshold 20: linear above the threshold to avoid overflow.
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// GELU, tanh approximation (`gelu_pytorch_tanh`): `0.5·x·(1 + tanh(u))`, `u = √(2/π)·(x + 0.044715·x³)`,
/// computed as `x·sigmoid(2u)` (the same function; one `exp` instead of `tanh`, ~3× cheaper).
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const K2: f32 = 2.0 * 0.797_884_6; // 2·sqrt(2/pi)
    x / (1.0 + (-K2 * (x + 0.044715 * x * x * x)).exp())
}

/// Exact GELU (`nn.GELU()`): `0.5·x·(1 + erf(x/√2))`.
#[inline]
pub fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activations_match_closed_forms() {
        assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
        assert!((sigmoid(0.0) - 0.5).abs() < 1e-7);
        assert!((softplus(0.0) - std::f32::consts::LN_2).abs() < 1e-7);
        assert_eq!(softplus(30.0), 30.0);
        // torch.nn.functional.gelu(torch.tensor(1.0)) = 0.8413447; approximate="tanh": 0.8411920
        assert!((gelu_erf(1.0) - 0.841_344_7).abs() < 1e-6);
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-6);
    }
}
