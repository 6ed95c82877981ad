//! The tensor-core matrix product (kernels/cuda/mmq.cu) under CPU emulation, before any GPU has
//! run it: every weight type, mode, column width, k-split and channel map against the f64
//! oracle the GPU tests use (kernels/tests/common/oracle.rs `mmq_verify`: the products within
//! gemvq's f32 bound, NaN for bad expert ids, everything else untouched), launched with
//! `kernels::mmq_plan` / `mmq_plan_ks` exactly as `Gpu::mmq` launches. Under the emulator the
//! kernels' mma is the shuffle version (`mma_s8_16832_shfl`), which the first test checks
//! against the emulator's own model of the instruction and a CPU product; the GPU test
//! `mma_s8_selftest_matches_cpu` pins both to the hardware. Without a C++ compiler every test
//! prints "skipped: no C++ compiler" and passes.

// A launch takes the weights, the maps, the activations, the mode and the split, as Gpu::mmq.
#![allow(clippy::too_many_arguments)]

mod common;
#[path = "../../tests/common/oracle.rs"]
mod oracle;

use common::{compiler, say, Buf};

use gguf::GgmlType;
use kernels::{
    mmq_kernel_name, mmq_ks_allowed, mmq_plan, mmq_plan_ks, mmq_sliceable, mmq_stage_row_bytes,
    repack, MmqParams, MmqPlan, MmqX, QType, MOE_TILE, MOE_TILE_WIDTHS,
};
use kernels::{ops::Op, MatShape};
use kernels_emu::Module;
use oracle::*;

fn module(qt: QType) -> &'static Module {
    common::module(Op::Mmq(qt))
}

fn opt_addr<T: Copy>(b: &Option<Buf<T>>) -> u64 {
    b.as_ref().map_or(0, Buf::addr)
}

/// The mmq types and their GGUF types.
const TYPES: [(GgmlType, QType); 4] = [
    (GgmlType::Q4_K, QType::Q4K),
    (GgmlType::Q5_K, QType::Q5K),
    (GgmlType::Q6_K, QType::Q6K),
    (GgmlType::Q8_0, QType::Q8_0),
];

/// Weights of `slabs` matrices of `rows x k` in their device layout, and dequantized.
struct Weights {
    dev: Buf<u8>,
    deq: Vec<f32>,
    shape: MatShape,
}

fn weights(ty: GgmlType, slabs: usize, rows: usize, k: usize, r: &mut Rng) -> Weights {
    let bytes = sane_blocks(ty, slabs * rows * k, r);
    let deq = dequant_cpu(ty, &bytes);
    let packed = repack::is_packed(ty);
    let dev = if packed {
        repack::repack(ty, &bytes).unwrap()
    } else {
        bytes
    };
    Weights {
        dev: Buf::new(&dev),
        deq,
        shape: MatShape {
            ty,
            rows,
            k,
            slabs,
            packed,
        },
    }
}

/// q8a activations as the device holds them: quantize.cu's codes and records, from its CPU
/// emulation (bit-exact against the kernel on the GPU and under this emulator).
struct Q8 {
    x: Vec<f32>,
    rows: usize,
    qc: Vec<i8>,
    qd: Vec<f32>,
    codes: Buf<i8>,
    recs: Buf<u64>,
}

fn q8(r: &mut Rng, rows: usize, k: usize) -> Q8 {
    let x = activations(r, rows, k);
    let (qc, qd, qs) = q8_cpu(&x);
    let recs: Vec<u64> = qd
        .iter()
        .enumerate()
        .map(|(b, d)| {
            u64::from(d.to_bits())
                | u64::from(qs[2 * b] as u16) << 32
                | u64::from(qs[2 * b + 1] as u16) << 48
        })
        .collect();
    Q8 {
        codes: Buf::new(&qc),
        recs: Buf::new(&recs),
        x,
        rows,
        qc,
        qd,
    }
}

