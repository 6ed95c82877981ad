//! Editing a GGUF header: typed metadata values from text (gguf-set-metadata's conventions),
//! setting/deleting keys and renaming tensors with the checks that keep a file — or a split
//! set — consistent, and the new header laid out over the unchanged tensor data.
//!
//! Conventions: a value for an existing key is parsed as that key's type (as gguf-set-metadata
//! does) unless a `:TYPE` suffix says otherwise; a new key without a suffix is a string (as
//! gguf-new-metadata writes names and templates). Arrays are not edited from text.

use crate::metadata::Metadata;
use crate::reader::{Header, TensorInfo, MAX_TENSOR_NAME};
use crate::value::{Value, ValueType};
use crate::writer::Layout;

/// Why an edit was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EditError {
    #[error("{key}: {value:?} is not a valid {ty}")]
    BadValue {
        key: String,
        value: String,
        ty: &'static str,
    },
    #[error("{key}: {reason} (pass --force to do it anyway)")]
    Protected { key: String, reason: String },
    #[error("{key}: is an array of {elem}; arrays cannot be set from text")]
    Array { key: String, elem: &'static str },
    #[error("{key}: not present")]
    NoSuchKey { key: String },
    #[error("tensor {0:?} not found")]
    NoSuchTensor(String),
    #[error("tensor {0:?} already exists")]
    TensorExists(String),
    #[error("tensor name {name:?} is {len} bytes, the limit is {MAX_TENSOR_NAME}")]
    NameTooLong { name: String, len: usize },
    #[error("empty key")]
    EmptyKey,
    #[error("{0}")]
    Layout(String),
}

/// Type names accepted after `:` (case-insensitive).
const TYPE_NAMES: &[(&str, ValueType)] = &[
    ("u8", ValueType::U8),
    ("uint8", ValueType::U8),
    ("i8", ValueType::I8),
    ("int8", ValueType::I8),
    ("u16", ValueType::U16),
    ("uint16", ValueType::U16),
    ("i16", ValueType::I16),
    ("int16", ValueType::I16),
    ("u32", ValueType::U32),
    ("uint32", ValueType::U32),
    ("i32", ValueType::I32),
    ("int32", ValueType::I32),
    ("u64", ValueType::U64),
    ("uint64", ValueType::U64),
    ("i64", ValueType::I64),
    ("int64", ValueType::I64),
    ("f32", ValueType::F32),
    ("float32", ValueType::F32),
    ("f64", ValueType::F64),
    ("float64", ValueType::F64),
    ("bool", ValueType::Bool),
    ("str", ValueType::String),
    ("string", ValueType::String),
];

/// Split `VALUE[:TYPE]`: the suffix counts only when it names a type, so values with colons
/// (URLs, templates) stay whole; `a:b:str` is the string `a:b`.
pub fn split_type_suffix(s: &str) -> (&str, Option<ValueType>) {
    if let Some((v, t)) = s.rsplit_once(':') {
        if let Some((_, ty)) = TYPE_NAMES.iter().find(|(n, _)| n.eq_ignore_ascii_case(t)) {
            return (v, Some(*ty));
        }
    }
    (s, None)
}

/// Parse text as a value of `ty`.
pub fn parse_value(key: &str, text: &str, ty: ValueType) -> Result<Value, EditError> {
    let bad = || EditError::BadValue {
        key: key.to_string(),
        value: text.to_string(),
        ty: ty.name(),
    };
    let t = text.trim();
    Ok(match ty {
        ValueType::U8 => Value::U8(t.parse().map_err(|_| bad())?),
        ValueType::I8 => Value::I8(t.parse().map_err(|_| bad())?),
        ValueType::U16 => Value::U16(t.parse().map_err(|_| bad())?),
        ValueType::I16 => Value::I16(t.parse().map_err(|_| bad())?),
        ValueType::U32 => Value::U32(t.parse().map_err(|_| bad())?),
        ValueType::I32 => Value::I32(t.parse().map_err(|_| bad())?),
        ValueType::U64 => Value::U64(t.parse().map_err(|_| bad())?),
        ValueType::I64 => Value::I64(t.parse().map_err(|_| bad())?),
        ValueType::F32 => Value::F32(t.parse().map_err(|_| bad())?),
        ValueType::F64 => Value::F64(t.parse().map_err(|_| bad())?),
        ValueType::Bool => match t.to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" => Value::Bool(true),
            "false" | "0" | "no" => Value::Bool(false),
            _ => return Err(bad()),
        },
        // Strings are taken verbatim (no trimming).
        ValueType::String => Value::String(text.to_string()),
        ValueType::Array => return Err(bad()),
    })
}

