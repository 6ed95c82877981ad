//! `gguftool bench --kernels`: GPU kernel microbenchmarks at GLM-5's decode shapes against the
//! copy bandwidth measured in the same run.
//!
//! Method (device README METHOD.md): device time from CUDA events around a batch of back-to-back
//! launches (what an un-graphed decode step sees), median of several batches after a >= 100 ms
//! warm-up; weights rotate through copies whose total exceeds 3x the L2 cache so no launch reads
//! from L2; inputs are random bytes (never zeros). Bandwidth counts the bytes a launch must move
//! at least: the weight bytes for GEMV, input + output for dequantization, read + write for the
//! copy, the cached rows read for attention.

use std::process::ExitCode;

use anyhow::{Context, Result};
use gguf::GgmlType;
use kernels::{
    repack, AttnShape, Channels, CudaSlice, Gpu, IndexerShape, KeyLists, MatShape, MlaShape,
    QChannels, QMode,
};

struct Bench {
    g: std::sync::Arc<Gpu>,
    batches: usize,
    per_batch: usize,
    rows: Vec<serde_json::Value>,
    copy_gbs: f64,
    l2: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Random bytes, fast (xorshift64 per 8 bytes); content only needs to be non-trivial.
fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        out.extend_from_slice(&s.to_le_bytes());
    }
    out.truncate(n);
    out
}

