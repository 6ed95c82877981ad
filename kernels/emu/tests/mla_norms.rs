//! An MLA block's three norms as one launch (kernels/cuda/rmsnorm.cu `mla_norms_f32`) under CPU
//! emulation, before any GPU has run it: bit for bit what the three launches it replaces write
//! (`rmsnorm_f32` for q_a_norm with its q8 activations, `rmsnorm_rope_f32` for the latent cache
//! rows, `layernorm_rope_f32` for the indexer's cached keys), each launched as its own wrapper
//! launches it (`kernels::norm`: 512 threads and 4 parts for a 2,048-wide decode row, 256
//! threads for the 512-wide latent, 64 for the 128-wide keys), while the combined launch runs
//! every job on the widest block. GLM-5's shapes, 1 and 3 rows, both RoPE styles, f32 and bf16
//! cache rows, q8 on and off, the q_a job or the indexer job absent. Every output starts as NaN,
//! so a job that writes nothing fails; the normalised latent is also checked against the f64
//! oracle. Without a C++ compiler every test prints "skipped: no C++ compiler" and passes.

mod common;
#[path = "../../tests/common/oracle.rs"]
mod oracle;

use common::{compiler, module, say, Buf, RmsFn};
use kernels::{rope_inv_freq, Op};
use oracle::*;

type NormRopeFn = unsafe extern "C" fn(
    *mut f32,
    i64,
    i32,
    *const f32,
    *const f32,
    i32,
    f32,
    i32,
    i32,
    *const i32,
    *const f32,
    i32,
    *mut f32,
    *mut u16,
    i64,
);

/// rmsnorm.cu's `struct RmsJob`.
#[repr(C)]
#[derive(Clone, Copy)]
struct RmsJob {
    x: u64,
    x_stride: i64,
    res: u64,
    res_stride: i64,
    xo: u64,
    xo_stride: i64,
    w: u64,
    y: u64,
    y_stride: i64,
    qs: u64,
    qd: u64,
    n: i32,
    eps: f32,
    rows: i32,
    parts: i32,
    threads: i32,
}

/// norm_rows.cuh's `struct NormRopeJob`.
#[repr(C)]
#[derive(Clone, Copy)]
struct NormRopeJob {
    x: u64,
    x_stride: i64,
    w: u64,
    b: u64,
    pos: u64,
    inv_freq: u64,
    cf: u64,
    cb: u64,
    c_stride: i64,
    cols: i32,
    n: i32,
    eps: f32,
    off: i32,
    n_rot: i32,
    style: i32,
    rows: i32,
    threads: i32,
}

type MlaNormsFn = unsafe extern "C" fn(RmsJob, NormRopeJob, NormRopeJob);

/// GLM-5's q_lora_rank, kv_lora_rank + rope width, and indexer head width (its rope part).
const QA: usize = 2048;
const KV_N: usize = 512;
const KV_COLS: usize = 576;
const IX: usize = 128;
const ROT: usize = 64;

/// One case's inputs, shared by both ways of running it.
struct Case {
    rows: usize,
    style: i32,
    bf16: bool,
    q8: bool,
    with_q: bool,
    with_ix: bool,
    qa: Vec<f32>,
    qa_w: Vec<f32>,
    kv: Vec<f32>,
    kv_w: Vec<f32>,
    ix: Vec<f32>,
    ix_w: Vec<f32>,
    ix_b: Vec<f32>,
    pos: Vec<i32>,
    freq: Vec<f32>,
}

/// Everything a case writes: (q_a norm, its q8 codes and records, kv rows in place, kv cache
/// f32 / bf16, indexer rows in place, indexer cache f32 / bf16).
type Out = (
    Vec<f32>,
    Vec<i8>,
    Vec<u64>,
    Vec<f32>,
    Vec<f32>,
    Vec<u16>,
    Vec<f32>,
    Vec<f32>,
    Vec<u16>,
);

/// Output buffers, every value NaN (codes 0x55, records all ones).
struct Bufs {
    y: Buf<f32>,
    qs: Buf<i8>,
    qd: Buf<u64>,
    kv: Buf<f32>,
    kc: Buf<f32>,
    kcb: Buf<u16>,
    ix: Buf<f32>,
    ic: Buf<f32>,
    icb: Buf<u16>,
}

impl Bufs {
    fn new(c: &Case) -> Bufs {
        let r = c.rows;
        Bufs {
            y: Buf::filled(r * QA, f32::NAN),
            qs: Buf::filled(r * QA, 0x55i8),
            qd: Buf::filled(r * QA / 32, u64::MAX),
            kv: Buf::new(&c.kv),
            kc: Buf::filled(r * KV_COLS, f32::NAN),
            kcb: Buf::filled(r * KV_COLS, 0x7fc0u16),
            ix: Buf::new(&c.ix),
            ic: Buf::filled(r * IX, f32::NAN),
            icb: Buf::filled(r * IX, 0x7fc0u16),
        }
    }
    fn out(&self) -> Out {
        (
            self.y.to_vec(),
            self.qs.to_vec(),
            self.qd.to_vec(),
            self.kv.to_vec(),
            self.kc.to_vec(),
            self.kcb.to_vec(),
            self.ix.to_vec(),
            self.ic.to_vec(),
            self.icb.to_vec(),
        )
    }
}