/// The host maps of one launch's channels (`ids`, `xidx`, `yidx`), owned.
struct Maps {
    count: usize,
    ncols: usize,
    ids: Option<Vec<i32>>,
    xidx: Option<Vec<i32>>,
    x_div: usize,
    yidx: Option<Vec<i32>>,
    y_stride: usize,
    y_rows: usize,
}

impl Maps {
    fn dense(ncols: usize, tokens: usize, rows: usize) -> Self {
        Maps {
            count: 1,
            ncols,
            ids: None,
            xidx: None,
            x_div: 1,
            yidx: None,
            y_stride: rows,
            y_rows: tokens,
        }
    }
    fn case(&self, w: &Weights) -> MmqCase<'_> {
        MmqCase {
            rows: w.shape.rows,
            k: w.shape.k,
            slabs: w.shape.slabs,
            count: self.count,
            ncols: self.ncols,
            ids: self.ids.as_deref(),
            xidx: self.xidx.as_deref(),
            x_div: self.x_div,
            yidx: self.yidx.as_deref(),
            y_stride: self.y_stride,
            y_rows: self.y_rows,
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Plain,
    Accumulate,
    Glu,
}

type MmqFn = unsafe extern "C" fn(MmqParams);

/// What a launch forces, as `Gpu::force_mmq_ksplit` / `force_mmq_slices` do: the warps
/// splitting K and the k-slices (`None`, `None`: the plan's own choice).
#[derive(Clone, Copy, Debug)]
struct Split {
    ks: Option<usize>,
    kz: Option<usize>,
}

impl From<Option<usize>> for Split {
    fn from(ks: Option<usize>) -> Split {
        Split { ks, kz: None }
    }
}

/// Shared memory a block may opt in to on an H100 / H200 (227 KB), the plans' limit here.
const SMEM: usize = 232_448;

/// One launch as `Gpu::mmq` makes it: the plan (`ks` / `kz` forced through `mmq_plan_ks` and
/// `MmqPlan::sliced`, else `mmq_plan` for an H200's 132 SMs), the parameter block, the kernel
/// of the width and mode, and for a sliced plan the reduce over a workspace that starts as NaN
/// (a partial sum the product did not write shows). Returns the output buffer (initially
/// `y0`) and the plan.
fn run(
    qt: QType,
    w: &Weights,
    w2: Option<&Weights>,
    mode: Mode,
    maps: &Maps,
    x: &Q8,
    y0: &[f32],
    split: Split,
) -> Option<(Vec<f32>, MmqPlan)> {
    let s = &w.shape;
    let glu = mode == Mode::Glu;
    let sliceable = mmq_sliceable(maps.count, maps.ids.is_some(), s.rows, maps.ncols, glu);
    let plan = match (split.ks, split.kz) {
        (None, None) => mmq_plan(
            qt, s.rows, s.k, maps.ncols, maps.count, glu, 132, 65_535, SMEM, sliceable,
        ),
        (ks, kz) => mmq_plan_ks(
            qt,
            s.rows,
            s.k,
            maps.ncols,
            maps.count,
            glu,
            65_535,
            SMEM,
            ks.unwrap_or(1),
        )
        .map(|p| match kz {
            Some(kz) if sliceable => p.sliced(kz),
            _ => p,
        }),
    }?;
    let name = mmq_kernel_name(qt, maps.ncols, glu, plan.kz > 1).unwrap();
    let m = module(qt);
    // SAFETY: every mmq entry takes one `struct Mmq` by value; MmqParams is its layout.
    let f: MmqFn = unsafe { m.entry(&name) }.unwrap();
    let (ids, xidx, yidx) = (
        maps.ids.as_deref().map(Buf::new),
        maps.xidx.as_deref().map(Buf::new),
        maps.yidx.as_deref().map(Buf::new),
    );
    let y = Buf::new(y0);
    let ws = Buf::filled(plan.ws_len(maps.ncols, s.rows, glu).max(1), f32::NAN);
    let qb = s.ty.block_size();
    let p = MmqParams {
        w: w.dev.addr(),
        w2: w2.map_or(0, |w| w.dev.addr()),
        nblk: (s.slabs * s.rows * (s.k / qb)) as i64,
        ids: opt_addr(&ids),
        xidx: opt_addr(&xidx),
        x: MmqX {
            qs: x.codes.addr(),
            ds: x.recs.addr(),
            rows: x.rows as i64,
        },
        y: y.addr(),
        yidx: opt_addr(&yidx),
        y_stride: maps.y_stride as i64,
        y_rows: maps.y_rows as i64,
        ws: if plan.kz > 1 { ws.addr() } else { 0 },
        nrows: s.rows as i32,
        k: s.k as i32,
        n_slabs: s.slabs as i32,
        count: maps.count as i32,
        ncols: maps.ncols as i32,
        x_div: maps.x_div as i32,
        ks: plan.ks as i32,
        accum: i32::from(mode == Mode::Accumulate),
        srow: mmq_stage_row_bytes(qt) as i32,
        kz: plan.kz as i32,
        wpz: plan.wpz as i32,
        pad: 0,
    };
    m.launch(&name, plan.grid, plan.block, plan.smem, &|| unsafe { f(p) })
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    if plan.kz > 1 {
        let rname = format!("mmq_reduce_{}", qt.suffix());
        // SAFETY: the reduce takes the same `struct Mmq`.
        let fr: MmqFn = unsafe { m.entry(&rname) }.unwrap();
        let blocks = (maps.ncols * s.rows).div_ceil(256).min(4 * 132) as u32;
        m.launch(&rname, [blocks, 1, 1], [256, 1, 1], 0, &|| unsafe { fr(p) })
            .unwrap_or_else(|e| panic!("{rname}: {e}"));
    }
    Some((y.to_vec(), plan))
}

/// Runs one launch and checks every output element with the shared oracle; `None` (said) when a
/// forced split's ring exceeds the shared memory (the plan never picks one; without a forced
/// split a plan must exist).
fn check(
    what: &str,
    qt: QType,
    w: &Weights,
    w2: Option<&Weights>,
    mode: Mode,
    maps: &Maps,
    x: &Q8,
    split: impl Into<Split>,
    r: &mut Rng,
) -> Option<MmqCheck> {
    let split = split.into();
    let n_y = (maps.y_rows.max(1) - 1) * maps.y_stride + w.shape.rows + 3;
    // Accumulate reads finite old values; the other modes must leave NaN where they do not
    // write and overwrite it where they do.
    let y0: Vec<f32> = match mode {
        Mode::Accumulate => r.vec(n_y, 2.0),
        _ => vec![f32::NAN; n_y],
    };
    let Some((y, plan)) = run(qt, w, w2, mode, maps, x, &y0, split) else {
        assert!(
            split.ks.is_some() || split.kz.is_some(),
            "mmq {what}: the plan found no launch that fits"
        );
        say(&format!(
            "mmq {what} {:?} ncols {} {mode:?} {split:?}: beyond the shared memory, not run",
            w.shape.ty, maps.ncols
        ));
        return None;
    };
    let om = match mode {
        Mode::Plain => MmqMode::Plain,
        Mode::Accumulate => MmqMode::Accumulate,
        Mode::Glu => MmqMode::Glu(&w2.unwrap().deq),
    };
    let c = mmq_verify(
        &maps.case(w),
        &w.deq,
        &om,
        &x.x,
        x.rows,
        &x.qc,
        &x.qd,
        &y0,
        &y,
    );
    say(&format!(
        "mmq {what} {:?} {}x{} ncols {} {mode:?} ks {} kz {} grid {:?}: {} written (worst \
         {:.3e} of tol), {} NaN, {} untouched",
        w.shape.ty,
        w.shape.rows,
        w.shape.k,
        maps.ncols,
        plan.ks,
        plan.kz,
        plan.grid,
        c.written,
        c.worst,
        c.nan,
        c.untouched
    ));
    assert!(
        c.ok,
        "mmq {what} {:?} ncols {} {mode:?} ks {}: {}",
        w.shape.ty,
        maps.ncols,
        plan.ks,
        c.first_bad.as_deref().unwrap_or("")
    );
    Some(c)
}

// ---------------------------------------------------------------------------------------------
// the fragment layout

type SelftestFn = unsafe extern "C" fn(*const i8, *const i8, *const i32, *mut i32, *mut i32);

#[test]
fn mma_shuffle_version_equals_the_instruction_model_and_cpu() {
    if !compiler("mma_shuffle_version_equals_the_instruction_model_and_cpu") {
        return;
    }
    let mut r = Rng::new("emu mma_s8_selftest");
    let m = module(QType::Q8_0);
    // SAFETY: the selftest's signature.
    let f: SelftestFn = unsafe { m.entry("mma_s8_selftest") }.unwrap();
    for trial in 0..4 {
        // Trial 0: the extremes (-128 * -128 sums, the largest products); then random codes.
        let (a, b): (Vec<i8>, Vec<i8>) = if trial == 0 {
            (
                vec![-128; 512],
                (0..256)
                    .map(|i| if i % 3 == 0 { 127 } else { -128 })
                    .collect(),
            )
        } else {
            (
                (0..512).map(|_| r.byte() as i8).collect(),
                (0..256).map(|_| r.byte() as i8).collect(),
            )
        };
        // Distinct C entries show any output permutation.
        let c: Vec<i32> = (0..128).map(|i| i * 1000 - 7 * trial).collect();
        let (ab, bb, cb) = (Buf::new(&a), Buf::new(&b), Buf::new(&c));
        let (d1, d2) = (Buf::new(&[0i32; 128]), Buf::new(&[0i32; 128]));
        let (pa, pb, pc) = (
            ab.addr() as *const i8,
            bb.addr() as *const i8,
            cb.addr() as *const i32,
        );
        let (p1, p2) = (d1.addr() as *mut i32, d2.addr() as *mut i32);
        m.launch("mma_s8_selftest", [1, 1, 1], [32, 1, 1], 0, &|| unsafe {
            f(pa, pb, pc, p1, p2)
        })
        .unwrap();
        let want = mma_s8_cpu(&a, &b, &c);
        assert_eq!(
            d1.to_vec(),
            want,
            "trial {trial}: the emulator's instruction model"
        );
        assert_eq!(d2.to_vec(), want, "trial {trial}: mma.cu's shuffle version");
    }
}

// ---------------------------------------------------------------------------------------------
// dense launches: every type, width, mode and k-split

/// Columns of the dense cases: each width with a partial last group (tokens below the width,
/// so whole column groups and single columns are dead), and one full width.
const WIDTHS: [(usize, usize); 5] = [(8, 5), (8, 8), (16, 9), (32, 20), (64, 33)];

/// One type: 40 rows (the last tile half past the end), K = 768 (6 steps: with ks = 4 the second
/// window holds 2 of 4 steps), every width, mode and allowed k-split, then the plan's own choice.
fn dense_type(ty: GgmlType, qt: QType) {
    let mut r = Rng::new(&format!("emu mmq dense {ty}"));
    let (rows, k) = (40usize, 768usize);
    let w = weights(ty, 1, rows, k, &mut r);
    let w2 = weights(ty, 1, rows, k, &mut r);
    let mut written = 0;
    for (nc, tokens) in WIDTHS {
        let x = q8(&mut r, tokens, k);
        let maps = Maps::dense(nc, tokens, rows);
        for mode in [Mode::Plain, Mode::Accumulate, Mode::Glu] {
            let w2o = (mode == Mode::Glu).then_some(&w2);
            // Every allowed split whose ring fits (at 64 columns K = 768 allows 4, which does
            // not: 4 stages of 512-k windows).
            let glu = mode == Mode::Glu;
            let mut splits: Vec<Split> = [1, 2, 4, 8]
                .into_iter()
                .filter(|&ks| {
                    mmq_ks_allowed(ks, k)
                        && mmq_plan_ks(qt, rows, k, nc, 1, glu, 65_535, SMEM, ks).is_some()
                })
                .map(|ks| Some(ks).into())
                .collect();
            // K-slices: 2 of 3 windows each, one window each (6), and with ks = 2 an uneven
            // pair (2 + 1 windows); the plan's own choice slices these dense launches too.
            for (ks, kz) in [(1, 2), (1, 6), (2, 2)] {
                if mmq_plan_ks(qt, rows, k, nc, 1, glu, 65_535, SMEM, ks).is_some() {
                    splits.push(Split {
                        ks: Some(ks),
                        kz: Some(kz),
                    });
                }
            }
            splits.push(None.into());
            for ks in splits {
                let c = check("dense", qt, &w, w2o, mode, &maps, &x, ks, &mut r)
                    .expect("only splits that fit");
                assert_eq!(c.written, tokens * rows, "every live output written");
                assert_eq!(c.nan, 0);
                written += c.written;
            }
        }
    }
    assert!(written > 0);
}

#[test]
fn mmq_dense_q4_k() {
    if compiler("mmq_dense_q4_k") {
        dense_type(GgmlType::Q4_K, QType::Q4K);
    }
}

#[test]
fn mmq_dense_q5_k() {
    if compiler("mmq_dense_q5_k") {
        dense_type(GgmlType::Q5_K, QType::Q5K);
    }
}

#[test]
fn mmq_dense_q6_k() {
    if compiler("mmq_dense_q6_k") {
        dense_type(GgmlType::Q6_K, QType::Q6K);
    }
}

#[test]
fn mmq_dense_q8_0() {
    if compiler("mmq_dense_q8_0") {
        dense_type(GgmlType::Q8_0, QType::Q8_0);
    }
}

/// Edge shapes: fewer rows than a tile, one step of K (Q8_0: 128), K of one superblock, 8 warps
/// splitting a long K over a single tile, and rows a whole number of blocks.
#[test]
fn mmq_small_and_split_shapes() {
    if !compiler("mmq_small_and_split_shapes") {
        return;
    }
    let mut r = Rng::new("emu mmq shapes");
    for (ty, qt) in TYPES {
        let kmin = if ty == GgmlType::Q8_0 { 128 } else { 256 };
        for (rows, k, nc, tokens, ks) in [
            (7usize, kmin, 8usize, 3usize, None),
            (16, kmin, 16, 16, None),
            (9, 2048, 8, 8, Some(8)),
            (128, 1024, 8, 2, Some(2)),
            (33, 1024, 64, 64, Some(2)),
        ] {
            let w = weights(ty, 1, rows, k, &mut r);
            let x = q8(&mut r, tokens, k);
            let maps = Maps::dense(nc, tokens, rows);
            let c = check("shape", qt, &w, None, Mode::Plain, &maps, &x, ks, &mut r)
                .expect("these splits fit");
            assert_eq!(c.written, tokens * rows);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// channels: grouped MoE tiles, unused tiles and columns, bad ids, strides

/// moe_sort.cu's `MoeTiles`, passed by value as the kernels take it.
#[repr(C)]
#[derive(Clone, Copy)]
struct MoeTiles {
    tile_expert: *mut i32,
    tok: *mut i32,
    pos: *mut i32,
    pair: *mut i32,
    max_tiles: i32,
    width: i32,
}

type CountFn = unsafe extern "C" fn(*const i32, i32, *mut i32);
type PlanFn = unsafe extern "C" fn(*const i32, i32, MoeTiles, MoeTiles, *mut i32, *mut i32);
type ScatterFn =
    unsafe extern "C" fn(*const i32, i32, i32, *const i32, *const i32, MoeTiles, MoeTiles);

/// One tile set's device buffers, every entry garbage (7) at first: moe_plan must reset the
/// ones nobody fills.
struct SetBufs {
    te: Buf<i32>,
    tok: Buf<i32>,
    pos: Buf<i32>,
    pair: Buf<i32>,
    max_tiles: usize,
    width: usize,
}

impl SetBufs {
    fn new(width: usize, max_tiles: usize) -> Self {
        SetBufs {
            te: Buf::filled(max_tiles.max(1), 7),
            tok: Buf::filled((max_tiles * width).max(1), 7),
            pos: Buf::filled((max_tiles * width).max(1), 7),
            pair: Buf::filled((max_tiles * width).max(1), 7),
            max_tiles,
            width,
        }
    }
    fn arg(&mut self) -> MoeTiles {
        MoeTiles {
            tile_expert: self.te.mut_ptr(),
            tok: self.tok.mut_ptr(),
            pos: self.pos.mut_ptr(),
            pair: self.pair.mut_ptr(),
            max_tiles: self.max_tiles as i32,
            width: self.width as i32,
        }
    }
}

/// moe_sort.cu itself (count, plan, scatter, launched as `Gpu::moe_group` launches them, its
/// tile counts) against the host grouping of its contract (oracle.rs `group_on_host`): 8-column
/// tiles only, and with a wide set of every width; skewed routing (one expert in every token,
/// experts of 9-12 pairs, experts of at most 8), empty slots, an expert nobody picks.
#[test]
fn moe_sort_maps_every_tile_width() {
    if !compiler("moe_sort_maps_every_tile_width") {
        return;
    }
    let m = common::module(Op::MoeSort);
    let (ne, tokens, top_k) = (7usize, 37usize, 3usize);
    let ids: Vec<i32> = (0..tokens * top_k)
        .map(|p| match (p % top_k, p % 11, p / top_k) {
            (_, 10, _) => -1,
            (0, _, _) => 2,
            (2, _, t) if t % 3 != 0 => -1,
            (s, _, t) => [0, 1, 3, 5, 6][(t + s) % 5],
        })
        .collect();
    let n = ids.len();
    let count: CountFn = unsafe { m.entry("moe_count") }.unwrap();
    let plan: PlanFn = unsafe { m.entry("moe_plan") }.unwrap();
    let scatter: ScatterFn = unsafe { m.entry("moe_scatter") }.unwrap();
    let mut wides: Vec<Option<usize>> = vec![None];
    wides.extend(MOE_TILE_WIDTHS.map(Some));
    for wide in wides {
        let want = group_on_host(&ids, top_k, ne, MOE_TILE, wide);
        let mut sets: Vec<SetBufs> = want
            .iter()
            .map(|w| SetBufs::new(w.width, w.tile_expert.len()))
            .collect();
        let small = sets[0].arg();
        let big = match sets.get_mut(1) {
            Some(s) => s.arg(),
            None => MoeTiles {
                tile_expert: std::ptr::null_mut(),
                tok: std::ptr::null_mut(),
                pos: std::ptr::null_mut(),
                pair: std::ptr::null_mut(),
                max_tiles: 0,
                width: 0,
            },
        };
        let dids = Buf::new(&ids);
        let mut counts = Buf::filled(ne, 0i32);
        let mut offsets = Buf::filled(ne, 0i32);
        let mut base = Buf::filled(ne, 0i32);
        let (n32, e32, k32) = (n as i32, ne as i32, top_k as i32);
        let (ip, cp, op, bp) = (
            dids.ptr(),
            counts.mut_ptr(),
            offsets.mut_ptr(),
            base.mut_ptr(),
        );
        m.launch("moe_count", [ne as u32, 1, 1], [256, 1, 1], 0, &|| unsafe {
            count(ip, n32, cp)
        })
        .unwrap();
        m.launch("moe_plan", [1, 1, 1], [1024, 1, 1], 0, &|| unsafe {
            plan(cp, e32, small, big, op, bp)
        })
        .unwrap();
        m.launch(
            "moe_scatter",
            [ne as u32, 1, 1],
            [1024, 1, 1],
            0,
            &|| unsafe { scatter(ip, n32, k32, op, bp, small, big) },
        )
        .unwrap();
        let mut ok = true;
        for (s, w) in sets.iter().zip(&want) {
            let cols = w.tok.len();
            ok &= s.te.to_vec()[..w.tile_expert.len()] == w.tile_expert[..]
                && s.tok.to_vec()[..cols] == w.tok[..]
                && s.pos.to_vec()[..cols] == w.pos[..]
                && s.pair.to_vec()[..cols] == w.pair[..];
        }
        say(&format!(
            "| moe_sort | {tokens} tok x {top_k}, {ne} experts | wide {wide:?} | {ok} |"
        ));
        assert!(
            ok,
            "moe_sort maps (wide {wide:?}) differ from the host grouping"
        );
        // The routing puts experts in both sets, so neither comparison is of empty maps.
        for w in &want {
            assert!(w.tile_expert.contains(&-1) && w.tile_expert.iter().any(|&e| e >= 0));
        }
    }
}

/// A MoE layer's grouped launches as the runtime makes them: gate + up + SiLU (GLU) from token
/// rows into sorted rows, then the down projection from sorted rows into pair rows; experts with
/// 0, 1, 8 (one full tile) and 9+ pairs, empty slots (-1), unused tiles at the end. Every type
/// for both launches (the gate/up type also runs the down, with its K), on each tile set of
/// 8-column tiles only and of 8-column tiles beside wide ones of 16 and 64 columns (expert 1's
/// 9 pairs).
#[test]
fn mmq_grouped_moe_tiles() {
    if !compiler("mmq_grouped_moe_tiles") {
        return;
    }
    let mut r = Rng::new("emu mmq grouped");
    let (ne, ff, d, tokens, top_k) = (5usize, 48usize, 256usize, 9usize, 2usize);
    // Expert 1: 9 pairs (two 8-column tiles), 3: none, 4: one; token 2's second slot empty.
    let ids: Vec<i32> = vec![1, 0, 1, 2, 1, -1, 1, 0, 1, 2, 1, 4, 1, 0, 1, 2, 1, 0];
    let live_pairs = ids.iter().filter(|&&e| e >= 0).count();
    for wide in [None, Some(16), Some(64)] {
        for set in group_on_host(&ids, top_k, ne, MOE_TILE, wide) {
            let (te, tok, pos, pair) = (set.tile_expert, set.tok, set.pos, set.pair);
            let tw = set.width;
            let set_live = tok.iter().filter(|&&t| t >= 0).count();
            assert!(te.contains(&-1) && set_live > 0);
            for (ty, qt) in TYPES {
                // gate/up: ff rows x d; down: d rows x ff_k (2 steps: room for a 2-warp split).
                let (d_in, ff_k) = (d, 256usize);
                let gate = weights(ty, ne, ff, d_in, &mut r);
                let up = weights(ty, ne, ff, d_in, &mut r);
                let x = q8(&mut r, tokens, d_in);
                let maps = Maps {
                    count: te.len(),
                    ncols: tw,
                    ids: Some(te.clone()),
                    xidx: Some(tok.clone()),
                    x_div: 1,
                    yidx: Some(pos.clone()),
                    y_stride: ff,
                    y_rows: live_pairs,
                };
                // (Q8_0's 64-column GLU ring does not fit with ks = 2: not run, said.)
                let mut ran = 0;
                for ks in [Some(1), Some(2)] {
                    let Some(c) = check(
                        "grouped glu",
                        qt,
                        &gate,
                        Some(&up),
                        Mode::Glu,
                        &maps,
                        &x,
                        ks,
                        &mut r,
                    ) else {
                        continue;
                    };
                    assert_eq!(c.written, set_live * ff);
                    ran += 1;
                }
                assert!(ran > 0, "ks = 1 always fits");
                // Down: sorted rows -> pair rows (the empty slot's row stays untouched).
                let down = weights(ty, ne, d, ff_k, &mut r);
                let act = q8(&mut r, live_pairs, ff_k);
                let maps = Maps {
                    count: te.len(),
                    ncols: tw,
                    ids: Some(te.clone()),
                    xidx: Some(pos.clone()),
                    x_div: 1,
                    yidx: Some(pair.clone()),
                    y_stride: d,
                    y_rows: tokens * top_k,
                };
                for ks in [Some(1), Some(2)] {
                    let c = check(
                        "grouped down",
                        qt,
                        &down,
                        None,
                        Mode::Plain,
                        &maps,
                        &act,
                        ks,
                        &mut r,
                    )
                    .expect("a plain ring fits");
                    assert_eq!(c.written, set_live * d);
                    assert!(c.untouched >= d, "the empty slot's row");
                }
            }
        }
    }
}

/// Channels without maps (slab ch % slabs, input rows (ch / x_div) * ncols + j), a bad expert id
/// (NaN outputs), an unused one (-1: nothing written), a channel whose columns all lack an
/// output row, output rows `y_stride` > rows apart (the gaps untouched), and x rows past the
/// input (dead columns).
#[test]
fn mmq_channel_maps_ids_and_strides() {
    if !compiler("mmq_channel_maps_ids_and_strides") {
        return;
    }
    let mut r = Rng::new("emu mmq channels");
    for (ty, qt) in TYPES {
        let (rows, k, slabs) = (24usize, 256usize, 3usize);
        let w = weights(ty, slabs, rows, k, &mut r);
        let w2 = weights(ty, slabs, rows, k, &mut r);
        // 5 channels of 8 columns over 2 activation row groups (x_div 2 + 1 partial): slabs
        // 0, 1, 2, 0, 1; the last group has 3 of 8 rows.
        let x = q8(&mut r, 19, k);
        let maps = Maps {
            count: 5,
            ncols: 8,
            ids: None,
            xidx: None,
            x_div: 2,
            yidx: None,
            y_stride: rows + 5,
            y_rows: 38,
        };
        for mode in [Mode::Plain, Mode::Glu] {
            let w2o = (mode == Mode::Glu).then_some(&w2);
            let c = check("no maps", qt, &w, w2o, mode, &maps, &x, None, &mut r).expect("a plan");
            // Channels 0, 1 read rows 0..8, 2, 3 rows 8..16, 4 rows 16..19; outputs < 38.
            assert_eq!(c.written, (8 + 8 + 8 + 8 + 3) * rows);
            assert!(c.untouched > 0);
        }
        // Ids: a valid expert, a bad one (NaN), -1 (nothing), one with every y row -1.
        let ids = vec![2, 7, -1, 1];
        let xidx: Vec<i32> = (0..32)
            .map(|i| [i % 11, -1][usize::from(i % 8 == 6)])
            .collect();
        let mut yidx: Vec<i32> = (0..32).map(|i| 31 - i).collect();
        for v in &mut yidx[24..32] {
            *v = -1;
        }
        yidx[3] = 40; // past y_rows: dead
        let x = q8(&mut r, 11, k);
        let maps = Maps {
            count: 4,
            ncols: 8,
            ids: Some(ids),
            xidx: Some(xidx),
            x_div: 1,
            yidx: Some(yidx),
            y_stride: rows,
            y_rows: 32,
        };
        for ks in [Some(1), Some(2)] {
            let c = check("ids", qt, &w, None, Mode::Accumulate, &maps, &x, ks, &mut r)
                .expect("8 columns fit");
            assert_eq!(
                c.written,
                6 * rows,
                "channel 0: 8 columns less one dead x, one dead y"
            );
            assert_eq!(c.nan, 7 * rows, "channel 1: bad id, 7 live columns");
        }
    }
}
