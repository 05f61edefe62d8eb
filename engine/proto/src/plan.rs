//! Fetch plans: whether fetching a prefix is faster than recomputing it (docs/fetch-plans.md).
//!
//! An engine sends its recompute cost with a lookup (`Exists { recompute }`); the daemon
//! answers with a [`FetchPlan`]: the leading keys worth fetching, from which path, cut where
//! fetching the rest would take longer than recomputing it. The daemon measures each path's
//! cost from what it moves ([`PathCost`], in `stats.costs`).

use serde::{Deserialize, Serialize};

/// Largest `page_tokens` accepted (a page of a million tokens is no engine's).
pub const MAX_PAGE_TOKENS: u32 = 1 << 20;
/// Largest `keys_per_page` accepted.
pub const MAX_KEYS_PER_PAGE: u32 = 4096;
/// Largest `start_tokens` accepted (2^40: beyond any context).
pub const MAX_START_TOKENS: u64 = 1 << 40;

/// How the engine will read what the plan fetches from the daemon's DRAM tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReadPath {
    /// Bytes over the client socket (`Get` copy mode).
    #[default]
    Copy,
    /// Into a client region or through a lease (shared memory, no socket copy).
    Region,
    /// Into GPU memory by the daemon's GPU path.
    Gpu,
}

/// The engine's cost of recomputing tokens instead of fetching their KV:
/// `R(x) = x / tokens_per_s + quad_s * x²` seconds for a prefill of `x` tokens from nothing,
/// and `T(c, x) = n / tokens_per_s + quad_s * n² + ctx_s * n * c` (with `n = x - c`) for the
/// tokens `[c, x)` after `c` cached ones. Without `ctx_s` (`2 × quad_s`), `T(c, x) = R(x) - R(c)`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecomputeCost {
    /// Tokens one page holds.
    pub page_tokens: u32,
    /// Keys per page (one per segment); plans cut at page boundaries. Default 1.
    #[serde(default = "one")]
    pub keys_per_page: u32,
    /// Prefill throughput at short context, tokens per second (the linear term).
    pub tokens_per_s: f64,
    /// Attention term, seconds per token squared (0: linear).
    #[serde(default)]
    pub quad_s: f64,
    /// Tokens before the first key that the engine already holds.
    #[serde(default)]
    pub start_tokens: u64,
    /// Context term: seconds per token recomputed per token cached before it (the tail's
    /// attention to the cached prefix, and whatever else an engine's prefill after a cached
    /// prefix costs). Absent: `2 × quad_s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ctx_s: Option<f64>,
    /// The prompt's tokens in all: the recomputed tail runs to its end. Absent: the end of
    /// the keys looked up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens: Option<u64>,
    /// How the engine reads the fetched blocks.
    #[serde(default)]
    pub via: ReadPath,
}

fn one() -> u32 {
    1
}

// `Op` and `Reply` compare as `Eq`. A NaN field would break reflexivity; `validate` refuses
// NaN costs, and the daemon produces finite plans only.
impl Eq for RecomputeCost {}
impl Eq for FetchPlan {}

/// Why a [`RecomputeCost`] is refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CostError {
    /// A field outside its range.
    #[error("recompute cost: {0}")]
    Field(String),
}

impl RecomputeCost {
    /// Checks every field (the daemon refuses a request whose cost fails).
    pub fn validate(&self) -> Result<(), CostError> {
        let bad = |m: String| Err(CostError::Field(m));
        if self.page_tokens == 0 || self.page_tokens > MAX_PAGE_TOKENS {
            return bad(format!(
                "page_tokens {} is outside 1..={MAX_PAGE_TOKENS}",
                self.page_tokens
            ));
        }
        if self.keys_per_page == 0 || self.keys_per_page > MAX_KEYS_PER_PAGE {
            return bad(format!(
                "keys_per_page {} is outside 1..={MAX_KEYS_PER_PAGE}",
                self.keys_per_page
            ));
        }
        if !(self.tokens_per_s.is_finite() && self.tokens_per_s > 0.0) {
            return bad(format!(
                "tokens_per_s {} must be a positive number",
                self.tokens_per_s
            ));
        }
        if !(self.quad_s.is_finite() && self.quad_s >= 0.0) {
            return bad(format!("quad_s {} must be zero or positive", self.quad_s));
        }
        if let Some(c) = self.ctx_s
            && !(c.is_finite() && c >= 0.0)
        {
            return bad(format!("ctx_s {c} must be zero or positive"));
        }
        if self.prompt_tokens.is_some_and(|p| p > MAX_START_TOKENS) {
            return bad(format!("prompt_tokens is over {MAX_START_TOKENS}"));
        }
        if self.start_tokens > MAX_START_TOKENS {
            return bad(format!(
                "start_tokens {} is over {MAX_START_TOKENS}",
                self.start_tokens
            ));
        }
        Ok(())
    }

