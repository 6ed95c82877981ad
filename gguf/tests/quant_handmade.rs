//! Types gguf-py cannot dequantize (activation blocks Q8_1/Q8_K, Q1_0, the plain F64/I* types):
//! hand-built blocks whose expected values are worked out in the comments from ggml's layouts
//! (ggml-common.h) and spec §5.

use gguf::quant::{dequantize_to_vec, reference};
use gguf::GgmlType;

fn both(ty: GgmlType, data: &[u8]) -> Vec<f32> {
    let fast = dequantize_to_vec(ty, data).unwrap_or_else(|e| panic!("{ty}: {e}"));
    let mut r = vec![0.0f32; fast.len()];
    reference::dequantize(ty, data, &mut r).unwrap_or_else(|e| panic!("{ty}: {e}"));
    assert_eq!(
        fast.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        r.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
        "{ty}: fast and reference differ"
    );
    fast
}

#[test]
fn q8_1_is_d_times_q_and_ignores_s() {
    // {f16 d = 0.5 (0x3800), f16 s = 123.0 (unused for values), i8 qs[32]}
    let mut b = vec![0x00, 0x38, 0xb0, 0x57];
    let qs: [i8; 32] = std::array::from_fn(|i| match i {
        0 => -128,
        1 => -1,
        2 => 0,
        3 => 1,
        31 => 127,
        _ => 2,
    });
    b.extend(qs.iter().map(|&q| q as u8));
    assert_eq!(b.len(), 36);
    let y = both(GgmlType::Q8_1, &b);
    assert_eq!(&y[..4], &[-64.0, -0.5, 0.0, 0.5]);
    assert_eq!(y[4], 1.0);
    assert_eq!(y[31], 63.5);
}

#[test]
fn q8_k_is_f32_d_times_q() {
    // {f32 d = 0.25, i8 qs[256], i16 bsums[16]}; bsums are dot-product helpers, not values.
    let mut b = 0.25f32.to_le_bytes().to_vec();
    let qs: Vec<u8> = (0..256)
        .map(|i| (i as i8).wrapping_sub(-128) as u8)
        .collect(); // -128..127
    b.extend(&qs);
    b.extend(std::iter::repeat_n(0xffu8, 32));
    assert_eq!(b.len(), 292);
    let y = both(GgmlType::Q8_K, &b);
    assert_eq!(y[0], -32.0); // -128 * 0.25
    assert_eq!(y[128], 0.0);
    assert_eq!(y[255], 31.75); // 127 * 0.25
}

#[test]
fn q1_0_bits_select_plus_or_minus_d() {
    // {f16 d = -2.0 (0xc000), u8 qs[16]}, element e = bit e%8 of qs[e/8]; 1 -> +d, 0 -> -d.
    let mut b = vec![0x00, 0xc0];
    let mut qs = [0u8; 16];
    qs[0] = 0b0000_0101; // elements 0 and 2 set
    qs[15] = 0b1000_0000; // element 127 set
    b.extend(qs);
    let y = both(GgmlType::Q1_0, &b);
    assert_eq!(y.len(), 128);
    assert_eq!(&y[..4], &[-2.0, 2.0, -2.0, 2.0]);
    assert_eq!(y[126], 2.0);
    assert_eq!(y[127], -2.0);
}

#[test]
fn plain_integer_and_f64_types_convert_rounding_to_nearest_even() {
    let f64s: Vec<u8> = [
        1.0f64,
        -2.5,
        1e300,
        1.0 + 2f64.powi(-30),
        f64::from(f32::MAX),
    ]
    .iter()
    .flat_map(|v| v.to_le_bytes())
    .collect();
    assert_eq!(
        both(GgmlType::F64, &f64s),
        vec![1.0, -2.5, f32::INFINITY, 1.0, f32::MAX]
    );
    assert_eq!(
        both(GgmlType::I8, &[0x80, 0x7f, 0xff]),
        vec![-128.0, 127.0, -1.0]
    );
    assert_eq!(
        both(GgmlType::I16, &[0x00, 0x80, 0x34, 0x12]),
        vec![-32768.0, 4660.0]
    );
    // 2^24 + 1 is a tie between 2^24 and 2^24 + 2: even mantissa wins.
    let i32s: Vec<u8> = [16_777_217i32, -3]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert_eq!(both(GgmlType::I32, &i32s), vec![16_777_216.0, -3.0]);
    let i64s: Vec<u8> = [i64::MIN, 5].iter().flat_map(|v| v.to_le_bytes()).collect();
    assert_eq!(both(GgmlType::I64, &i64s), vec![-9.223_372e18, 5.0]);
}
