//! Metadata values: the 13 GGUF value types, kept exactly as stored (type and bits) so a file can
//! be rewritten byte for byte.

use std::fmt;

/// A GGUF value type id (`gguf_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ValueType {
    U8 = 0,
    I8 = 1,
    U16 = 2,
    I16 = 3,
    U32 = 4,
    I32 = 5,
    F32 = 6,
    Bool = 7,
    String = 8,
    Array = 9,
    U64 = 10,
    I64 = 11,
    F64 = 12,
}

impl ValueType {
    pub fn from_id(id: u32) -> Option<Self> {
        use ValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    pub fn id(self) -> u32 {
        self as u32
    }

    /// Size in bytes of a fixed-size value; `None` for strings and arrays.
    pub fn fixed_size(self) -> Option<usize> {
        use ValueType::*;
        match self {
            U8 | I8 | Bool => Some(1),
            U16 | I16 => Some(2),
            U32 | I32 | F32 => Some(4),
            U64 | I64 | F64 => Some(8),
            String | Array => None,
        }
    }

    /// Fewest bytes one value of this type can take in a file (a string's length prefix,
    /// an array's type + count); bounds counts against the bytes that remain.
    pub fn min_size(self) -> u64 {
        match self {
            ValueType::String => 8,
            ValueType::Array => 12,
            t => t.fixed_size().unwrap_or(1) as u64,
        }
    }

    pub fn name(self) -> &'static str {
        use ValueType::*;
        match self {
            U8 => "UINT8",
            I8 => "INT8",
            U16 => "UINT16",
            I16 => "INT16",
            U32 => "UINT32",
            I32 => "INT32",
            F32 => "FLOAT32",
            Bool => "BOOL",
            String => "STRING",
            Array => "ARRAY",
            U64 => "UINT64",
            I64 => "INT64",
            F64 => "FLOAT64",
        }
    }
}

impl fmt::Display for ValueType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An array value: the element type is kept even when the array is empty.
#[derive(Debug, Clone, PartialEq)]
pub struct Array {
    pub elem_type: ValueType,
    pub values: Vec<Value>,
}