/// Why changing or deleting `key` could make the file inconsistent, if it could.
pub fn protected_reason(key: &str, arch: Option<&str>) -> Option<String> {
    if key.starts_with("split.") {
        return Some("split keys describe the shard set; use `gguftool split`/`merge`".into());
    }
    if key == "general.alignment" {
        return Some("the alignment fixes where every tensor's data starts".into());
    }
    if key == "general.architecture" {
        return Some("every other key and tensor is read according to the architecture".into());
    }
    if let Some(a) = arch {
        let structural = ["block_count", "expert_count", "nextn_predict_layers"];
        if let Some(rest) = key.strip_prefix(a).and_then(|r| r.strip_prefix('.')) {
            if structural.contains(&rest) {
                return Some("it must agree with the tensors stored in the file".into());
            }
        }
    }
    None
}

/// One requested change.
#[derive(Debug, Clone, PartialEq)]
pub enum Edit {
    Set {
        key: String,
        text: String,
        ty: Option<ValueType>,
    },
    /// A value given directly (e.g. a chat template read from a file).
    SetValue {
        key: String,
        value: Value,
    },
    Delete {
        key: String,
    },
    RenameTensor {
        from: String,
        to: String,
    },
}

/// Apply a metadata edit to `m`; `force` lifts the consistency refusals (not the type checks).
/// `arch` is the model's architecture (a shard after the first does not carry it).
pub fn apply_metadata(
    m: &mut Metadata,
    edit: &Edit,
    force: bool,
    arch: Option<&str>,
) -> Result<(), EditError> {
    let guard = |key: &str| -> Result<(), EditError> {
        if key.is_empty() {
            return Err(EditError::EmptyKey);
        }
        match protected_reason(key, arch) {
            Some(reason) if !force => Err(EditError::Protected {
                key: key.to_string(),
                reason,
            }),
            _ => Ok(()),
        }
    };
    match edit {
        Edit::Set { key, text, ty } => {
            guard(key)?;
            let existing = m.get(key);
            if let Some(Value::Array(a)) = existing {
                if ty.is_none() {
                    return Err(EditError::Array {
                        key: key.clone(),
                        elem: a.elem_type.name(),
                    });
                }
            }
            let want = match (ty, existing) {
                (Some(t), Some(old)) if old.value_type() != *t && !force => {
                    return Err(EditError::Protected {
                        key: key.clone(),
                        reason: format!(
                            "changes the type from {} to {} (readers expect the stored type)",
                            old.value_type().name(),
                            t.name()
                        ),
                    })
                }
                (Some(t), _) => *t,
                (None, Some(old)) => old.value_type(),
                (None, None) => ValueType::String,
            };
            let v = parse_value(key, text, want)?;
            m.set(key, v);
        }
        Edit::SetValue { key, value } => {
            guard(key)?;
            if let Some(old) = m.get(key) {
                if old.value_type() != value.value_type() && !force {
                    return Err(EditError::Protected {
                        key: key.clone(),
                        reason: format!(
                            "changes the type from {} to {}",
                            old.value_type().name(),
                            value.value_type().name()
                        ),
                    });
                }
            }
            m.set(key, value.clone());
        }
        Edit::Delete { key } => {
            guard(key)?;
            if m.remove(key).is_none() {
                return Err(EditError::NoSuchKey { key: key.clone() });
            }
        }
        Edit::RenameTensor { .. } => {}
    }
    Ok(())
}

/// Rename a tensor in a table (names unique, within ggml's limit).
pub fn rename_tensor(tensors: &mut [TensorInfo], from: &str, to: &str) -> Result<(), EditError> {
    if to.len() > MAX_TENSOR_NAME {
        return Err(EditError::NameTooLong {
            name: to.to_string(),
            len: to.len(),
        });
    }
    if tensors.iter().any(|t| t.name == to) {
        return Err(EditError::TensorExists(to.to_string()));
    }
    let t = tensors
        .iter_mut()
        .find(|t| t.name == from)
        .ok_or_else(|| EditError::NoSuchTensor(from.to_string()))?;
    t.name = to.to_string();
    Ok(())
}