/// The jobs' parameter structs over `b` (the host wrapper's values: kernels::norm).
fn jobs(
    c: &Case,
    b: &mut Bufs,
    qa: &Buf<f32>,
    w: &[&Buf<f32>; 4],
    pf: (&Buf<i32>, &Buf<f32>),
) -> (RmsJob, NormRopeJob, NormRopeJob) {
    let rows = c.rows as i32;
    let (qs, qd) = if c.q8 {
        (b.qs.mut_ptr() as u64, b.qd.mut_ptr() as u64)
    } else {
        (0, 0)
    };
    let q = RmsJob {
        x: qa.addr(),
        x_stride: QA as i64,
        res: 0,
        res_stride: QA as i64,
        xo: 0,
        xo_stride: QA as i64,
        w: w[0].addr(),
        y: b.y.mut_ptr() as u64,
        y_stride: QA as i64,
        qs,
        qd,
        n: QA as i32,
        eps: 1e-6,
        rows,
        // The wrapper's parts: one block per register slot of a single row.
        parts: if c.rows == 1 { (QA / 512) as i32 } else { 1 },
        threads: 512,
    };
    let cache = |f: &mut Buf<f32>, h: &mut Buf<u16>| {
        if c.bf16 {
            (0u64, h.mut_ptr() as u64)
        } else {
            (f.mut_ptr() as u64, 0u64)
        }
    };
    let (kcf, kcb) = cache(&mut b.kc, &mut b.kcb);
    let kv = NormRopeJob {
        x: b.kv.mut_ptr() as u64,
        x_stride: KV_COLS as i64,
        w: w[1].addr(),
        b: 0,
        pos: pf.0.addr(),
        inv_freq: pf.1.addr(),
        cf: kcf,
        cb: kcb,
        c_stride: KV_COLS as i64,
        cols: KV_COLS as i32,
        n: KV_N as i32,
        eps: 1e-6,
        off: KV_N as i32,
        n_rot: ROT as i32,
        style: c.style,
        rows,
        threads: 256,
    };
    let (icf, icb) = cache(&mut b.ic, &mut b.icb);
    let ix = NormRopeJob {
        x: b.ix.mut_ptr() as u64,
        x_stride: IX as i64,
        w: w[2].addr(),
        b: w[3].addr(),
        pos: pf.0.addr(),
        inv_freq: pf.1.addr(),
        cf: icf,
        cb: icb,
        c_stride: IX as i64,
        cols: IX as i32,
        n: IX as i32,
        eps: 1e-6,
        off: 0,
        n_rot: ROT as i32,
        style: c.style,
        rows,
        threads: 64,
    };
    (q, kv, ix)
}

