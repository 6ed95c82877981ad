//! `convert --tp N --rank r`: each rank's checkpoint holds exactly its slice of the tensors the HF
//! tensor-parallel plan splits (colwise: output rows; rowwise: input columns) and the rest whole.

use mappings::export::{export_safetensors, ExportOptions};
use mappings::table::Tp;
use std::collections::BTreeMap;
use std::path::Path;

fn load(dir: &Path) -> BTreeMap<String, (Vec<usize>, Vec<u8>)> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            let bytes = std::fs::read(&p).unwrap();
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            for (n, v) in st.tensors() {
                out.insert(n, (v.shape().to_vec(), v.data().to_vec()));
            }
        }
    }
    out
}

#[test]
fn tp_ranks_hold_their_slices() {
    let g = gguftool_tests::fixture("gguf/tiny-glm5-BF16.gguf");
    let m = gguf::Model::open(g).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let full_dir = tmp.path().join("full");
    // f32 so that every element has the same width and slicing can be checked on bytes
    let f32_opts = ExportOptions {
        dtype: mappings::export::OutDtype::F32,
        ..ExportOptions::default()
    };
    export_safetensors(&m, &full_dir, &f32_opts, &mut |_| true).unwrap();
    let full = load(&full_dir);
    let t = mappings::table("glm-dsa").unwrap();
    let tp = 2;
    let mut sliced = 0;
    for rank in 0..tp {
        let dir = tmp.path().join(format!("rank{rank}"));
        let opts = ExportOptions {
            tp: Some((tp, rank)),
            ..f32_opts.clone()
        };
        export_safetensors(&m, &dir, &opts, &mut |_| true).unwrap();
        let part = load(&dir);
        assert_eq!(part.len(), full.len());
        for (name, (shape, data)) in &full {
            let (pshape, pdata) = &part[name];
            let plan = t.match_hf(name).unwrap().entry.tp;
            let want: Vec<u8> = match (plan, shape.len()) {
                (None, _) => data.clone(),
                (Some(Tp::Colwise), _) | (Some(Tp::Rowwise), 1) => {
                    let rows = shape[0] / tp;
                    let row_bytes = data.len() / shape[0];
                    data[rank * rows * row_bytes..(rank + 1) * rows * row_bytes].to_vec()
                }
                (Some(Tp::Rowwise), _) => {
                    let cols = shape[1] / tp;
                    data.chunks(shape[1] * 4)
                        .flat_map(|row| row[rank * cols * 4..(rank + 1) * cols * 4].to_vec())
                        .collect()
                }
            };
            if plan.is_some() {
                sliced += 1;
                assert_eq!(
                    pshape.iter().product::<usize>() * tp,
                    shape.iter().product::<usize>(),
                    "{name}"
                );
            }
            assert_eq!(pdata, &want, "{name} rank {rank}");
        }
    }
    // lm_head + per layer q_b, kv_b, o_proj (4 layers) + dense mlp (3) + shared experts (3 x 3
    // layers) + every routed expert's gate/up/down (3 MoE layers x 6 experts x 3)
    assert_eq!(sliced, tp * (1 + 4 * 3 + 3 + 9 + 3 * 6 * 3));
}
