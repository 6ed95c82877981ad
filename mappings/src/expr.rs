//! Integer expressions used by the YAML tables for shapes (`n_head * key_length_mla`), layer sets
//! (`bid >= n_dense`) and metadata consistency checks. Deliberately tiny: i64 values, booleans as 0/1,
//! `+ - * / %`, comparisons, `&& || !`, parentheses, identifiers and decimal literals. Arithmetic is
//! checked: overflow and division by zero are errors, never wrapped values, since the operands come
//! from untrusted file metadata.

use std::fmt;

/// A parsed expression.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expr {
    Num(i64),
    Var(String),
    Not(Box<Expr>),
    Neg(Box<Expr>),
    Bin(Op, Box<Expr>, Box<Expr>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Add,
    Sub,
    Mul,
    Div,
    Rem,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    And,
    Or,
}

impl Op {
    fn symbol(self) -> &'static str {
        match self {
            Op::Add => "+",
            Op::Sub => "-",
            Op::Mul => "*",
            Op::Div => "/",
            Op::Rem => "%",
            Op::Eq => "==",
            Op::Ne => "!=",
            Op::Lt => "<",
            Op::Le => "<=",
            Op::Gt => ">",
            Op::Ge => ">=",
            Op::And => "&&",
            Op::Or => "||",
        }
    }
}

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expr::Num(n) => write!(f, "{n}"),
            Expr::Var(v) => write!(f, "{v}"),
            Expr::Not(e) => write!(f, "!{e}"),
            Expr::Neg(e) => write!(f, "-{e}"),
            Expr::Bin(op, a, b) => write!(f, "({a} {} {b})", op.symbol()),
        }
    }
}

/// Why an expression could not be parsed or evaluated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ExprError {
    #[error("expression {src:?}: {msg} at column {col}")]
    Parse {
        src: String,
        msg: String,
        col: usize,
    },
    #[error("unknown variable {0:?}")]
    Unknown(String),
    #[error("variable {0:?} is not available ({1})")]
    Unavailable(String, String),
    #[error("arithmetic overflow evaluating {0}")]
    Overflow(String),
    #[error("division by zero evaluating {0}")]
    DivByZero(String),
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Num(i64),
    Ident(String),
    Op(&'static str),
    LParen,
    RParen,
}

fn lex(src: &str) -> Result<Vec<(Tok, usize)>, ExprError> {
    let err = |msg: &str, col: usize| ExprError::Parse {
        src: src.to_string(),
        msg: msg.to_string(),
        col,
    };
    let b = src.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() {
            i += 1;
        } else if c.is_ascii_digit() {
            let start = i;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            let n: i64 = src[start..i]
                .parse()
                .map_err(|_| err("integer literal too large", start))?;
            out.push((Tok::Num(n), start));
        } else if c.is_ascii_alphabetic() || c == b'_' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push((Tok::Ident(src[start..i].to_string()), start));
        } else if c == b'(' {
            out.push((Tok::LParen, i));
            i += 1;
        } else if c == b')' {
            out.push((Tok::RParen, i));
            i += 1;
        } else {
            const OPS: [&str; 15] = [
                "==", "!=", "<=", ">=", "&&", "||", "+", "-", "*", "/", "%", "<", ">", "!", "=",
            ];
            let rest = &src[i..];
            match OPS.iter().find(|op| rest.starts_with(**op)) {
                Some(&"=") | None => return Err(err("unexpected character", i)),
                Some(op) => {
                    out.push((Tok::Op(op), i));
                    i += op.len();
                }
            }
        }
    }
    Ok(out)
}

struct Parser<'a> {
    src: &'a str,
    toks: Vec<(Tok, usize)>,
    pos: usize,
}

impl Parser<'_> {
    fn err(&self, msg: &str) -> ExprError {
        let col = self.toks.get(self.pos).map_or(self.src.len(), |t| t.1);
        ExprError::Parse {
            src: self.src.to_string(),
            msg: msg.to_string(),
            col,
        }
    }

    fn peek_op(&self) -> Option<&'static str> {
        match self.toks.get(self.pos) {
            Some((Tok::Op(op), _)) => Some(op),
            _ => None,
        }
    }

    fn binary(&mut self, level: usize) -> Result<Expr, ExprError> {
        // Lowest precedence first.
        const LEVELS: [&[(&str, Op)]; 5] = [
            &[("||", Op::Or)],
            &[("&&", Op::And)],
            &[
                ("==", Op::Eq),
                ("!=", Op::Ne),
                ("<=", Op::Le),
                (">=", Op::Ge),
                ("<", Op::Lt),
                (">", Op::Gt),
            ],
            &[("+", Op::Add), ("-", Op::Sub)],
            &[("*", Op::Mul), ("/", Op::Div), ("%", Op::Rem)],
        ];
        if level == LEVELS.len() {
            return self.unary();
        }
        let mut lhs = self.binary(level + 1)?;
        while let Some(op) = self.peek_op() {
            let Some(&(_, o)) = LEVELS[level].iter().find(|(s, _)| *s == op) else {
                break;
            };
            self.pos += 1;
            let rhs = self.binary(level + 1)?;
            lhs = Expr::Bin(o, Box::new(lhs), Box::new(rhs));
        }
        Ok(lhs)
    }

    fn unary(&mut self) -> Result<Expr, ExprError> {
        match self.peek_op() {
            Some("!") => {
                self.pos += 1;
                Ok(Expr::Not(Box::new(self.unary()?)))
            }
            Some("-") => {
                self.pos += 1;
                Ok(Expr::Neg(Box::new(self.unary()?)))
            }
            _ => self.atom(),
        }
    }

    fn atom(&mut self) -> Result<Expr, ExprError> {
        let tok = self.toks.get(self.pos).map(|t| t.0.clone());
        match tok {
            Some(Tok::Num(n)) => {
                self.pos += 1;
                Ok(Expr::Num(n))
            }
            Some(Tok::Ident(s)) => {
                self.pos += 1;
                Ok(Expr::Var(s))
            }
            Some(Tok::LParen) => {
                self.pos += 1;
                let e = self.binary(0)?;
                if !matches!(self.toks.get(self.pos), Some((Tok::RParen, _))) {
                    return Err(self.err("expected ')'"));
                }
                self.pos += 1;
                Ok(e)
            }
            _ => Err(self.err("expected a number, a name or '('")),
        }
    }
}