/// A shard's new header over its old data: same tensor offsets, new data start.
pub struct Rewrite {
    pub layout: Layout,
    /// Where the data section starts in the old file.
    pub old_data_offset: u64,
    /// Whether the new header fits the old padding, so the data section does not move.
    pub fits_in_place: bool,
}

pub fn rewrite(
    old: &Header,
    metadata: &Metadata,
    tensors: Vec<TensorInfo>,
) -> Result<Rewrite, EditError> {
    let layout = Layout::with_offsets(old.version, metadata, tensors)
        .map_err(|e| EditError::Layout(e.to_string()))?;
    if layout.alignment != old.alignment {
        return Err(EditError::Layout(format!(
            "the alignment would change from {} to {}",
            old.alignment, layout.alignment
        )));
    }
    Ok(Rewrite {
        fits_in_place: layout.data_offset == old.data_offset,
        old_data_offset: old.data_offset,
        layout,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffixes_only_when_they_name_a_type() {
        assert_eq!(split_type_suffix("5:u32"), ("5", Some(ValueType::U32)));
        assert_eq!(split_type_suffix("https://x.org"), ("https://x.org", None));
        assert_eq!(
            split_type_suffix("a:b:str"),
            ("a:b", Some(ValueType::String))
        );
        assert_eq!(split_type_suffix("x:BOOL"), ("x", Some(ValueType::Bool)));
    }

    #[test]
    fn existing_type_is_kept_and_checked() {
        const A: Option<&str> = Some("glm-dsa");
        let mut m = Metadata::new("t");
        m.set("general.architecture", Value::String("glm-dsa".into()));
        m.set("tokenizer.ggml.eos_token_id", Value::U32(1));
        let set = |k: &str, t: &str| Edit::Set {
            key: k.into(),
            text: t.into(),
            ty: None,
        };
        apply_metadata(&mut m, &set("tokenizer.ggml.eos_token_id", "7"), false, A).unwrap();
        assert_eq!(m.get("tokenizer.ggml.eos_token_id"), Some(&Value::U32(7)));
        assert!(matches!(
            apply_metadata(&mut m, &set("tokenizer.ggml.eos_token_id", "-1"), false, A),
            Err(EditError::BadValue { .. })
        ));
        // A new key without a type is a string.
        apply_metadata(&mut m, &set("general.name", "x"), false, A).unwrap();
        assert_eq!(m.get("general.name"), Some(&Value::String("x".into())));
        // Type changes and structural keys need force.
        let retype = Edit::Set {
            key: "tokenizer.ggml.eos_token_id".into(),
            text: "7".into(),
            ty: Some(ValueType::I32),
        };
        assert!(matches!(
            apply_metadata(&mut m, &retype, false, A),
            Err(EditError::Protected { .. })
        ));
        apply_metadata(&mut m, &retype, true, A).unwrap();
        assert_eq!(m.get("tokenizer.ggml.eos_token_id"), Some(&Value::I32(7)));
        for k in [
            "split.count",
            "general.alignment",
            "glm-dsa.block_count",
            "general.architecture",
        ] {
            assert!(
                matches!(
                    apply_metadata(&mut m, &set(k, "1"), false, A),
                    Err(EditError::Protected { .. })
                ),
                "{k}"
            );
        }
        assert!(matches!(
            apply_metadata(&mut m, &Edit::Delete { key: "nope".into() }, false, A),
            Err(EditError::NoSuchKey { .. })
        ));
    }

    #[test]
    fn renames_are_checked() {
        let t = |n: &str| TensorInfo {
            name: n.into(),
            dims: vec![4],
            ty: crate::GgmlType::F32,
            offset: 0,
        };
        let mut ts = vec![t("a"), t("b")];
        assert!(matches!(
            rename_tensor(&mut ts, "a", "b"),
            Err(EditError::TensorExists(_))
        ));
        assert!(matches!(
            rename_tensor(&mut ts, "x", "y"),
            Err(EditError::NoSuchTensor(_))
        ));
        assert!(matches!(
            rename_tensor(&mut ts, "a", &"n".repeat(64)),
            Err(EditError::NameTooLong { .. })
        ));
        rename_tensor(&mut ts, "a", "c").unwrap();
        assert_eq!(ts[0].name, "c");
    }
}