impl Array {
    pub fn len(&self) -> usize {
        self.values.len()
    }
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }
    /// All elements as strings, `None` unless this is a string array.
    pub fn as_strings(&self) -> Option<Vec<&str>> {
        self.values.iter().map(Value::as_str).collect()
    }
    /// All elements as i64 (any integer or bool type, checked), `None` otherwise.
    pub fn as_i64s(&self) -> Option<Vec<i64>> {
        self.values.iter().map(Value::as_i64).collect()
    }
    /// All elements as f64 (any numeric type), `None` otherwise.
    pub fn as_f64s(&self) -> Option<Vec<f64>> {
        self.values.iter().map(Value::as_f64).collect()
    }
    /// Same element type and bit-exact equal elements (see [`Value::bit_eq`]); an empty
    /// array's element type still counts because it is written to the file.
    pub fn bit_eq(&self, other: &Array) -> bool {
        self.elem_type == other.elem_type
            && self.values.len() == other.values.len()
            && self
                .values
                .iter()
                .zip(&other.values)
                .all(|(a, b)| a.bit_eq(b))
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl Value {
    pub fn value_type(&self) -> ValueType {
        match self {
            Value::U8(_) => ValueType::U8,
            Value::I8(_) => ValueType::I8,
            Value::U16(_) => ValueType::U16,
            Value::I16(_) => ValueType::I16,
            Value::U32(_) => ValueType::U32,
            Value::I32(_) => ValueType::I32,
            Value::F32(_) => ValueType::F32,
            Value::Bool(_) => ValueType::Bool,
            Value::String(_) => ValueType::String,
            Value::Array(_) => ValueType::Array,
            Value::U64(_) => ValueType::U64,
            Value::I64(_) => ValueType::I64,
            Value::F64(_) => ValueType::F64,
        }
    }

    /// Any integer (or bool) value as i64, `None` when it does not fit or is not an integer.
    pub fn as_i64(&self) -> Option<i64> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => i64::try_from(v).ok()?,
            Value::I64(v) => v,
            Value::Bool(b) => b.into(),
            _ => return None,
        })
    }

    /// Any non-negative integer value as u64.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U64(v) => Some(v),
            _ => self.as_i64().and_then(|v| u64::try_from(v).ok()),
        }
    }

    /// Any numeric value as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::F32(v) => Some(v.into()),
            Value::F64(v) => Some(v),
            Value::U64(v) => Some(v as f64),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&Array> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// Equal including float bit patterns (NaN payloads, -0.0), which `PartialEq` cannot
    /// express: a rewrite must reproduce the stored bits, not just a numerically equal value.
    pub fn bit_eq(&self, other: &Value) -> bool {
        match (self, other) {
            (Value::F32(x), Value::F32(y)) => x.to_bits() == y.to_bits(),
            (Value::F64(x), Value::F64(y)) => x.to_bits() == y.to_bits(),
            (Value::Array(x), Value::Array(y)) => x.bit_eq(y),
            _ => self == other,
        }
    }

    /// A short human description: arrays longer than `max_items` are summarized.
    pub fn display_summary(&self, max_items: usize) -> String {
        match self {
            Value::String(s) => format!("{s:?}"),
            Value::Array(a) => {
                let shown: Vec<String> = a
                    .values
                    .iter()
                    .take(max_items)
                    .map(|v| v.display_summary(max_items))
                    .collect();
                if a.len() > max_items {
                    format!(
                        "[{}, ... ({} {} items)]",
                        shown.join(", "),
                        a.len(),
                        a.elem_type
                    )
                } else {
                    format!("[{}]", shown.join(", "))
                }
            }
            Value::F32(v) => format!("{v}"),
            Value::F64(v) => format!("{v}"),
            Value::Bool(b) => format!("{b}"),
            other => other.as_i64().map(|v| v.to_string()).unwrap_or_else(|| {
                other
                    .as_u64()
                    .map(|v| v.to_string())
                    .unwrap_or_else(|| format!("{other:?}"))
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arr(elem_type: ValueType, values: Vec<Value>) -> Value {
        Value::Array(Array { elem_type, values })
    }

    #[test]
    fn bit_eq_tells_float_bit_patterns_apart() {
        // NaN != NaN under PartialEq, but identical bits must compare equal.
        let nan = f32::from_bits(0x7fc0_0001);
        assert!(Value::F32(nan).bit_eq(&Value::F32(nan)));
        assert!(!Value::F32(nan).bit_eq(&Value::F32(f32::from_bits(0x7fc0_0002))));
        assert!(Value::F64(f64::NAN).bit_eq(&Value::F64(f64::NAN)));
        // 0.0 == -0.0 under PartialEq, but their bits differ.
        assert_eq!(Value::F32(0.0), Value::F32(-0.0));
        assert!(!Value::F32(0.0).bit_eq(&Value::F32(-0.0)));
        assert!(!Value::F64(0.0).bit_eq(&Value::F64(-0.0)));
        // Same number, different stored type.
        assert!(!Value::F32(1.0).bit_eq(&Value::F64(1.0)));
        assert!(!Value::U32(1).bit_eq(&Value::I32(1)));
        assert!(Value::String("a".into()).bit_eq(&Value::String("a".into())));
        assert!(!Value::String("a".into()).bit_eq(&Value::String("b".into())));
    }

    #[test]
    fn bit_eq_compares_arrays_by_type_length_and_element_bits() {
        let nans = arr(ValueType::F32, vec![Value::F32(f32::NAN)]);
        assert!(nans.bit_eq(&nans.clone()));
        assert!(!arr(ValueType::F32, vec![Value::F32(0.0)])
            .bit_eq(&arr(ValueType::F32, vec![Value::F32(-0.0)])));
        // Empty arrays still carry an element type in the file.
        assert!(!arr(ValueType::U8, vec![]).bit_eq(&arr(ValueType::I8, vec![])));
        assert!(arr(ValueType::U8, vec![]).bit_eq(&arr(ValueType::U8, vec![])));
        assert!(!arr(ValueType::U8, vec![Value::U8(1)])
            .bit_eq(&arr(ValueType::U8, vec![Value::U8(1), Value::U8(2)])));
        // Nested arrays recurse with the same rules.
        let nested = |x: f64| {
            arr(
                ValueType::Array,
                vec![arr(ValueType::F64, vec![Value::F64(x)])],
            )
        };
        assert!(nested(f64::NAN).bit_eq(&nested(f64::NAN)));
        assert!(!nested(0.0).bit_eq(&nested(-0.0)));
    }
}
