//! What a doctor check found and how it is shown: one [`CheckResult`] per check (its items:
//! findings, warnings, notes), rendered as the human report or as the `--json` document
//! `{"checks": [{"id", "status", "subject", "detail"}], "first_finding": ...}` (docs/JSON.md).

use serde::Serialize;
use serde_json::{json, Value};
use std::time::Instant;

/// Verdict of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Pass,
    Finding,
    Warning,
    Skipped,
}

impl Status {
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pass => "pass",
            Status::Finding => "finding",
            Status::Warning => "warning",
            Status::Skipped => "skipped",
        }
    }
}

/// How serious one observation is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Severity {
    /// The model is broken here.
    Finding,
    /// Unusual, but healthy models show it too (statistical outliers, layout quirks).
    Warning,
}

/// One observation: what it concerns (tensor, layer/op or shard file), what was seen, what to do.
#[derive(Debug, Clone)]
pub struct Item {
    pub severity: Severity,
    pub subject: Option<String>,
    pub detail: String,
    pub advice: Option<String>,
}

impl Item {
    pub fn finding(subject: impl Into<Option<String>>, detail: impl Into<String>) -> Item {
        Item {
            severity: Severity::Finding,
            subject: subject.into(),
            detail: detail.into(),
            advice: None,
        }
    }
    pub fn warning(subject: impl Into<Option<String>>, detail: impl Into<String>) -> Item {
        Item {
            severity: Severity::Warning,
            ..Item::finding(subject, detail)
        }
    }
    pub fn advice(mut self, a: impl Into<String>) -> Item {
        self.advice = Some(a.into());
        self
    }

    fn text(&self) -> String {
        let mut s = match &self.subject {
            Some(sub) => format!("{sub}: {}", self.detail),
            None => self.detail.clone(),
        };
        if let Some(a) = &self.advice {
            s.push_str(&format!(" -- to do: {a}"));
        }
        s
    }
}

/// Items listed in one JSON `detail` (the human report lists more).
const DETAIL_ITEMS: usize = 12;
/// Items listed per check in the human report.
const HUMAN_ITEMS: usize = 40;

/// The outcome of one check.
#[derive(Debug, Clone)]
pub struct CheckResult {
    /// Stable id used in `--json` (`container`, `mapping`, ...).
    pub id: &'static str,
    /// Position in the report (1-7 for the model checks).
    pub number: usize,
    /// What passed or was measured, one line (shown whatever the status).
    pub summary: String,
    pub items: Vec<Item>,
    /// Why the check did not run.
    pub skipped: Option<String>,
    pub seconds: f64,
}

impl CheckResult {
    pub fn new(number: usize, id: &'static str) -> CheckResult {
        CheckResult {
            id,
            number,
            summary: String::new(),
            items: Vec::new(),
            skipped: None,
            seconds: 0.0,
        }
    }

    pub fn skipped(number: usize, id: &'static str, why: impl Into<String>) -> CheckResult {
        CheckResult {
            skipped: Some(why.into()),
            ..CheckResult::new(number, id)
        }
    }

    pub fn push(&mut self, item: Item) {
        self.items.push(item);
    }

    /// Findings first (in the order found), then warnings.
    fn ordered(&self) -> Vec<&Item> {
        let mut v: Vec<&Item> = self.items.iter().collect();
        v.sort_by_key(|i| i.severity);
        v
    }

    pub fn status(&self) -> Status {
        if self.items.iter().any(|i| i.severity == Severity::Finding) {
            Status::Finding
        } else if self.skipped.is_some() {
            Status::Skipped
        } else if self.items.is_empty() {
            Status::Pass
        } else {
            Status::Warning
        }
    }

    pub fn first_finding(&self) -> Option<&Item> {
        self.items.iter().find(|i| i.severity == Severity::Finding)
    }

    fn subject(&self) -> Option<String> {
        self.ordered().first().and_then(|i| i.subject.clone())
    }

    fn counts(&self) -> (usize, usize) {
        let f = self
            .items
            .iter()
            .filter(|i| i.severity == Severity::Finding)
            .count();
        (f, self.items.len() - f)
    }