/// Blocks of `ty` with random quants and finite, small f16 scales (as synth writes them).
fn sane_weights(ty: GgmlType, n_bytes: usize, seed: u64) -> Vec<u8> {
    let mut b = random_bytes(n_bytes, seed);
    let fields: &[usize] = match ty {
        GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q6_K => &[208],
        GgmlType::Q8_0 | GgmlType::IQ4_XS | GgmlType::IQ4_NL | GgmlType::Q4_0 | GgmlType::Q5_0 => {
            &[0]
        }
        _ => &[],
    };
    let ts = ty.type_size();
    if ty.block_size() > 1 {
        for (i, blk) in b.chunks_exact_mut(ts).enumerate() {
            for &f in fields {
                let v = half::f16::from_f32(1e-4 + 1e-5 * (i % 97) as f32);
                blk[f..f + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
    } else {
        // Plain floats: small values, never NaN.
        b = (0..n_bytes / 4)
            .flat_map(|i| ((i % 101) as f32 * 1e-3).to_le_bytes())
            .collect();
    }
    b
}

/// Activations: random values in [-1, 1).
fn acts(n: usize, seed: u64) -> Vec<f32> {
    random_bytes(4 * n, seed)
        .chunks_exact(4)
        .map(|c| f32::from(c[0]) / 128.0 - 1.0)
        .collect()
}

impl Bench {
    /// Median per-launch milliseconds of `f(i)` run `per_batch` times back to back.
    fn time(&self, mut f: impl FnMut(usize) -> Result<(), kernels::KernelError>) -> Result<f64> {
        let mut i = 0usize;
        // Warm-up: module load and compilation, then >= 100 ms of the same launches so the SM
        // clock has ramped up (it idles near 345 MHz and boosts to ~1980 MHz under load).
        let start = std::time::Instant::now();
        while start.elapsed() < std::time::Duration::from_millis(100) {
            for _ in 0..10 {
                f(i)?;
                i += 1;
            }
            self.g.synchronize()?;
        }
        let mut samples = Vec::with_capacity(self.batches);
        for _ in 0..self.batches {
            let ms = self.g.time_ms(|| {
                for _ in 0..self.per_batch {
                    f(i)?;
                    i += 1;
                }
                Ok(())
            })?;
            samples.push(f64::from(ms) / self.per_batch as f64);
        }
        Ok(median(samples))
    }

    fn record(&mut self, kind: &str, what: &str, bytes: f64, ms: f64) {
        let gbs = bytes / (ms * 1e-3) / 1e9;
        let frac = if self.copy_gbs > 0.0 {
            gbs / self.copy_gbs
        } else {
            0.0
        };
        say(&format!(
            "| {kind:<10} | {what:<52} | {:>9.1} | {:>8.1} | {:>5.0}% |",
            ms * 1e3,
            gbs,
            100.0 * frac
        ));
        self.rows.push(serde_json::json!({
            "kind": kind, "what": what, "us": ms * 1e3, "bytes": bytes, "gb_per_s": gbs,
            "fraction_of_copy": frac,
        }));
    }

    /// Copies of a weight tensor whose total exceeds 3x L2, in the device layout.
    fn weights(&self, shape: MatShape, seed: u64) -> Result<(CudaSlice<u8>, usize, usize)> {
        let mat = shape.bytes().context("size")?;
        let copies = (3 * self.l2).div_ceil(mat).max(1);
        let mut host = Vec::with_capacity(mat * copies);
        for c in 0..copies {
            let b = sane_weights(shape.ty, mat, seed + c as u64);
            host.extend(if shape.packed {
                repack::repack(shape.ty, &b).context("repack")?
            } else {
                b
            });
        }
        Ok((self.g.upload(&host)?, mat, copies))
    }

    /// The q8 GEMV and the f32 GEMV of one shape (batch `cols`), weights rotated.
    fn gemv_pair(
        &mut self,
        name: &str,
        ty: GgmlType,
        rows: usize,
        k: usize,
        slabs: usize,
        cols: usize,
    ) -> Result<()> {
        let g = self.g.clone();
        let packed = repack::is_packed(ty);
        let shape = MatShape {
            ty,
            rows,
            k,
            slabs,
            packed,
        };
        let (w, mat, copies) = self.weights(shape, 13)?;
        let x = g.upload(&acts(cols * slabs * k, 3))?;
        let mut y: CudaSlice<f32> = g.zeros(cols * slabs * rows)?;
        let q = g.quantize_q8(&x, cols * slabs, k, k)?;
        let ch = QChannels {
            count: slabs,
            ncols: cols,
            ids: None,
            xidx: None,
            x_div: 1,
            yidx: None,
            y_stride: rows,
            y_rows: cols * slabs,
        };
        let ms = self.time(|i| {
            let c = i % copies;
            let wv = w.slice(c * mat..(c + 1) * mat);
            g.gemv_q(shape, &wv, QMode::Plain, ch, &q, &mut y)
        })?;
        self.record("gemv q8", &format!("{ty} {name} x{cols}"), mat as f64, ms);
        if cols <= 8 {
            let chf = Channels {
                count: slabs * cols,
                ids: None,
                x_stride: k,
                x_div: 1,
                y_stride: rows,
            };
            let ms = self.time(|i| {
                let c = i % copies;
                let wv = w.slice(c * mat..(c + 1) * mat);
                g.gemv_batched(shape, &wv, chf, &x, &mut y)
            })?;
            self.record("gemv f32", &format!("{ty} {name} x{cols}"), mat as f64, ms);
        }
        Ok(())
    }
}

impl Bench {
    /// The int8 tensor-core product (mmq) of one dense shape at `cols` columns, beside what a
    /// step of that many rows takes without it: the 8-column GEMVs (`cols / 8` channels, each
    /// reading the weights) and, from 9 rows, the bf16 dequantize + cuBLAS GEMM.
    fn mmq_dense(
        &mut self,
        name: &str,
        ty: GgmlType,
        rows: usize,
        k: usize,
        cols: usize,
    ) -> Result<()> {
        let g = self.g.clone();
        let shape = MatShape {
            ty,
            rows,
            k,
            slabs: 1,
            packed: repack::is_packed(ty),
        };
        if !kernels::mmq_supported(&shape) {
            return Ok(());
        }
        let (w, mat, copies) = self.weights(shape, 17)?;
        let x = g.upload(&acts(cols * k, 3))?;
        let mut y: CudaSlice<f32> = g.zeros(cols * rows)?;
        let q = g.quantize_q8(&x, cols, k, k)?;
        let ch = |ncols: usize| QChannels {
            count: cols.div_ceil(ncols),
            ncols,
            ids: None,
            xidx: None,
            x_div: 1,
            yidx: None,
            y_stride: rows,
            y_rows: cols,
        };
        let wv = |i: usize| w.slice((i % copies) * mat..(i % copies + 1) * mat);
        let ms = self.time(|i| g.mmq(shape, &wv(i), QMode::Plain, ch(cols), &q, &mut y))?;
        self.record("mmq", &format!("{ty} {name} x{cols}"), mat as f64, ms);
        // Each k-split the kernel allows (the plan's choice trades blocks per SM against the
        // activations' re-reads from L2: a block of `8 / ks` row tiles reads all of them).
        for ks in [1usize, 2, 4, 8] {
            // Splits the shape refuses or whose ring exceeds the shared memory have no launch.
            if !kernels::mmq_ks_allowed(ks, k) || !g.mmq_fits_ks(&shape, cols, false, ks) {
                continue;
            }
            g.force_mmq_ksplit(Some(ks))?;
            let r = self.time(|i| g.mmq(shape, &wv(i), QMode::Plain, ch(cols), &q, &mut y));
            g.force_mmq_ksplit(None)?;
            self.record(
                "mmq ks",
                &format!("{ty} {name} x{cols} ks {ks}"),
                mat as f64,
                r?,
            );
        }
        // K-slices with 8 row tiles per block: the plan's choice (the default) and given
        // counts (1 = none, `GGUFTOOL_MMQ_SLICES=1`).
        let prev = g.mmq_slices();
        for kz in [
            None,
            Some(1usize),
            Some(2),
            Some(3),
            Some(4),
            Some(6),
            Some(8),
            Some(16),
        ] {
            g.force_mmq_slices(kz)?;
            let r = self.time(|i| g.mmq(shape, &wv(i), QMode::Plain, ch(cols), &q, &mut y));
            g.force_mmq_slices(prev)?;
            let what = kz.map_or("plan".to_string(), |z| z.to_string());
            self.record(
                "mmq kz",
                &format!("{ty} {name} x{cols} ks 1 kz {what}"),
                mat as f64,
                r?,
            );
        }
        let ms = self.time(|i| g.gemv_q(shape, &wv(i), QMode::Plain, ch(8), &q, &mut y))?;
        self.record(
            "gemv q8",
            &format!("{ty} {name} x{cols} as {} x8 launches' channels", cols / 8),
            mat as f64,
            ms,
        );
        if cols > 8 {
            let ms = self.time(|i| g.matmul_bf16(shape, &wv(i), &x, cols, &mut y))?;
            self.record("gemm bf16", &format!("{ty} {name} x{cols}"), mat as f64, ms);
        }
        Ok(())
    }
}

pub fn run(args: &super::Args, device: usize) -> Result<ExitCode> {
    let g = Gpu::get(device).context("opening the CUDA device")?;
    let info = g.info().clone();
    say(&format!(
        "device {}: {} (sm_{}{}, {} SMs, {:.0} GiB, L2 {} MiB)",
        info.ordinal,
        info.name,
        info.compute_capability.0,
        info.compute_capability.1,
        info.sm_count,
        info.total_mem as f64 / (1u64 << 30) as f64,
        info.l2_bytes >> 20
    ));
    let mut b = Bench {
        g: g.clone(),
        batches: if args.quick { 3 } else { 7 },
        per_batch: if args.quick { 5 } else { 20 },
        rows: Vec::new(),
        copy_gbs: 0.0,
        l2: (info.l2_bytes as usize).max(32 << 20),
    };
    say("| kind       | what                                                 | us/launch | GB/s     | copy  |");
    say("|------------|------------------------------------------------------|-----------|----------|-------|");

    // 1. Copy bandwidth: the ceiling the others are measured against.
    let copy_bytes: usize = if args.quick { 256 << 20 } else { 2 << 30 };
    let src: CudaSlice<u8> = g.upload(&random_bytes(copy_bytes, 7))?;
    let mut dst: CudaSlice<u8> = g.zeros(copy_bytes)?;
    let ms = b.time(|_| g.copy(&src, &mut dst))?;
    b.copy_gbs = 2.0 * copy_bytes as f64 / (ms * 1e-3) / 1e9;
    b.record(
        "copy",
        &format!("device-to-device {} MiB (read+write)", copy_bytes >> 20),
        2.0 * copy_bytes as f64,
        ms,
    );
    drop((src, dst));

    // 2. Decode GEMVs at the bench model's shapes (bench-models.md), q8 and f32 activations.
    let mut shapes: Vec<(&str, GgmlType, usize, usize, usize, usize)> = vec![
        ("attn_output 6144x16384", GgmlType::Q4_K, 6144, 16384, 1, 1),
        ("q_b 16384x2048", GgmlType::Q4_K, 16384, 2048, 1, 1),
        ("q_a 2048x6144", GgmlType::Q4_K, 2048, 6144, 1, 1),
        ("kv_a 576x6144", GgmlType::Q4_K, 576, 6144, 1, 1),
        ("attn_k_b 64x(512x192)", GgmlType::Q8_0, 512, 192, 64, 1),
        ("attn_v_b 64x(256x512)", GgmlType::Q4_K, 256, 512, 64, 1),
        ("ffn_down_shexp 6144x2048", GgmlType::Q6_K, 6144, 2048, 1, 1),
        ("attn_output 6144x16384", GgmlType::Q4_K, 6144, 16384, 1, 8),
        ("output 154880x6144", GgmlType::Q6_K, 154880, 6144, 1, 1),
    ];
    if !args.quick {
        shapes.extend([
            ("attn_output 6144x16384", GgmlType::Q5_K, 6144, 16384, 1, 1),
            ("attn_output 6144x16384", GgmlType::Q6_K, 6144, 16384, 1, 1),
            ("attn_output 6144x16384", GgmlType::Q8_0, 6144, 16384, 1, 1),
            (
                "attn_output 6144x16384",
                GgmlType::IQ4_XS,
                6144,
                16384,
                1,
                1,
            ),
            ("attn_output 6144x16384", GgmlType::Q4_K, 6144, 16384, 1, 2),
            ("attn_output 6144x16384", GgmlType::Q4_K, 6144, 16384, 1, 4),
            ("attn_k_b 64x(512x192)", GgmlType::Q5_0, 512, 192, 64, 1),
            ("attn_k_b 64x(512x192)", GgmlType::IQ4_NL, 512, 192, 64, 1),
        ]);
    }
    for (name, ty, rows, k, slabs, cols) in shapes {
        b.gemv_pair(name, ty, rows, k, slabs, cols)?;
    }

    // 3. MoE decode, one token: gate+up+SiLU over 8 experts (one launch), down + weighted sum
    //    (one launch), experts 2048x6144 out of 32 (rotated expert choices).
    {
        let (ne, ff, d, top) = (32usize, 2048usize, 6144usize, 8usize);
        let gs = MatShape {
            ty: GgmlType::Q4_K,
            rows: ff,
            k: d,
            slabs: ne,
            packed: false,
        };
        let ds = MatShape {
            ty: GgmlType::Q4_K,
            rows: d,
            k: ff,
            slabs: ne,
            packed: false,
        };
        let gw = g.upload(&sane_weights(
            GgmlType::Q4_K,
            gs.bytes().context("size")?,
            21,
        ))?;
        let uw = g.upload(&sane_weights(
            GgmlType::Q4_K,
            gs.bytes().context("size")?,
            22,
        ))?;
        let dw = g.upload(&sane_weights(
            GgmlType::Q4_K,
            ds.bytes().context("size")?,
            23,
        ))?;
        let x = g.upload(&acts(d, 5))?;
        let q = g.quantize_q8(&x, 1, d, d)?;
        let act0 = g.upload(&acts(top * ff, 6))?;
        let qa = g.quantize_q8(&act0, top, ff, ff)?;
        let wts = g.upload(&vec![0.125f32; top])?;
        let id_sets: Vec<CudaSlice<i32>> = (0..4)
            .map(|s| {
                g.upload(
                    &(0..top)
                        .map(|j| ((s * top + j) % ne) as i32)
                        .collect::<Vec<_>>(),
                )
            })
            .collect::<Result<_, _>>()?;
        let mut act: CudaSlice<f32> = g.zeros(top * ff)?;
        let ms = b.time(|i| {
            let ids = id_sets[i % id_sets.len()].as_view();
            let ch = QChannels {
                count: top,
                ncols: 1,
                ids: Some(&ids),
                xidx: None,
                x_div: top,
                yidx: None,
                y_stride: ff,
                y_rows: top,
            };
            g.gemv_q(gs, &gw, QMode::Glu(&uw), ch, &q, &mut act)
        })?;
        let slab = gs.slab_bytes().context("size")?;
        b.record(
            "moe glu",
            &format!("Q4_K gate+up 8 of {ne} experts 2048x6144"),
            (2 * slab * top) as f64,
            ms,
        );
        let mut out: CudaSlice<f32> = g.zeros(d)?;
        let wv = wts.as_view();
        let ms = b.time(|i| {
            let ids = id_sets[i % id_sets.len()].as_view();
            let ch = QChannels {
                count: 1,
                ncols: 1,
                ids: Some(&ids),
                xidx: None,
                x_div: 1,
                yidx: None,
                y_stride: d,
                y_rows: 1,
            };
            g.gemv_q(
                ds,
                &dw,
                QMode::Combine {
                    weights: &wv,
                    topk: top,
                },
                ch,
                &qa,
                &mut out,
            )
        })?;
        b.record(
            "moe down",
            &format!("Q4_K down+sum 8 of {ne} experts 6144x2048"),
            (slab * top) as f64,
            ms,
        );
        let ms = b.time(|_| g.quantize_q8(&x, 1, d, d).map(|_| ()))?;
        b.record("quantize", "q8 activations 1x6144", (d * 4) as f64, ms);
    }

    // 3b. Steps of 8-64 rows: the int8 tensor-core product against the paths those steps take
    //     with it off (GGUFTOOL_MMQ=0), dense and on the grouped MoE tiles of 256 experts.
    for cols in [8usize, 16, 32, 64] {
        b.mmq_dense("attn_output 6144x16384", GgmlType::Q4_K, 6144, 16384, cols)?;
        if !args.quick {
            b.mmq_dense("q_a 2048x6144", GgmlType::Q4_K, 2048, 6144, cols)?;
            b.mmq_dense("ffn_down_shexp 6144x2048", GgmlType::Q6_K, 6144, 2048, cols)?;
        }
    }
    {
        let (ne, ff, d, top) = (256usize, 2048usize, 6144usize, 8usize);
        let gs = MatShape {
            ty: GgmlType::Q4_K,
            rows: ff,
            k: d,
            slabs: ne,
            packed: false,
        };
        let gw = g.upload(&sane_weights(
            GgmlType::Q4_K,
            gs.bytes().context("size")?,
            31,
        ))?;
        let uw = g.upload(&sane_weights(
            GgmlType::Q4_K,
            gs.bytes().context("size")?,
            32,
        ))?;
        let slab = gs.slab_bytes().context("size")?;
        // Routing spread like a trained router's choices over many tokens, and concentrated
        // (every token the same 8 experts: the synth bench model's prompts behave so, their
        // pp64 costing twice pp32 per token on 8-column tiles), in 8-column tiles only and in
        // the two tile sets the runtime makes (`moe_mmq_tile`).
        for n in [8usize, 16, 64, 512] {
            for spread in [true, false] {
                if !spread && n < 64 {
                    continue;
                }
                // Spread: token t's slot j picks expert (37 t + 101 j + 7) mod 256 (distinct
                // within a token: 101 is odd). Concentrated: slot j picks expert 31 j + 3.
                let ids: Vec<i32> = (0..n * top)
                    .map(|p| {
                        let (t, j) = (p / top, p % top);
                        let e = if spread {
                            37 * t + 101 * j + 7
                        } else {
                            31 * j + 3
                        };
                        (e % ne) as i32
                    })
                    .collect();
                let touched = {
                    let mut e = ids.clone();
                    e.sort_unstable();
                    e.dedup();
                    e.len()
                };
                let dids = g.upload(&ids)?;
                let x = g.upload(&acts(n * d, 33))?;
                let q = g.quantize_q8(&x, n, d, d)?;
                let mut act: CudaSlice<f32> = g.zeros(n * top * ff)?;
                let bytes = (2 * slab * touched) as f64;
                let mut wides = vec![None, kernels::moe_mmq_tile(n)];
                wides.dedup();
                for wide in wides {
                    let grp = g.moe_group(&dids, n * top, top, ne, wide)?;
                    let views: Vec<_> = grp
                        .sets
                        .iter()
                        .map(|s| (s.tile_expert.view(), s.tok.view(), s.pos.view()))
                        .collect();
                    let chans: Vec<QChannels<'_>> = grp
                        .sets
                        .iter()
                        .zip(&views)
                        .map(|(s, (te, tok, pos))| QChannels {
                            count: s.max_tiles,
                            ncols: s.width,
                            ids: Some(te),
                            xidx: Some(tok),
                            x_div: 1,
                            yidx: Some(pos),
                            y_stride: ff,
                            y_rows: n * top,
                        })
                        .collect();
                    let what = format!(
                        "Q4_K gate+up, {n} tok x 8/256 {}, {touched} touched, tiles 8{}",
                        if spread { "spread" } else { "same 8" },
                        wide.map_or(String::new(), |w| format!("+{w}"))
                    );
                    // One launch per tile set, as the runtime runs them.
                    let ms = b.time(|_| {
                        chans
                            .iter()
                            .try_for_each(|&ch| g.mmq(gs, &gw, QMode::Glu(&uw), ch, &q, &mut act))
                    })?;
                    b.record("moe mmq", &what, bytes, ms);
                    if wide.is_none() && n <= 64 {
                        let ch = chans[0];
                        let ms =
                            b.time(|_| g.gemv_q(gs, &gw, QMode::Glu(&uw), ch, &q, &mut act))?;
                        b.record("moe glu", &what, bytes, ms);
                    }
                }
            }
        }
    }

    // 4. Attention: the MLA latent kernel (64 heads, 576/512) dense and DSA-sparse, the generic
    //    kernel for comparison, and the DSA indexer + top-2048. A short decode step takes
    //    mla.cu's decode kernel, longer ones and prefill (bf16 cache) the tensor-core kernel; the
    //    tile kernel (f32 cache, or GGUFTOOL_MLA_TC=0) is timed beside them.
    let mla_kernels = [
        (Some(true), Some(false), "decode kernel"),
        (Some(false), Some(false), "tile kernel"),
        (None, Some(true), "tensor-core kernel"),
    ];
    for t_len in [16usize, 128, 2048, 32768] {
        let (heads, dk, dv) = (64usize, 576usize, 512usize);
        let kvb = g.upload(&bf16_bits(&acts(t_len * dk, 9)))?;
        let q = g.upload(&acts(heads * dk, 10))?;
        let mut o: CudaSlice<f32> = g.zeros(heads * dv)?;
        let m = mla_decode_shape(heads, dk, dv, t_len);
        for (kern, tc, name) in mla_kernels {
            kernels::force_mla_decode(kern);
            kernels::force_mla_tc(tc);
            let r = b.time(|_| g.mla_attention(&q, &kvb, None, &mut o, m));
            kernels::force_mla_decode(None);
            kernels::force_mla_tc(None);
            b.record(
                "mla",
                &format!("dense, 64 heads, T {t_len}, bf16 cache, {name}"),
                (t_len * dk * 2) as f64,
                r?,
            );
        }
    }
    // A 512-token prefill's causal attention (each token over the keys up to its own).
    {
        let (heads, dk, dv, tokens) = (64usize, 576usize, 512usize, 512usize);
        let kvb = g.upload(&bf16_bits(&acts(tokens * dk, 9)))?;
        let q = g.upload(&acts(tokens * heads * dk, 10))?;
        let mut o: CudaSlice<f32> = g.zeros(tokens * heads * dv)?;
        let m = MlaShape {
            tokens,
            pos0: 0,
            ..mla_decode_shape(heads, dk, dv, tokens)
        };
        for (tc, name) in [(Some(false), "tile kernel"), (Some(true), "tensor cores")] {
            kernels::force_mla_tc(tc);
            let r = b.time(|_| g.mla_attention(&q, &kvb, None, &mut o, m));
            kernels::force_mla_tc(None);
            b.record(
                "mla",
                &format!("prefill {tokens} tokens causal, 64 heads, bf16 cache, {name}"),
                (tokens * dk * 2) as f64,
                r?,
            );
        }
    }
    for t_len in [2048usize, 4096, 32768] {
        let (heads, dk, dv) = (64usize, 576usize, 512usize);
        let kv = g.upload(&acts(t_len * dk, 9))?;
        let kvb = g.upload(&bf16_bits(&acts(t_len * dk, 9)))?;
        let q = g.upload(&acts(heads * dk, 10))?;
        let mut o: CudaSlice<f32> = g.zeros(heads * dv)?;
        let m = mla_decode_shape(heads, dk, dv, t_len);
        let n_sel = 2048.min(t_len);
        let sel: Vec<i32> = (0..n_sel).map(|j| ((j * 7919) % t_len) as i32).collect();
        let dsel = g.upload(&sel)?;
        let sv = dsel.as_view();
        if t_len <= 4096 {
            let ms = b.time(|_| g.mla_attention(&q, &kv, None, &mut o, m))?;
            b.record(
                "mla",
                &format!("dense, 64 heads, T {t_len}, f32 cache"),
                (t_len * dk * 4) as f64,
                ms,
            );
            let ms = b.time(|_| g.mla_attention(&q, &kvb, None, &mut o, m))?;
            b.record(
                "mla",
                &format!("dense, 64 heads, T {t_len}, bf16 cache"),
                (t_len * dk * 2) as f64,
                ms,
            );
        }
        let keys = || {
            Some(KeyLists {
                idx: &sv,
                n_keys: n_sel,
                stride: n_sel,
            })
        };
        for (tc, name) in [(Some(false), "tile kernel"), (Some(true), "tensor cores")] {
            kernels::force_mla_tc(tc);
            let r = b.time(|_| g.mla_attention(&q, &kvb, keys(), &mut o, m));
            kernels::force_mla_tc(None);
            b.record(
                "mla",
                &format!("sparse {n_sel} of T {t_len}, bf16 cache, {name}"),
                (n_sel * dk * 2) as f64,
                r?,
            );
        }
        if t_len == 2048 {
            let shape = AttnShape {
                tokens: 1,
                heads,
                kv_heads: 1,
                d_k: dk,
                d_v: dv,
                q_tok_stride: heads * dk,
                q_head_stride: dk,
                k_stride: dk,
                v_stride: dk,
                kv_len: t_len,
                o_tok_stride: heads * dv,
                o_head_stride: dv,
                scale: 1.0 / 16.0,
                pos0: t_len - 1,
            };
            let ms = b.time(|_| g.attention(&q, &kv, &kv, None, &mut o, shape))?;
            b.record(
                "attention",
                &format!("generic kernel, 64 heads, T {t_len}"),
                (t_len * dk * 4) as f64,
                ms,
            );
        }
        let (ih, id) = (32usize, 128usize);
        let kc = g.upload(&acts(t_len * id, 19))?;
        let qi = g.upload(&acts(ih * id, 20))?;
        let wi = g.upload(&vec![0.1f32; ih])?;
        let pos = g.upload(&[t_len as i32 - 1])?;
        let mut sc: CudaSlice<f32> = g.zeros(t_len)?;
        let ish = IndexerShape {
            tokens: 1,
            heads: ih,
            dim: id,
            q_stride: ih * id,
            k_stride: id,
            kv_len: t_len,
            w_stride: ih,
            out_stride: t_len,
            scale: 1.0 / (id as f32).sqrt(),
        };
        let ms = b.time(|_| g.indexer_scores(&qi, &kc, &wi, &pos, &mut sc, ish))?;
        b.record(
            "indexer",
            &format!("scores 32x128, T {t_len}, f32 keys"),
            (t_len * id * 4) as f64,
            ms,
        );
        // The fast path's bf16 key cache, through each scorer (indexer_scores.cu; nothing
        // forced: the tensor-core scorer, the default where it fits).
        let kcb = g.upload(&bf16_bits(&acts(t_len * id, 19)))?;
        for (lanes, name) in [
            (Some(false), "warp per key"),
            (Some(true), "lane per key"),
            (None, "tensor cores"),
        ] {
            kernels::force_indexer_lanes(lanes);
            let r = b.time(|_| g.indexer_scores(&qi, &kcb, &wi, &pos, &mut sc, ish));
            kernels::force_indexer_lanes(None);
            b.record(
                "indexer",
                &format!("scores 32x128, T {t_len}, bf16 keys, {name}"),
                (t_len * id * 2) as f64,
                r?,
            );
        }
        let mut selo: CudaSlice<i32> = g.zeros(2048)?;
        let ms = b.time(|_| g.topk(&sc, 1, t_len, t_len, 2048, &mut selo, None))?;
        b.record(
            "topk",
            &format!("top-2048 of T {t_len}"),
            (t_len * 4) as f64,
            ms,
        );
    }

    // 5. Dequantization (the first half of the bf16 prefill GEMM) of an attn_output matrix.
    for ty in [GgmlType::Q4_K, GgmlType::Q6_K] {
        let n = 6144usize * 16384;
        let bytes = ty.row_bytes(n as u64).context("size")? as usize;
        let packed = repack::is_packed(ty);
        let host = sane_weights(ty, bytes, 11);
        let host = if packed {
            repack::repack(ty, &host).context("repack")?
        } else {
            host
        };
        let w = g.upload(&host)?;
        let mut out: CudaSlice<f32> = g.zeros(n)?;
        let ms = b.time(|_| g.dequantize_layout(ty, packed, &w, &mut out))?;
        b.record(
            "dequant",
            &format!("{ty} 6144x16384 -> f32"),
            (bytes + 4 * n) as f64,
            ms,
        );
    }

    if args.json {
        let doc = serde_json::json!({
            "device": info.name, "compute_capability": format!("{}.{}", info.compute_capability.0, info.compute_capability.1),
            "sm_count": info.sm_count, "copy_gb_per_s": b.copy_gbs, "results": b.rows,
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    }
    Ok(ExitCode::SUCCESS)
}

/// Human-readable lines go to stderr, so `--json` leaves stdout to the JSON document.
fn say(s: &str) {
    eprintln!("{s}");
}

/// One decode token's MLA call over `t_len` cached rows (dense q and o rows).
fn mla_decode_shape(heads: usize, dk: usize, dv: usize, t_len: usize) -> MlaShape {
    MlaShape {
        tokens: 1,
        heads,
        d: dk,
        d_v: dv,
        q_tok_stride: heads * dk,
        q_head_stride: dk,
        kv_stride: dk,
        kv_len: t_len,
        o_tok_stride: heads * dv,
        o_head_stride: dv,
        scale: 1.0 / 16.0,
        pos0: t_len - 1,
    }
}

/// bf16 bit patterns of `v` (a bf16 cache's contents).
fn bf16_bits(v: &[f32]) -> Vec<u16> {
    v.iter()
        .map(|&x| half::bf16::from_f32(x).to_bits())
        .collect()
}
