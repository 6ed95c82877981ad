//! Tolerances of the comparisons, derived from how values are stored: the rounding error a ggml
//! type puts on a weight, and what that becomes in the activations of a forward pass.
//!
//! A round-to-nearest quantizer with step `D` leaves an error uniform in `[-D/2, D/2]`, RMS
//! `D/sqrt(12)`. Symmetric formats with `L` levels per scale group (Q8_0, Q6_K, Q5_0, Q4_0, Q3_K)
//! use `D = amax / (L/2)`; formats with a minimum (Q4_K, Q5_K, Q4_1, Q5_1, Q2_K) use
//! `D = (max - min) / (L - 1)`. For the groups of 16-32 weights the formats scale together, a
//! Gaussian gives `amax ~ 2.1 sigma` and `max - min ~ 4.2 sigma`; trained weights have heavier
//! tails: the fixtures' worst Q8_0 tensor implies `amax ~ 3.5 sigma`, so `4 sigma` and
//! `6 sigma` are taken. Measured on the fixtures (quantized tensors against the BF16
//! originals, mean and worst tensor): Q8_0 0.0055 (0.0079), Q6_K 0.018 (0.023), Q5_0 0.042
//! (0.043), Q4_K 0.072 (0.082), each below the value here. IQ grids are non-uniform: they are rated by
//! their level count like the uniform format of the same bits. Floats round to half an ulp,
//! uniform in relative terms: RMS `2^-p / sqrt(3)` with `p` = 9 (BF16) and 11 (F16).

use gguf::GgmlType;

/// RMS of (stored - original) relative to the RMS of the original values, for weights stored as
/// `ty` from an original at least as precise as BF16 (see the module docs).
pub fn weight_rel_rms(ty: GgmlType) -> f64 {
    use GgmlType::*;
    let sqrt12 = 12f64.sqrt();
    let sym = |levels: f64| 4.0 / (levels / 2.0) / sqrt12;
    let asym = |levels: f64| 6.0 / (levels - 1.0) / sqrt12;
    match ty {
        F32 | F64 | I8 | I16 | I32 | I64 => 0.0,
        F16 => 2f64.powi(-11) / 3f64.sqrt(),
        BF16 => 2f64.powi(-9) / 3f64.sqrt(),
        Q8_0 | Q8_1 | Q8_K => 4.0 / 127.0 / sqrt12,
        Q6_K => sym(64.0),
        Q5_0 => sym(32.0),
        Q5_1 | Q5_K => asym(32.0),
        Q4_0 | IQ4_NL | IQ4_XS => sym(16.0),
        Q4_1 | Q4_K => asym(16.0),
        // E2M1 values (0, 0.5, 1, 1.5, 2, 3, 4, 6): the top step is a third of the range, twice
        // the uniform 4-bit step there.
        MXFP4 | NVFP4 => 2.0 * sym(16.0),
        Q3_K | IQ3_XXS | IQ3_S => sym(8.0),
        Q2_K | IQ2_XXS | IQ2_XS | IQ2_S => asym(4.0),
        IQ1_S | IQ1_M | TQ1_0 | TQ2_0 | Q1_0 => asym(3.0),
    }
}

/// The largest weight error over the types of the model's matrices (2-D and larger tensors:
/// vectors are norms and biases, stored as F32).
pub fn model_weight_error(model: &gguf::Model) -> (f64, GgmlType) {
    model
        .tensors()
        .filter(|t| t.info.dims.len() >= 2)
        .map(|t| (weight_rel_rms(t.info.ty), t.info.ty))
        .fold((0.0, GgmlType::F32), |a, b| if b.0 > a.0 { b } else { a })
}

/// Floor of every float comparison: both sides compute in f32 and differ only in summation
/// order; each 256-512-term dot product carries ~1e-7 relative rounding, a few 1e-7 after three
/// layers (tests/tests/forward_activations.rs measures <= 8e-7); 1e-5 keeps an order of margin.
pub const F32_FLOOR: f64 = 1e-5;

/// Between two residual additions an activation goes through up to ~7 matmuls whose weight
/// rounding errors are independent, so they add in quadrature: sqrt(7) = 2.6 times one matmul's
/// error. 4 leaves 1.5x margin (Q4_K_M on the fixtures, an expert-routing flip included, stays
/// at 1.7x the Q4_K estimate).
pub const ACTIVATION_FACTOR: f64 = 4.0;

/// Relative RMS error allowed between a model's activations and a reference computed from the
/// original (unquantized) weights.
pub fn activation_tolerance(weight_error: f64) -> f64 {
    (ACTIVATION_FACTOR * weight_error).max(F32_FLOOR)
}

/// Relative RMS error allowed between weights stored as `ty` and their originals: twice the
/// estimate, for groups whose tails are heavier still.
pub fn weight_tolerance(ty: GgmlType) -> f64 {
    (2.0 * weight_rel_rms(ty)).max(F32_FLOOR)
}

/// `||a - b|| / ||b||` in f64 (0 when both are zero; infinite when only `b` is).
pub fn rel_rms(a: &[f32], b: &[f32]) -> f64 {
    let (mut e, mut s) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        let d = f64::from(x) - f64::from(y);
        e += d * d;
        s += f64::from(y) * f64::from(y);
    }
    if e == 0.0 {
        0.0
    } else if e.is_nan() {
        f64::NAN
    } else {
        (e / s).sqrt()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn estimates_order_by_bits_and_cover_the_measured_errors() {
        use GgmlType::*;
        // Measured on the fixtures against the BF16 originals (module docs): the estimates must
        // not be below them, or the tolerances would flag healthy files.
        for (ty, measured) in [(Q8_0, 0.0079), (Q6_K, 0.023), (Q5_0, 0.043), (Q4_K, 0.082)] {
            assert!(weight_rel_rms(ty) >= measured, "{ty}");
        }
        assert!(weight_rel_rms(Q8_0) < weight_rel_rms(Q6_K));
        assert!(weight_rel_rms(Q6_K) < weight_rel_rms(Q4_K));
        assert!(weight_rel_rms(Q4_K) < weight_rel_rms(Q3_K));
        assert!(weight_rel_rms(Q3_K) < weight_rel_rms(Q2_K));
        assert_eq!(weight_rel_rms(F32), 0.0);
        assert_eq!(activation_tolerance(0.0), F32_FLOOR);
    }

    #[test]
    fn rel_rms_by_hand() {
        assert_eq!(rel_rms(&[1.0, 2.0], &[1.0, 2.0]), 0.0);
        // error (0, 1), reference (0, 2): 1/2
        assert_eq!(rel_rms(&[0.0, 3.0], &[0.0, 2.0]), 0.5);
        assert!(rel_rms(&[1.0], &[0.0]).is_infinite());
        assert!(rel_rms(&[f32::NAN], &[1.0]).is_nan());
    }
}