    /// The one-string account of the check used by `--json`.
    pub fn detail(&self) -> String {
        let mut parts = Vec::new();
        let (f, w) = self.counts();
        if let Some(why) = &self.skipped {
            parts.push(format!("skipped: {why}"));
        }
        if f + w > 0 {
            let mut head = Vec::new();
            if f > 0 {
                head.push(format!("{f} finding(s)"));
            }
            if w > 0 {
                head.push(format!("{w} warning(s)"));
            }
            let listed: Vec<String> = self
                .ordered()
                .iter()
                .take(DETAIL_ITEMS)
                .map(|i| {
                    let tag = if i.severity == Severity::Finding {
                        "finding"
                    } else {
                        "warning"
                    };
                    format!("[{tag}] {}", i.text())
                })
                .collect();
            let more = (f + w).saturating_sub(DETAIL_ITEMS);
            let mut s = format!("{}: {}", head.join(", "), listed.join("; "));
            if more > 0 {
                s.push_str(&format!("; and {more} more"));
            }
            parts.push(s);
        }
        if !self.summary.is_empty() {
            parts.push(self.summary.clone());
        }
        parts.push(format!("({:.2} s)", self.seconds));
        parts.join(" | ")
    }

    pub fn to_json(&self) -> Value {
        json!({
            "id": self.id,
            "status": self.status().as_str(),
            "subject": self.subject(),
            "detail": self.detail(),
        })
    }
}

/// Runs `f` and records how long it took in the result.
pub fn timed(f: impl FnOnce() -> CheckResult) -> CheckResult {
    let t = Instant::now();
    let mut r = f();
    r.seconds = t.elapsed().as_secs_f64();
    r
}

/// A whole doctor run.
pub struct Report {
    pub title: String,
    pub checks: Vec<CheckResult>,
}

impl Report {
    /// The first finding in check order (checks run in the order a user would fix things).
    pub fn first_finding(&self) -> Option<(&CheckResult, &Item)> {
        self.checks
            .iter()
            .find_map(|c| c.first_finding().map(|i| (c, i)))
    }

    pub fn has_findings(&self) -> bool {
        self.first_finding().is_some()
    }

    pub fn to_json(&self) -> Value {
        let first = self.first_finding().map(|(c, i)| {
            let mut detail = i.detail.clone();
            if let Some(a) = &i.advice {
                detail.push_str(&format!(" -- to do: {a}"));
            }
            json!({"check": c.id, "subject": i.subject, "detail": detail})
        });
        json!({
            "checks": self.checks.iter().map(CheckResult::to_json).collect::<Vec<_>>(),
            "first_finding": first,
        })
    }

    pub fn print_human(&self) {
        println!("{}", self.title);
        let width = self.checks.iter().map(|c| c.id.len()).max().unwrap_or(0);
        for c in &self.checks {
            let status = match c.status() {
                Status::Finding => "FINDING",
                Status::Warning => "warning",
                Status::Pass => "pass",
                Status::Skipped => "skipped",
            };
            let mut line = format!(
                "{:>2}. {:<width$}  {:<8} ({:.2} s)",
                c.number, c.id, status, c.seconds
            );
            if let Some(why) = &c.skipped {
                line.push_str(&format!("  skipped: {why}"));
            }
            println!("{line}");
            if !c.summary.is_empty() {
                println!("      {}", c.summary);
            }
            let items = c.ordered();
            for i in items.iter().take(HUMAN_ITEMS) {
                // Findings start the line (`grep ^finding` in scripts, as before).
                if i.severity == Severity::Finding {
                    println!("finding: [{}] {}", c.id, i.text());
                } else {
                    println!("      warning: {}", i.text());
                }
            }
            if items.len() > HUMAN_ITEMS {
                println!("      ... and {} more", items.len() - HUMAN_ITEMS);
            }
        }
        match self.first_finding() {
            None => println!("doctor: no findings"),
            Some((c, i)) => {
                println!();
                println!(
                    ">>> first finding: check {} ({}){}",
                    c.number,
                    c.id,
                    i.subject
                        .as_deref()
                        .map(|s| format!(": {s}"))
                        .unwrap_or_default()
                );
                println!("    {}", i.detail);
                if let Some(a) = &i.advice {
                    println!("    to do: {a}");
                }
            }
        }
    }
}