    /// Seconds to prefill `x` tokens from nothing.
    pub fn prefill_s(&self, x: f64) -> f64 {
        x / self.tokens_per_s + self.quad_s * x * x
    }

    /// Tokens before key `k` (`start_tokens` included).
    fn tok(&self, k: u64) -> f64 {
        self.start_tokens as f64
            + (k / u64::from(self.keys_per_page)) as f64 * f64::from(self.page_tokens)
    }

    /// Seconds to recompute the tokens of keys `[from, to)` (after `start_tokens`) from
    /// nothing: `R(to) - R(from)`.
    pub fn recompute_s(&self, from_key: u64, to_key: u64) -> f64 {
        self.prefill_s(self.tok(to_key)) - self.prefill_s(self.tok(from_key))
    }

    /// Seconds to compute tokens `[c, x)` with `[0, c)` cached: `T(c, x)`.
    pub fn tail_s(&self, c: f64, x: f64) -> f64 {
        let n = (x - c).max(0.0);
        let ctx = self.ctx_s.unwrap_or(2.0 * self.quad_s);
        n / self.tokens_per_s + self.quad_s * n * n + ctx * n * c
    }

    /// Seconds that fetching keys `[0, k)` (of `keys` looked up) saves: the prompt's tail
    /// recomputed from `start_tokens` less the tail recomputed from key `k`. Without
    /// `ctx_s` and `prompt_tokens` this is [`RecomputeCost::recompute_s`]`(0, k)`.
    pub fn saved_s(&self, k: u64, keys: u64) -> f64 {
        let end = self.tok(keys);
        let end = self.prompt_tokens.map_or(end, |p| (p as f64).max(end));
        self.tail_s(self.tok(0), end) - self.tail_s(self.tok(k), end)
    }
}

/// Where a run of planned keys comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlanSource {
    /// This daemon's DRAM tier.
    Dram,
    /// This daemon's NVMe tier (promoted to DRAM, then read).
    Nvme,
    /// The peer a hint names (pulled into DRAM, then read).
    Peer,
}

/// A run of consecutive planned keys from one source.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PlanRun {
    /// Source.
    pub source: PlanSource,
    /// Keys in the run.
    pub keys: u32,
}

/// Why the plan ends where it does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PlanReason {
    /// Every key the daemon could serve is worth fetching.
    All,
    /// Fetching past the cut would take longer than recomputing (`cut_by` says which path).
    Slower,
    /// A path has no recent measurement: the plan takes a bounded probe from it and stops.
    Probe,
    /// Nothing to fetch: no key is held (or hinted).
    Nothing,
}

/// The daemon's answer to a lookup with a recompute cost.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FetchPlan {
    /// Leading keys worth fetching (a multiple of `keys_per_page`, unless the held run ends
    /// inside a page). The engine fetches these and recomputes the rest.
    pub keys: u32,
    /// The planned keys by source, in key order.
    pub runs: Vec<PlanRun>,
    /// Predicted seconds to fetch the planned keys.
    pub fetch_s: f64,
    /// Predicted seconds to recompute the planned keys' tokens instead.
    pub recompute_s: f64,
    /// Why the plan ends there.
    pub reason: PlanReason,
    /// The path that stopped the plan (`Slower`, `Probe`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cut_by: Option<PlanSource>,
    /// Keys the daemon could have served (held here, or covered by a hint).
    pub available: u32,
    /// One line for logs and operators.
    pub note: String,
}

/// A path's measured cost: `fixed_s + bytes / bytes_per_s`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PathCost {
    /// `dram_copy`, `dram_region`, `dram_gpu`, `nvme_read`, `peer:<addr>/<conns>`.
    pub path: String,
    /// Fixed cost per operation, seconds.
    pub fixed_s: f64,
    /// Rate past the fixed cost, bytes per second.
    pub bytes_per_s: f64,
    /// Operations measured (all time).
    pub samples: u64,
    /// Seconds since the last measured operation.
    pub age_s: f64,
}

