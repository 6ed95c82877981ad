//! GGUF tensor types on the GPU: kernel names per type and the lookup tables the IQ / FP4
//! decoders need, uploaded from `gguf::quant::lookup_tables()` (the same data the CPU oracle uses).

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr};
use gguf::GgmlType;

use crate::error::KernelError;

/// Kernel names of one type in the `dequant` and `gemv` modules.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TypeKernels {
    pub dequant: &'static str,
    pub dequant_bf16: &'static str,
    pub get_rows: &'static str,
    pub gemv: &'static str,
    /// The GEMV variant computing 4 rows per block.
    pub gemv4: &'static str,
    /// The GEMV variant splitting each row over K across the block's 4 warps.
    pub gemvs: &'static str,
}

macro_rules! kernels_for {
    ($s:literal) => {
        TypeKernels {
            dequant: concat!("dequant_", $s),
            dequant_bf16: concat!("dequant_bf16_", $s),
            get_rows: concat!("get_rows_", $s),
            gemv: concat!("gemv_", $s),
            gemv4: concat!("gemv4_", $s),
            gemvs: concat!("gemvs_", $s),
        }
    };
}

/// The kernels for `ty` in the GGUF layout or (`packed`, for the types `crate::repack` packs) in
/// the repacked layout. Every type `gguf::quant::reference::dequantize` accepts has them.
pub(crate) fn type_kernels(ty: GgmlType, packed: bool) -> TypeKernels {
    use GgmlType::*;
    if packed {
        match ty {
            Q4_0 => return kernels_for!("q4_0_r"),
            Q4_1 => return kernels_for!("q4_1_r"),
            Q5_0 => return kernels_for!("q5_0_r"),
            Q5_1 => return kernels_for!("q5_1_r"),
            Q8_0 => return kernels_for!("q8_0_r"),
            Q6_K => return kernels_for!("q6_k_r"),
            IQ4_NL => return kernels_for!("iq4_nl_r"),
            _ => {}
        }
    }
    match ty {
        F32 => kernels_for!("f32"),
        F16 => kernels_for!("f16"),
        BF16 => kernels_for!("bf16"),
        F64 => kernels_for!("f64"),
        I8 => kernels_for!("i8"),
        I16 => kernels_for!("i16"),
        I32 => kernels_for!("i32"),
        I64 => kernels_for!("i64"),
        Q4_0 => kernels_for!("q4_0"),
        Q4_1 => kernels_for!("q4_1"),
        Q5_0 => kernels_for!("q5_0"),
        Q5_1 => kernels_for!("q5_1"),
        Q8_0 => kernels_for!("q8_0"),
        Q8_1 => kernels_for!("q8_1"),
        Q2_K => kernels_for!("q2_k"),
        Q3_K => kernels_for!("q3_k"),
        Q4_K => kernels_for!("q4_k"),
        Q5_K => kernels_for!("q5_k"),
        Q6_K => kernels_for!("q6_k"),
        Q8_K => kernels_for!("q8_k"),
        IQ2_XXS => kernels_for!("iq2_xxs"),
        IQ2_XS => kernels_for!("iq2_xs"),
        IQ2_S => kernels_for!("iq2_s"),
        IQ3_XXS => kernels_for!("iq3_xxs"),
        IQ3_S => kernels_for!("iq3_s"),
        IQ1_S => kernels_for!("iq1_s"),
        IQ1_M => kernels_for!("iq1_m"),
        IQ4_NL => kernels_for!("iq4_nl"),
        IQ4_XS => kernels_for!("iq4_xs"),
        TQ1_0 => kernels_for!("tq1_0"),
        TQ2_0 => kernels_for!("tq2_0"),
        MXFP4 => kernels_for!("mxfp4"),
        NVFP4 => kernels_for!("nvfp4"),
        Q1_0 => kernels_for!("q1_0"),
    }
}

/// Elements and bytes of one decoder block (plain types are decoded 32 elements at a time).
pub(crate) fn decoder_block(ty: GgmlType) -> (usize, usize) {
    if ty.block_size() == 1 {
        (32, 32 * ty.type_size())
    } else {
        (ty.block_size(), ty.type_size())
    }
}