/// The case as three launches (each job's own kernel and block) or as one `mla_norms_f32`
/// launch on the widest block. Absent jobs write nothing (their buffers stay NaN).
fn run(c: &Case, fused: bool) -> Out {
    let m = module(Op::RmsNorm);
    let ml = module(Op::LayerNorm);
    let (qa, w0, w1, w2, w3) = (
        Buf::new(&c.qa),
        Buf::new(&c.qa_w),
        Buf::new(&c.kv_w),
        Buf::new(&c.ix_w),
        Buf::new(&c.ix_b),
    );
    let (pb, fb) = (Buf::new(&c.pos), Buf::new(&c.freq));
    let mut b = Bufs::new(c);
    let (q, kv, ix) = jobs(c, &mut b, &qa, &[&w0, &w1, &w2, &w3], (&pb, &fb));
    if fused {
        let f: MlaNormsFn = unsafe { m.entry("mla_norms_f32") }.unwrap();
        let q = if c.with_q { q } else { RmsJob { rows: 0, ..q } };
        let ix = if c.with_ix {
            ix
        } else {
            NormRopeJob { rows: 0, ..ix }
        };
        let blocks = q.rows * q.parts + kv.rows + ix.rows;
        m.launch(
            "mla_norms_f32",
            [blocks as u32, 1, 1],
            [512, 1, 1],
            0,
            &|| unsafe { f(q, kv, ix) },
        )
        .unwrap();
        return b.out();
    }
    if c.with_q {
        let f: RmsFn = unsafe { m.entry("rmsnorm_f32") }.unwrap();
        let j = q;
        m.launch(
            "rmsnorm_f32",
            [j.rows as u32, j.parts as u32, 1],
            [j.threads as u32, 1, 1],
            0,
            &|| unsafe {
                f(
                    j.x as *const f32,
                    j.x_stride,
                    std::ptr::null(),
                    j.res_stride,
                    std::ptr::null_mut(),
                    j.xo_stride,
                    j.w as *const f32,
                    j.y as *mut f32,
                    j.y_stride,
                    j.n,
                    j.eps,
                    j.qs as *mut i8,
                    j.qd as *mut u64,
                )
            },
        )
        .unwrap();
    }
    let norm_rope = |md: &kernels_emu::Module, name: &str, j: NormRopeJob| {
        let f: NormRopeFn = unsafe { md.entry(name) }.unwrap();
        md.launch(
            name,
            [j.rows as u32, 1, 1],
            [j.threads as u32, 1, 1],
            0,
            &|| unsafe {
                f(
                    j.x as *mut f32,
                    j.x_stride,
                    j.cols,
                    j.w as *const f32,
                    j.b as *const f32,
                    j.n,
                    j.eps,
                    j.off,
                    j.n_rot,
                    j.pos as *const i32,
                    j.inv_freq as *const f32,
                    j.style,
                    j.cf as *mut f32,
                    j.cb as *mut u16,
                    j.c_stride,
                )
            },
        )
        .unwrap();
    };
    norm_rope(m, "rmsnorm_rope_f32", kv);
    if c.with_ix {
        norm_rope(ml, "layernorm_rope_f32", ix);
    }
    b.out()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn mla_norms_launch_equals_the_three_launches_it_replaces() {
    if !compiler("mla_norms_launch_equals_the_three_launches_it_replaces") {
        return;
    }
    let mut r = Rng::new("emu mla_norms");
    let mut cases = 0;
    for rows in [1usize, 3] {
        for style in [0i32, 2] {
            for (bf16, q8, with_q, with_ix) in [
                (false, true, true, true),
                (true, true, true, true),
                (true, false, true, true),
                (false, true, false, true),
                (true, true, true, false),
            ] {
                let pos: Vec<i32> = (0..rows as i32).map(|i| 17 + 40 * i).collect();
                let c = Case {
                    rows,
                    style,
                    bf16,
                    q8,
                    with_q,
                    with_ix,
                    qa: r.vec(rows * QA, 3.0),
                    qa_w: r.vec(QA, 1.5),
                    kv: r.vec(rows * KV_COLS, 2.0),
                    kv_w: r.vec(KV_N, 1.5),
                    ix: r.vec(rows * IX, 2.0),
                    ix_w: r.vec(IX, 1.5),
                    ix_b: r.vec(IX, 0.5),
                    pos,
                    freq: rope_inv_freq(10000.0, ROT),
                };
                let want = run(&c, false);
                let got = run(&c, true);
                let what = format!(
                    "rows {rows}, style {style}, bf16 {bf16}, q8 {q8}, q {with_q}, ix {with_ix}"
                );
                assert_eq!(bits(&got.0), bits(&want.0), "{what}: q_a norm");
                assert_eq!(got.1, want.1, "{what}: q8 codes");
                assert_eq!(got.2, want.2, "{what}: q8 records");
                assert_eq!(bits(&got.3), bits(&want.3), "{what}: kv rows");
                assert_eq!(bits(&got.4), bits(&want.4), "{what}: kv cache f32");
                assert_eq!(got.5, want.5, "{what}: kv cache bf16");
                assert_eq!(bits(&got.6), bits(&want.6), "{what}: indexer rows");
                assert_eq!(bits(&got.7), bits(&want.7), "{what}: indexer cache f32");
                assert_eq!(got.8, want.8, "{what}: indexer cache bf16");
                // The jobs did run: every output of a present job is written (no NaN left).
                let written = |v: &[f32]| v.iter().all(|x| x.is_finite());
                assert_eq!(written(&got.0), with_q, "{what}: q_a norm written");
                assert!(written(&got.3), "{what}: kv rows");
                let cache_done = if bf16 {
                    got.5.iter().all(|&h| h != 0x7fc0)
                } else {
                    written(&got.4)
                };
                assert!(cache_done, "{what}: kv cache rows written");
                if with_q && q8 {
                    assert!(got.2.iter().all(|&d| d != u64::MAX), "{what}: q8 records");
                }
                // The latent columns are RMS-normalised: f32 sums of 512 squares over 256
                // threads (per-thread partials of 2, then a tree) and the scaling, normwise
                // within (n/64 + 24) u32 of the f64 oracle (kernels.rs's rmsnorm bound).
                let tol = (KV_N as f64 / 64.0 + 24.0) * U32;
                for row in 0..rows {
                    let x = &c.kv[row * KV_COLS..row * KV_COLS + KV_N];
                    let ref64 = rms_norm_f64(x, &c.kv_w, 1e-6);
                    let scale = max_abs(&ref64);
                    let g = &got.3[row * KV_COLS..row * KV_COLS + KV_N];
                    let worst = g
                        .iter()
                        .zip(&ref64)
                        .fold(0f64, |m, (a, b)| m.max((f64::from(*a) - b).abs() / scale));
                    assert!(worst <= tol, "{what}: latent row {row} off by {worst:e}");
                }
                cases += 1;
            }
        }
    }
    say(&format!(
        "mla_norms: {cases} cases bitwise the three launches"
    ));
    assert_eq!(cases, 20);
}
