//! `--draft mtp [--draft-n K]`: speculative decoding with the model's own NextN / MTP layer,
//! shared by `generate`, `serve` and `bench`.

use anyhow::{bail, Result};
use runtime::LanguageModel;

/// Which drafter proposes tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DraftKind {
    /// The model's NextN / multi-token-prediction layer (GLM-5, DeepSeek-V3 style).
    Mtp,
}

/// Draft tokens per round when `--draft-n` is not given. Measured on the fixture model (BF16,
/// CPU, greedy, 32 tokens, the six reference prompts): K = 1, 2, 3, 4 accept 0.99, 0.86, 0.83,
/// 0.77 of their drafts, i.e. about 2.0, 2.8, 3.6, 4.2 tokens per verification step (1 + the sum
/// of the per-depth rates, averaged over the prompts). 3 is where one more draft step still buys
/// ~0.8 tokens per round; the 4th buys ~0.6 at the price of a longer verification and a deeper,
/// less accurate recursive draft (GLM-5's own layer drafts less well at depth than this one).
pub const DEFAULT_DRAFT_N: usize = 3;

#[derive(clap::Args, Debug, Clone)]
pub struct DraftArgs {
    /// Speculative decoding: `mtp` drafts with the model's NextN/MTP layer and verifies the
    /// drafts with one batched forward pass of the trunk (output distribution unchanged).
    #[arg(long, value_enum)]
    pub draft: Option<DraftKind>,
    /// Draft tokens per round with --draft (1..=4).
    #[arg(long, value_name = "K", requires = "draft",
          value_parser = clap::value_parser!(u8).range(1..=serving::speculative::MAX_DRAFT as i64))]
    pub draft_n: Option<u8>,
}

impl DraftArgs {
    /// Draft tokens per round, or `None` without `--draft`; refuses a model without a draft
    /// layer with a clear message.
    pub fn k_for(&self, lm: &dyn LanguageModel) -> Result<Option<usize>> {
        let Some(DraftKind::Mtp) = self.draft else {
            return Ok(None);
        };
        if lm.draft_layers() == 0 {
            bail!(
                "--draft mtp: this model has no NextN/MTP layer (nextn_predict_layers = 0, \
                 or the file lacks its tensors); run without --draft"
            );
        }
        Ok(Some(self.draft_n.map_or(DEFAULT_DRAFT_N, usize::from)))
    }
}
