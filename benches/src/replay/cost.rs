//! The modelled TTFT of a replayed request (a MODEL, not a measurement): the prefill fit of
//! docs/ttft.md for the tokens recomputed, plus each path's fixed cost and bytes over its
//! bandwidth for the tokens loaded. The defaults are docs/ttft.md's figures (its model: 144 KiB
//! of KV per token; DRAM page-first 52.8 GB/s; peer over TCP 2.7 GB/s); the replay reports the
//! paths' costs it measured itself beside them.

use super::trace::{Request, TRACE_BLOCK_TOKENS};

/// Where each block of one request came from (blocks; exact, from the daemon's answers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Served {
    /// Blocks the request references.
    pub refs: u64,
    /// Leading blocks found in the engine's GPU cache.
    pub gpu: u64,
    /// Next leading blocks the engine's daemon held.
    pub dram: u64,
    /// Next leading blocks the daemon pulled from the hinted peer.
    pub peer: u64,
    /// Blocks recomputed.
    pub computed: u64,
    /// Recomputed blocks the daemon stored on offload (the rest it held already).
    pub stored: u64,
}

/// Prefill and path parameters.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct CostModel {
    /// Fixed cost of a prefill, ms (docs/ttft.md fit: 12–22 ms).
    pub prefill_fixed_ms: f64,
    /// Per new token, µs (fit: 28.7–30.6).
    pub per_token_us: f64,
    /// Per new token per context token, ns (fit: 1.7).
    pub per_token_ctx_ns: f64,
    /// KV bytes per token of the modelled engine.
    pub kv_bytes_per_token: f64,
    /// Fixed cost of one path used by a request, ms.
    pub path_fixed_ms: f64,
    /// DRAM (node daemon) bandwidth, GB/s.
    pub dram_gbps: f64,
    /// Peer pull bandwidth, GB/s.
    pub peer_gbps: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            prefill_fixed_ms: 17.0,
            per_token_us: 29.6,
            per_token_ctx_ns: 1.7,
            kv_bytes_per_token: 147_456.0,
            path_fixed_ms: 0.4,
            dram_gbps: 52.8,
            peer_gbps: 2.7,
        }
    }
}

impl CostModel {
    /// Modelled prefill of `r` served as `s` (the tokens not served from any cache), ms.
    pub fn prefill_ms(&self, r: &Request, s: &Served) -> f64 {
        let tokens = f64::from(r.input_tokens);
        let block = f64::from(TRACE_BLOCK_TOKENS);
        let loaded = ((s.dram + s.peer) as f64 * block).min(tokens - 1.0);
        let gpu = (s.gpu as f64 * block).min(tokens - 1.0 - loaded);
        let new = (tokens - loaded - gpu).max(1.0);
        self.prefill_fixed_ms
            + new * self.per_token_us / 1e3
            + new * tokens * self.per_token_ctx_ns / 1e6
    }

    /// Modelled TTFT of `r` served as `s`, ms.
    pub fn ttft_ms(&self, r: &Request, s: &Served) -> f64 {
        let block = f64::from(TRACE_BLOCK_TOKENS);
        let prefill = self.prefill_ms(r, s);
        let path = |blocks: u64, gbps: f64| {
            if blocks == 0 {
                0.0
            } else {
                let bytes = blocks as f64 * block * self.kv_bytes_per_token;
                self.path_fixed_ms + bytes / (gbps * 1e9) * 1e3
            }
        };
        prefill + path(s.dram, self.dram_gbps) + path(s.peer, self.peer_gbps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_cost_less_than_recompute_at_dram_speed() {
        let r = Request {
            at_ms: 0,
            input_tokens: 8192,
            output_tokens: 1,
            blocks: (0..16).collect(),
        };
        let m = CostModel::default();
        let cold = m.ttft_ms(&r, &Served::default());
        let warm = m.ttft_ms(
            &r,
            &Served {
                dram: 8,
                ..Served::default()
            },
        );
        assert!(warm < cold, "{warm} {cold}");
        assert!((cold - (17.0 + 8192.0 * 0.0296 + 8192.0 * 8192.0 * 1.7e-6)).abs() < 1e-6);
    }
}
