//! Metadata as gguf-py's writer builds it: keys in first-write order, a key written again keeps
//! its position and takes the new value (Python dict semantics; the converter warns "Duplicated key
//! name"), empty strings and empty arrays are not written at all.

use gguf::value::{Array, ValueType};
use gguf::{Metadata, Value};

/// Ordered key/value store with gguf-py's write rules.
#[derive(Debug, Clone)]
pub struct Kv {
    pub meta: Metadata,
    /// Keys written more than once (the converter's "Duplicated key name" warnings).
    pub duplicated: Vec<String>,
}

impl Default for Kv {
    fn default() -> Self {
        Kv {
            meta: Metadata::new("<converted>"),
            duplicated: vec![],
        }
    }
}

impl Kv {
    pub fn put(&mut self, key: &str, v: Value) {
        if self.meta.contains(key) && !self.duplicated.iter().any(|d| d == key) {
            self.duplicated.push(key.to_string());
        }
        self.meta.set(key, v);
    }

    pub fn u32(&mut self, key: &str, v: u64) {
        // callers check the range; a value above u32 would be a struct.pack error in gguf-py
        self.put(key, Value::U32(v as u32));
    }

    pub fn i32(&mut self, key: &str, v: i32) {
        self.put(key, Value::I32(v));
    }

    pub fn u16(&mut self, key: &str, v: u16) {
        self.put(key, Value::U16(v));
    }

    /// Python floats are packed with struct 'f': round to nearest f32.
    pub fn f32(&mut self, key: &str, v: f64) {
        self.put(key, Value::F32(v as f32));
    }

    pub fn bool(&mut self, key: &str, v: bool) {
        self.put(key, Value::Bool(v));
    }

    pub fn string(&mut self, key: &str, v: &str) {
        if !v.is_empty() {
            self.put(key, Value::String(v.to_string()));
        }
    }

    pub fn array(&mut self, key: &str, elem_type: ValueType, values: Vec<Value>) {
        if !values.is_empty() {
            self.put(key, Value::Array(Array { elem_type, values }));
        }
    }

    pub fn str_array(&mut self, key: &str, v: &[String]) {
        self.array(
            key,
            ValueType::String,
            v.iter().map(|s| Value::String(s.clone())).collect(),
        );
    }

    pub fn remove(&mut self, key: &str) {
        self.meta.remove(key);
    }

    /// Appends every key of `other` (in its order) with the same rules.
    pub fn extend(&mut self, other: Kv) {
        for d in other.duplicated {
            if !self.duplicated.contains(&d) {
                self.duplicated.push(d);
            }
        }
        for (k, v) in other.meta.entries() {
            self.put(k, v.clone());
        }
    }
}