/// Byte alignment the decoders assume for the start of a block (their widest load); a repacked
/// tensor must start 16-byte aligned.
pub(crate) fn block_alignment(ty: GgmlType, packed: bool) -> usize {
    use GgmlType::*;
    if packed {
        return 16;
    }
    match ty {
        F32 | F16 | BF16 | Q4_K | Q5_K | F64 | I16 | I32 | I64 => 16,
        IQ4_XS | Q5_1 => 8,
        Q4_1 | Q2_K | Q8_1 | Q8_K => 4,
        Q4_0 | Q5_0 | Q8_0 | Q3_K | Q6_K | IQ2_XXS | IQ2_XS | IQ2_S | IQ3_XXS | IQ3_S | IQ1_S
        | IQ1_M | IQ4_NL | TQ1_0 | TQ2_0 | NVFP4 | Q1_0 => 2,
        I8 | MXFP4 => 1,
    }
}

/// The `WMat` kernel parameter: a weight tensor on the device (quant.cuh).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct WMat {
    pub base: u64,
    /// Blocks in the whole tensor (region stride of the repacked layout).
    pub nblk: i64,
}

// SAFETY: plain struct laid out exactly as `struct WMat` in quant.cuh.
unsafe impl DeviceRepr for WMat {}

/// The `QTables` kernel parameter: device pointers to every lookup table.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub(crate) struct QTables {
    iq2xxs: u64,
    iq2xs: u64,
    iq2s: u64,
    iq3xxs: u64,
    iq3s: u64,
    iq1s: u64,
    kvalues: u64,
    fp4: u64,
}

// SAFETY: plain struct of device addresses, laid out exactly as `struct QTables` in quant.cuh.
unsafe impl DeviceRepr for QTables {}

/// The lookup tables resident on one device.
pub(crate) struct DeviceTables {
    _bufs: Vec<CudaSlice<u8>>,
    pub params: QTables,
}

impl DeviceTables {
    pub(crate) fn upload(stream: &std::sync::Arc<CudaStream>) -> Result<Self, KernelError> {
        let t = gguf::quant::lookup_tables().map_err(|e| KernelError::BadShape {
            op: "tables",
            msg: e.to_string(),
        })?;
        let flat_u8 = |rows: &[[u8; 8]]| rows.iter().flatten().copied().collect::<Vec<u8>>();
        let flat_u4 = |rows: &[[u8; 4]]| rows.iter().flatten().copied().collect::<Vec<u8>>();
        let parts: Vec<Vec<u8>> = vec![
            flat_u8(&t.iq2xxs[..]),
            flat_u8(&t.iq2xs[..]),
            flat_u8(&t.iq2s[..]),
            flat_u4(&t.iq3xxs[..]),
            flat_u4(&t.iq3s[..]),
            t.iq1s.iter().flatten().map(|&v| v as u8).collect(),
            t.kvalues_iq4nl.iter().map(|&v| v as u8).collect(),
            t.kvalues_mxfp4.iter().map(|&v| v as u8).collect(),
        ];
        let mut bufs = Vec::with_capacity(parts.len());
        let mut ptrs = Vec::with_capacity(parts.len());
        for p in &parts {
            let b = stream
                .clone_htod(p.as_slice())
                .map_err(KernelError::driver("cuMemcpyHtoD"))?;
            let ptr = {
                let (ptr, _g) = b.device_ptr(stream);
                ptr
            };
            ptrs.push(ptr);
            bufs.push(b);
        }
        let params = QTables {
            iq2xxs: ptrs[0],
            iq2xs: ptrs[1],
            iq2s: ptrs[2],
            iq3xxs: ptrs[3],
            iq3s: ptrs[4],
            iq1s: ptrs[5],
            kvalues: ptrs[6],
            fp4: ptrs[7],
        };
        Ok(DeviceTables {
            _bufs: bufs,
            params,
        })
    }
}
