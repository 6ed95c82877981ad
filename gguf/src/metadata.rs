//! Ordered key/value metadata with typed accessors. File order is kept so rewrites are byte-exact.

use crate::error::{Error, Result};
use crate::value::Value;
use std::path::{Path, PathBuf};

/// The metadata of one GGUF file, in file order. Keys are unique (the reader refuses duplicates).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Metadata {
    file: PathBuf,
    entries: Vec<(String, Value)>,
}

impl Metadata {
    pub fn new(file: impl Into<PathBuf>) -> Self {
        Metadata {
            file: file.into(),
            entries: Vec::new(),
        }
    }

    pub fn from_entries(file: impl Into<PathBuf>, entries: Vec<(String, Value)>) -> Self {
        Metadata {
            file: file.into(),
            entries,
        }
    }

    /// The file these values were read from (used in error messages).
    pub fn file(&self) -> &Path {
        &self.file
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    pub fn entries(&self) -> &[(String, Value)] {
        &self.entries
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn contains(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// Set a value: replaces in place (keeping the key's position) or appends.
    pub fn set(&mut self, key: &str, value: Value) {
        match self.entries.iter_mut().find(|(k, _)| k == key) {
            Some(e) => e.1 = value,
            None => self.entries.push((key.to_string(), value)),
        }
    }

    /// Remove a key, returning its value.
    pub fn remove(&mut self, key: &str) -> Option<Value> {
        let i = self.entries.iter().position(|(k, _)| k == key)?;
        Some(self.entries.remove(i).1)
    }

    /// Keep only the entries for which `f` returns true.
    pub fn retain(&mut self, mut f: impl FnMut(&str, &Value) -> bool) {
        self.entries.retain(|(k, v)| f(k, v));
    }

    fn require(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| Error::MissingKey {
            file: self.file.clone(),
            key: key.to_string(),
        })
    }

    fn wrong(&self, key: &str, expected: &'static str, got: &Value) -> Error {
        Error::WrongType {
            file: self.file.clone(),
            key: key.to_string(),
            expected,
            got: describe(got),
        }
    }

    /// A non-negative integer of any integer type.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        let v = self.require(key)?;
        v.as_u64()
            .ok_or_else(|| self.wrong(key, "non-negative integer", v))
    }

    pub fn get_i64(&self, key: &str) -> Result<i64> {
        let v = self.require(key)?;
        v.as_i64().ok_or_else(|| self.wrong(key, "integer", v))
    }

    /// Any numeric value.
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        let v = self.require(key)?;
        v.as_f64().ok_or_else(|| self.wrong(key, "number", v))
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        let v = self.require(key)?;
        v.as_bool().ok_or_else(|| self.wrong(key, "BOOL", v))
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| self.wrong(key, "STRING", v))
    }

    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        let v = self.require(key)?;
        v.as_array()
            .and_then(|a| a.as_strings())
            .ok_or_else(|| self.wrong(key, "ARRAY of STRING", v))
    }

    pub fn get_i64_array(&self, key: &str) -> Result<Vec<i64>> {
        let v = self.require(key)?;
        v.as_array()
            .and_then(|a| a.as_i64s())
            .ok_or_else(|| self.wrong(key, "ARRAY of integers", v))
    }

    pub fn get_f64_array(&self, key: &str) -> Result<Vec<f64>> {
        let v = self.require(key)?;
        v.as_array()
            .and_then(|a| a.as_f64s())
            .ok_or_else(|| self.wrong(key, "ARRAY of numbers", v))
    }

    /// `general.architecture`, when present and a string.
    pub fn architecture(&self) -> Option<&str> {
        self.get("general.architecture").and_then(Value::as_str)
    }
}

fn describe(v: &Value) -> String {
    match v {
        Value::Array(a) => format!("ARRAY of {}", a.elem_type),
        other => other.value_type().name().to_string(),
    }
}
