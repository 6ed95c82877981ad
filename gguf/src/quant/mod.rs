//! ggml quant block formats (spec §5): block structs, scalar reference dequantizers (the oracle,
//! kept block-by-block and obvious), fast dequantizers for bulk work, and the activation
//! quantizers (Q8_0/Q8_1/Q8_K) that CPU/GPU dot products consume.
//!
//! Every dequantizer is bit-exact with gguf-py 0.19.0 `gguf.quants.dequantize` (which computes
//! in float32 in the same operation order as ggml's `dequantize_row_*`): the golden data in
//! `tests/fixtures/quant-golden` checks that. Block bytes are decoded explicitly little-endian
//! from `&[u8]`, so file data never needs to be aligned.
//!
//! Errors carry no tensor name: callers that know one add it.

pub mod blocks;
pub mod quantize;
pub mod quantize_fast;
pub mod quantize_imatrix;
pub mod quantize_mix;
pub mod reference;

mod act;
pub(crate) mod fast;
mod floats;
pub(crate) mod tables;

pub use act::{quantize_row_q8_0, quantize_row_q8_1, quantize_row_q8_k};
pub use blocks::Block;
pub use floats::{bf16_to_f32, f16_to_f32, f32_to_f16};

use crate::GgmlType;
use rayon::prelude::*;

/// Why a buffer could not be (de)quantized.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QuantError {
    /// The input is not a whole number of blocks.
    #[error("{ty}: {len} bytes is not a multiple of the {block_bytes}-byte block")]
    PartialBlock {
        ty: GgmlType,
        len: usize,
        block_bytes: usize,
    },
    /// The output slice does not hold exactly the elements the input decodes to.
    #[error("{ty}: {in_bytes} bytes decode to {expected} values, but the output holds {got}")]
    OutputLength {
        ty: GgmlType,
        in_bytes: usize,
        expected: usize,
        got: usize,
    },
    /// An activation quantizer got a row that is not a whole number of blocks.
    #[error("{ty}: {len} values is not a multiple of the block size {block_size}")]
    PartialRow {
        ty: GgmlType,
        len: usize,
        block_size: usize,
    },
    /// The operation does not exist for this type.
    #[error("{ty}: {what} is not supported")]
    Unsupported { ty: GgmlType, what: &'static str },
    /// An importance-matrix row that does not match the tensor's row length.
    #[error("{ty}: importance matrix has {got} values per row, the tensor {n_per_row}")]
    ImatrixLength {
        ty: GgmlType,
        n_per_row: usize,
        got: usize,
    },
    /// The embedded lookup tables (gguf/data/iq_tables.bin) are malformed: a build problem.
    #[error("embedded quant lookup tables are invalid: {0}")]
    Tables(String),
}

/// Elements that `n_bytes` of type `ty` decode to, checking that they are whole blocks.
pub fn n_elements(ty: GgmlType, n_bytes: usize) -> Result<usize, QuantError> {
    let block_bytes = ty.type_size();
    if !n_bytes.is_multiple_of(block_bytes) {
        return Err(QuantError::PartialBlock {
            ty,
            len: n_bytes,
            block_bytes,
        });
    }
    Ok(n_bytes / block_bytes * ty.block_size())
}

pub(crate) fn check_lengths(ty: GgmlType, data: &[u8], out: &[f32]) -> Result<(), QuantError> {
    let expected = n_elements(ty, data.len())?;
    if expected != out.len() {
        return Err(QuantError::OutputLength {
            ty,
            in_bytes: data.len(),
            expected,
            got: out.len(),
        });
    }
    Ok(())
}

/// Elements per parallel task: big enough that scheduling is noise, small enough to split a
/// single large tensor over all cores.
pub(crate) const TASK_ELEMS: usize = 1 << 16;

/// Blocks of `ty` per parallel task (at least one).
pub(crate) fn task_blocks(ty: GgmlType) -> usize {
    (TASK_ELEMS / ty.block_size()).max(1)
}

/// Dequantize `data` (whole blocks of `ty`) into `out`, in parallel over block ranges for large
/// inputs. Bit-identical to [`reference::dequantize`].
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    check_lengths(ty, data, out)?;
    let tables = tables::tables()?;
    if out.len() <= TASK_ELEMS {
        fast::dequantize_row(ty, data, out, tables);
        return Ok(());
    }
    let nb = task_blocks(ty);
    data.par_chunks(nb * ty.type_size())
        .zip(out.par_chunks_mut(nb * ty.block_size()))
        .for_each(|(d, o)| fast::dequantize_row(ty, d, o, tables));
    Ok(())
}

/// [`dequantize`] into a new vector.
pub fn dequantize_to_vec(ty: GgmlType, data: &[u8]) -> Result<Vec<f32>, QuantError> {
    let mut out = vec![0.0f32; n_elements(ty, data.len())?];
    dequantize(ty, data, &mut out)?;
    Ok(out)
}

/// Like [`dequantize`] but on the calling thread only, for callers (matmul) that already run one
/// row per task. Bit-identical to [`dequantize`].
pub fn dequantize_row(ty: GgmlType, row: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    check_lengths(ty, row, out)?;
    let tables = tables::tables()?;
    fast::dequantize_row(ty, row, out, tables);
    Ok(())
}

/// Iterates over the `N`-byte arrays of `data` (a trailing partial chunk is not yielded; callers
/// check lengths first). Gives the block decoders fixed-size arrays so their field offsets are
/// checked at compile time and no indexing can fail.
pub(crate) fn array_chunks<const N: usize>(data: &[u8]) -> impl Iterator<Item = &[u8; N]> {
    let mut rest = data;
    std::iter::from_fn(move || {
        let (head, tail) = rest.split_first_chunk::<N>()?;
        rest = tail;
        Some(head)
    })
}

/// Mutable counterpart of [`array_chunks`] for output values.
pub(crate) fn array_chunks_mut<const N: usize>(
    out: &mut [f32],
) -> impl Iterator<Item = &mut [f32; N]> {
    let mut rest = out;
    std::iter::from_fn(move || {
        let (head, tail) = std::mem::take(&mut rest).split_first_chunk_mut::<N>()?;
        rest = tail;
        Some(head)
    })
}

/// The IQ / FP4 lookup tables, borrowed from the embedded data file, for consumers that must
/// decode with exactly the data the CPU dequantizers use (the CUDA kernels upload these).
/// Added for the kernels crate (issue 8).
#[derive(Debug, Clone, Copy)]
pub struct LookupTables {
    pub iq2xxs: &'static [[u8; 8]; 256],
    pub iq2xs: &'static [[u8; 8]; 512],
    pub iq2s: &'static [[u8; 8]; 1024],
    pub iq3xxs: &'static [[u8; 4]; 256],
    pub iq3s: &'static [[u8; 4]; 512],
    pub iq1s: &'static [[i8; 8]; 2048],
    pub ksigns: &'static [u8; 128],
    pub kvalues_iq4nl: &'static [i8; 16],
    pub kvalues_mxfp4: &'static [i8; 16],
}

/// The decoded lookup tables (decoded once, on first use).
pub fn lookup_tables() -> Result<LookupTables, QuantError> {
    let t = tables::tables()?;
    Ok(LookupTables {
        iq2xxs: &t.iq2xxs,
        iq2xs: &t.iq2xs,
        iq2s: &t.iq2s,
        iq3xxs: &t.iq3xxs,
        iq3s: &t.iq3s,
        iq1s: &t.iq1s,
        ksigns: &t.ksigns,
        kvalues_iq4nl: &t.kvalues_iq4nl,
        kvalues_mxfp4: &t.kvalues_mxfp4,
    })
}