/// Plans answered, by outcome (`stats.plans`, `/metrics` `kvnode_plans_total{reason}`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PlanStats {
    /// Every key available was planned.
    pub all: u64,
    /// Cut short because a path was slower than recompute.
    pub slower: u64,
    /// Cut at a bounded probe of an unmeasured path.
    pub probe: u64,
    /// Nothing available.
    pub nothing: u64,
    /// Keys planned for fetching, and keys available but left to recompute.
    pub keys_fetch: u64,
    /// Keys available but left to recompute.
    pub keys_recompute: u64,
    /// Hinted lookups whose peer pull was not started because the plan left it out.
    pub pulls_skipped: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cost() -> RecomputeCost {
        RecomputeCost {
            ctx_s: None,
            prompt_tokens: None,
            page_tokens: 64,
            keys_per_page: 1,
            tokens_per_s: 34_000.0,
            quad_s: 6.3e-10,
            start_tokens: 0,
            via: ReadPath::Copy,
        }
    }

    #[test]
    fn the_h100_fit_recomputes_32k_tokens_in_about_1_6_s() {
        let c = cost();
        let s = c.recompute_s(0, 512);
        assert!((1.5..1.7).contains(&s), "{s}");
    }

    #[test]
    fn later_tokens_cost_more_with_the_attention_term() {
        let c = cost();
        assert!(c.recompute_s(256, 512) > c.recompute_s(0, 256));
        let linear = RecomputeCost {
            ctx_s: None,
            prompt_tokens: None,
            quad_s: 0.0,
            ..cost()
        };
        assert!((linear.recompute_s(256, 512) - linear.recompute_s(0, 256)).abs() < 1e-12);
    }

    #[test]
    fn a_bad_cost_is_refused_by_field() {
        for (c, field) in [
            (
                RecomputeCost {
                    ctx_s: None,
                    prompt_tokens: None,
                    page_tokens: 0,
                    ..cost()
                },
                "page_tokens",
            ),
            (
                RecomputeCost {
                    ctx_s: None,
                    prompt_tokens: None,
                    keys_per_page: 0,
                    ..cost()
                },
                "keys_per_page",
            ),
            (
                RecomputeCost {
                    ctx_s: None,
                    prompt_tokens: None,
                    tokens_per_s: f64::NAN,
                    ..cost()
                },
                "tokens_per_s",
            ),
            (
                RecomputeCost {
                    ctx_s: None,
                    prompt_tokens: None,
                    tokens_per_s: -1.0,
                    ..cost()
                },
                "tokens_per_s",
            ),
            (
                RecomputeCost {
                    ctx_s: None,
                    prompt_tokens: None,
                    quad_s: f64::INFINITY,
                    ..cost()
                },
                "quad_s",
            ),
            (
                RecomputeCost {
                    ctx_s: None,
                    prompt_tokens: None,
                    start_tokens: u64::MAX,
                    ..cost()
                },
                "start_tokens",
            ),
        ] {
            let e = c.validate().expect_err(field).to_string();
            assert!(e.contains(field), "{e}");
        }
        cost().validate().expect("valid");
    }

    proptest! {
        #[test]
        fn any_json_decodes_or_errs_and_a_valid_cost_costs_a_finite_nonnegative_time(
            page in any::<u32>(), kpp in any::<u32>(), tps in any::<f64>(), q in any::<f64>(),
            start in any::<u64>(), a in 0u64..1_000_000, b in 0u64..1_000_000,
        ) {
            let c = RecomputeCost {
                ctx_s: None,
                prompt_tokens: None,
                page_tokens: page, keys_per_page: kpp, tokens_per_s: tps, quad_s: q,
                start_tokens: start, via: ReadPath::Gpu,
            };
            if c.validate().is_ok() {
                let (a, b) = (a.min(b), a.max(b));
                let s = c.recompute_s(a, b);
                prop_assert!(s.is_finite() || c.tokens_per_s < 1e-300);
                prop_assert!(s >= 0.0 || s.is_nan());
            }
            // Round trip through the wire form.
            let text = serde_json::to_string(&c).unwrap_or_default();
            if let Ok(back) = serde_json::from_str::<RecomputeCost>(&text) {
                prop_assert_eq!(back.page_tokens, c.page_tokens);
            }
        }

        #[test]
        fn arbitrary_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = serde_json::from_slice::<RecomputeCost>(&bytes);
            let _ = rmp_serde::from_slice::<RecomputeCost>(&bytes);
            let _ = rmp_serde::from_slice::<FetchPlan>(&bytes);
        }
    }
}
