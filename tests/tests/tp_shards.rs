//! Every tensor-parallel share the runtime loads is the right part of its tensor: on the fixture
//! files (float, Q8_0 and K-quant types), for every tensor the mapping table lists, every rank of
//! TP 2 and 4 and both expert splits, the share (read in place from the mmap, or re-encoded as
//! F32 where its split cuts quant blocks) dequantizes bitwise to the slice of the whole tensor,
//! the ranks' slices tile the split axis, and the header-only memory plan counts exactly the
//! bytes a TP load reports.

use gguftool_tests::fixture;
use runtime::glm::part_of;
use runtime::spec::ModelSpec;
use runtime::tp::plan::weight_plan;
use runtime::tp::{MoeSplit, Shard, ShardView};
use runtime::weights::HostWeight;
use runtime::LanguageModel;
use std::sync::Arc;

/// Elements `range` along `axis` of a row-major (ggml order) array of dims `ne`.
fn slice_of(full: &[f32], ne: &[usize], axis: usize, range: std::ops::Range<usize>) -> Vec<f32> {
    let inner: usize = ne[..axis].iter().product();
    let outer: usize = ne[axis + 1..].iter().product();
    let mut out = Vec::with_capacity(inner * range.len() * outer);
    for o in 0..outer {
        let base = o * ne[axis] * inner;
        out.extend_from_slice(&full[base + range.start * inner..base + range.end * inner]);
    }
    out
}

#[test]
fn every_share_is_its_slice_of_the_whole_tensor() {
    let mut checked = 0;
    for file in [
        "gguf/tiny-glm5-BF16.gguf",
        "gguf/tiny-glm5-Q8_0.gguf",
        "gguf/tiny-glm5-Q4_K_M.gguf",
    ] {
        let p = fixture(file);
        let m = Arc::new(gguf::Model::open(&p).unwrap());
        let spec = ModelSpec::from_model(&m).unwrap();
        let configs: Vec<Vec<ShardView>> = [2, 4]
            .into_iter()
            .flat_map(|world| {
                [MoeSplit::Columns, MoeSplit::Experts].map(|moe| {
                    (0..world)
                        .map(|rank| ShardView::new(&spec, Shard { rank, world }, moe).unwrap())
                        .collect()
                })
            })
            .collect();
        for t in spec.tensors.iter().filter(|t| m.tensor(&t.name).is_some()) {
            let w = HostWeight::from_model(&m, &t.name).unwrap();
            let full = w.to_f32().unwrap();
            for views in &configs {
                let mut covered = 0;
                for v in views {
                    let Some((axis, range)) = v.share_of(t, part_of(&t.role)).unwrap() else {
                        continue;
                    };
                    assert_eq!(
                        range.start, covered,
                        "{file} {}: ranks tile the axis",
                        t.name
                    );
                    covered = range.end;
                    let (share, _) = w.shard(axis, range.clone()).unwrap();
                    let part = share.to_f32().unwrap();
                    let want = slice_of(&full, &t.dims, axis, range.clone());
                    // Bitwise (NaN-safe) equality of the dequantized values.
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
                    assert!(
                        bits(&part) == bits(&want),
                        "{file} {} rank {} of {} ({:?}): share differs from its slice",
                        t.name,
                        v.rank,
                        v.world,
                        v.moe
                    );
                    checked += 1;
                }
                if covered > 0 {
                    let axis = t
                        .shard
                        .axis(t.dims.len(), views[0].whole_experts())
                        .unwrap();
                    assert_eq!(
                        covered, t.dims[axis],
                        "{file} {}: ranks cover the axis",
                        t.name
                    );
                }
            }
        }
    }
    assert!(checked > 1000, "only {checked} shares checked");
}

#[test]
fn the_header_only_plan_counts_the_bytes_a_tp_load_holds() {
    for file in ["gguf/tiny-glm5-BF16.gguf", "gguf/tiny-glm5-Q4_K_M.gguf"] {
        let p = fixture(file);
        let m = Arc::new(gguf::Model::open(&p).unwrap());
        let spec = ModelSpec::from_model(&m).unwrap();
        for (world, moe) in [(2, MoeSplit::Columns), (4, MoeSplit::Experts)] {
            let plan = weight_plan(&m, &spec, world, moe).unwrap();
            let lm = runtime::device::load_cpu_tp(Arc::clone(&m), world, moe, None).unwrap();
            let rep = lm.tp_report().unwrap();
            for (p, r) in plan.ranks.iter().zip(&rep.ranks) {
                assert_eq!(
                    p.weight_bytes, r.weight_bytes,
                    "{file} TP {world} rank {}",
                    r.rank
                );
                let mut want = r.reencoded_f32.clone();
                want.sort();
                let mut got = p.reencoded_f32.clone();
                got.sort();
                assert_eq!(got, want, "{file} rank {}", r.rank);
                assert_eq!(p.reencoded_extra_bytes, r.reencoded_extra_bytes);
                assert_eq!(p.kv_bytes_per_token as usize, r.cache_bytes_per_token);
            }
            // Replicated tensors count on every rank, split ones once over all ranks.
            let total: u64 = m.tensors().map(|t| m.data(&t).len() as u64).sum();
            let sum: u64 = plan.ranks.iter().map(|r| r.weight_bytes).sum();
            let extra: u64 = plan.ranks.iter().map(|r| r.reencoded_extra_bytes).sum();
            assert!(
                sum - extra > total && sum - extra < world as u64 * total,
                "{file}"
            );
        }
    }
}