impl Expr {
    /// Parses `src`; the whole string must be one expression.
    pub fn parse(src: &str) -> Result<Expr, ExprError> {
        let mut p = Parser {
            src,
            toks: lex(src)?,
            pos: 0,
        };
        let e = p.binary(0)?;
        if p.pos != p.toks.len() {
            return Err(p.err("unexpected trailing input"));
        }
        Ok(e)
    }

    /// Every variable name the expression reads.
    pub fn vars(&self, out: &mut Vec<String>) {
        match self {
            Expr::Num(_) => {}
            Expr::Var(v) => out.push(v.clone()),
            Expr::Not(e) | Expr::Neg(e) => e.vars(out),
            Expr::Bin(_, a, b) => {
                a.vars(out);
                b.vars(out);
            }
        }
    }

    /// Evaluates with `lookup` resolving variables. `&&`/`||` short-circuit, so
    /// `n_expert == 0 || x % n_expert == 0` never divides by zero.
    pub fn eval(
        &self,
        lookup: &mut dyn FnMut(&str) -> Result<i64, ExprError>,
    ) -> Result<i64, ExprError> {
        let ov = || ExprError::Overflow(self.to_string());
        Ok(match self {
            Expr::Num(n) => *n,
            Expr::Var(v) => lookup(v)?,
            Expr::Not(e) => i64::from(e.eval(lookup)? == 0),
            Expr::Neg(e) => e.eval(lookup)?.checked_neg().ok_or_else(ov)?,
            Expr::Bin(Op::And, a, b) => i64::from(a.eval(lookup)? != 0 && b.eval(lookup)? != 0),
            Expr::Bin(Op::Or, a, b) => i64::from(a.eval(lookup)? != 0 || b.eval(lookup)? != 0),
            Expr::Bin(op, a, b) => {
                let (x, y) = (a.eval(lookup)?, b.eval(lookup)?);
                match op {
                    Op::Add => x.checked_add(y).ok_or_else(ov)?,
                    Op::Sub => x.checked_sub(y).ok_or_else(ov)?,
                    Op::Mul => x.checked_mul(y).ok_or_else(ov)?,
                    Op::Div | Op::Rem if y == 0 => {
                        return Err(ExprError::DivByZero(self.to_string()))
                    }
                    Op::Div => x.checked_div(y).ok_or_else(ov)?,
                    Op::Rem => x.checked_rem(y).ok_or_else(ov)?,
                    Op::Eq => i64::from(x == y),
                    Op::Ne => i64::from(x != y),
                    Op::Lt => i64::from(x < y),
                    Op::Le => i64::from(x <= y),
                    Op::Gt => i64::from(x > y),
                    Op::Ge => i64::from(x >= y),
                    Op::And | Op::Or => unreachable!("handled above"),
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(src: &str, vars: &[(&str, i64)]) -> Result<i64, ExprError> {
        Expr::parse(src)?.eval(&mut |n| {
            vars.iter()
                .find(|(k, _)| *k == n)
                .map(|(_, v)| *v)
                .ok_or_else(|| ExprError::Unknown(n.to_string()))
        })
    }

    #[test]
    fn precedence_and_logic() {
        assert_eq!(ev("2 + 3 * 4", &[]), Ok(14));
        assert_eq!(ev("(2 + 3) * 4", &[]), Ok(20));
        assert_eq!(ev("10 - 4 - 3", &[]), Ok(3));
        assert_eq!(
            ev("a * (b + c)", &[("a", 64), ("b", 192), ("c", 256)]),
            Ok(28672)
        );
        assert_eq!(ev("x >= 3 && x < 79", &[("x", 78)]), Ok(1));
        assert_eq!(ev("!(x == 1) || 0", &[("x", 1)]), Ok(0));
        assert_eq!(ev("-3 + 5 % 3", &[]), Ok(-1));
    }

    #[test]
    fn errors_are_values_not_panics() {
        assert!(matches!(ev("1 / 0", &[]), Err(ExprError::DivByZero(_))));
        assert!(matches!(
            ev("9223372036854775807 + 1", &[]),
            Err(ExprError::Overflow(_))
        ));
        assert!(matches!(ev("a + 1", &[]), Err(ExprError::Unknown(_))));
        assert!(matches!(Expr::parse("a = 1"), Err(ExprError::Parse { .. })));
        assert!(matches!(
            Expr::parse("(a + 1"),
            Err(ExprError::Parse { .. })
        ));
        assert!(matches!(Expr::parse("a b"), Err(ExprError::Parse { .. })));
        assert!(matches!(Expr::parse(""), Err(ExprError::Parse { .. })));
        // short-circuit keeps a guarded division safe
        assert_eq!(ev("n == 0 || 6 % n == 0", &[("n", 0)]), Ok(1));
    }
}
