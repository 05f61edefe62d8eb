use kvnode_proto::plan::{PlanReason, PlanSource, ReadPath, RecomputeCost};

use super::{Avail, DRAM_DEFAULT, Figures, Probing, plan};
use crate::obs::cost::Figure;

/// The H100 fit of docs/ttft.md: 32k tokens in ~1.6 s; 64-token pages of ~9.4 MB (4.83 GB of
/// KV for 32k tokens: a recompute-equivalent rate of ~3 GB/s).
fn h100() -> RecomputeCost {
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

const PAGE: u64 = 4_830_000_000 / 512;

fn fig(gbps: f64) -> Figure {
    Figure {
        fixed_s: 1e-4,
        bytes_per_s: gbps * 1e9,
        age_s: 1.0,
    }
}

fn keys(runs: &[(PlanSource, usize)]) -> Vec<Avail> {
    runs.iter()
        .flat_map(|&(source, n)| {
            std::iter::repeat_n(
                Avail {
                    source,
                    bytes: PAGE,
                },
                n,
            )
        })
        .collect()
}

fn figs(read: f64, nvme: Option<f64>, peer: Option<f64>) -> Figures {
    Figures {
        read: Some(fig(read)),
        nvme: nvme.map(fig),
        peer: peer.map(fig),
    }
}

#[test]
fn dram_at_memcpy_speed_is_fetched_whole() {
    let k = keys(&[(PlanSource::Dram, 512)]);
    let p = plan(&k, &h100(), &figs(20.0, None, None), &Probing::default());
    assert_eq!((p.keys, p.reason), (512, PlanReason::All), "{}", p.note);
    assert!(p.fetch_s < 0.3 && p.recompute_s > 1.5, "{p:?}");
}

#[test]
fn a_disk_slower_than_recompute_is_left_to_recompute() {
    // The GPU host's disk: 1.2 GB/s against ~3 GB/s of recompute.
    let k = keys(&[(PlanSource::Nvme, 512)]);
    let p = plan(
        &k,
        &h100(),
        &figs(20.0, Some(1.2), None),
        &Probing::default(),
    );
    assert_eq!(p.keys, 0, "{}", p.note);
    assert_eq!(
        (p.reason, p.cut_by),
        (PlanReason::Slower, Some(PlanSource::Nvme))
    );
    assert_eq!(p.available, 512);
    // A fast disk is fetched.
    let p = plan(
        &k,
        &h100(),
        &figs(20.0, Some(12.0), None),
        &Probing::default(),
    );
    assert_eq!((p.keys, p.reason), (512, PlanReason::All), "{}", p.note);
}

#[test]
fn a_mixed_prefix_takes_the_dram_part_and_recomputes_the_slow_rest() {
    let k = keys(&[(PlanSource::Dram, 256), (PlanSource::Nvme, 256)]);
    let p = plan(
        &k,
        &h100(),
        &figs(20.0, Some(1.2), None),
        &Probing::default(),
    );
    assert_eq!(p.keys, 256, "{}", p.note);
    assert_eq!(p.runs.len(), 1);
    assert_eq!(p.cut_by, Some(PlanSource::Nvme));
}

#[test]
fn the_attention_term_makes_a_slow_path_worth_it_late_in_a_long_context() {
    // Tokens late in a long prompt cost more to recompute than early ones: a path a bit
    // slower than the short-context rate can still win there.
    let mut cost = h100();
    cost.start_tokens = 128 * 1024;
    let k = keys(&[(PlanSource::Nvme, 64)]);
    let near = plan(&k, &cost, &figs(20.0, Some(2.0), None), &Probing::default());
    assert_eq!(near.keys, 64, "{}", near.note);
    cost.start_tokens = 0;
    let far = plan(&k, &cost, &figs(20.0, Some(2.0), None), &Probing::default());
    assert_eq!(far.keys, 0, "{}", far.note);
}

#[test]
fn a_peer_that_loses_is_not_taken_and_one_that_wins_is() {
    let k = keys(&[(PlanSource::Dram, 8), (PlanSource::Peer, 100)]);
    // 25 GbE over one connection: ~1 GB/s.
    let slow = plan(
        &k,
        &h100(),
        &figs(20.0, None, Some(1.0)),
        &Probing::default(),
    );
    assert_eq!(slow.keys, 8, "{}", slow.note);
    assert_eq!(slow.cut_by, Some(PlanSource::Peer));
    let fast = plan(
        &k,
        &h100(),
        &figs(20.0, None, Some(10.0)),
        &Probing::default(),
    );
    assert_eq!(fast.keys, 108, "{}", fast.note);
    assert_eq!(fast.runs.last().map(|r| r.source), Some(PlanSource::Peer));
}

#[test]
fn streaming_into_the_gpu_overlaps_a_pull_with_the_copy() {
    // 4 GB/s pulls: summed with the 5 GB/s read into the engine they lose (~2.2 GB/s),
    // overlapped (a pull streamed into the GPU) they win.
    let k = keys(&[(PlanSource::Peer, 256)]);
    let f = figs(5.0, None, Some(4.0));
    let exact = Probing {
        margin: 0.0,
        ..Probing::default()
    };
    assert_eq!(plan(&k, &h100(), &f, &exact).keys, 0);
    let gpu = RecomputeCost {
        via: ReadPath::Gpu,
        ..h100()
    };
    assert_eq!(plan(&k, &gpu, &f, &exact).keys, 256);
}

/// A path predicted to win by less than the margin is not taken: measured I/O rates
/// scatter, and a wrong fetch costs more than a wrong recompute.
#[test]
fn a_fetch_that_wins_by_less_than_the_margin_is_recomputed() {
    let k = keys(&[(PlanSource::Nvme, 512)]);
    let c = h100();
    // The NVMe rate at which fetching all 512 pages takes 95 % of recomputing them.
    let recompute = c.saved_s(512, 512);
    // (Promotion streams under the read: the slower of the two counts.)
    let nvme = 512.0 * PAGE as f64 / (0.95 * recompute) / 1e9;
    let f = figs(20.0, Some(nvme), None);
    let exact = Probing {
        margin: 0.0,
        ..Probing::default()
    };
    assert_eq!(plan(&k, &c, &f, &exact).keys, 512);
    let p = plan(&k, &c, &f, &Probing::default());
    assert_eq!(p.keys, 0, "{}", p.note);
    assert_eq!(p.cut_by, Some(PlanSource::Nvme));
}

/// With a context term above the attention model's (an engine whose prefill after a cached
/// prefix is dear), recomputing the tail after a fetched head costs more: a slow rest that
/// the attention model would recompute is worth fetching.
#[test]
fn a_dear_context_term_makes_the_recomputed_tail_dearer() {
    let k = keys(&[(PlanSource::Dram, 256), (PlanSource::Nvme, 256)]);
    let plain = h100();
    let dear = RecomputeCost {
        ctx_s: Some(4.0 * plain.quad_s),
        ..h100()
    };
    // Fetching only the head saves less: the tail left to recompute is dearer.
    assert!(dear.saved_s(256, 512) < plain.saved_s(256, 512));
    assert!((plain.saved_s(256, 512) - plain.recompute_s(0, 256)).abs() < 1e-12);
    // What fetching the rest (after the head) saves, for each engine; an NVMe rate between
    // the two: only the dear engine fetches it all.
    let (a, b) = (
        plain.saved_s(512, 512) - plain.saved_s(256, 512),
        dear.saved_s(512, 512) - dear.saved_s(256, 512),
    );
    assert!(b > 1.3 * a, "{a} {b}");
    let nvme = 256.0 * PAGE as f64 / f64::midpoint(a, b) / 1e9;
    let f = figs(1000.0, Some(nvme), None);
    let exact = Probing {
        margin: 0.0,
        ..Probing::default()
    };
    assert_eq!(plan(&k, &plain, &f, &exact).keys, 256);
    assert_eq!(plan(&k, &dear, &f, &exact).keys, 512);
}

#[test]
fn an_unmeasured_path_gets_a_bounded_probe_never_the_whole_bet() {
    let k = keys(&[(PlanSource::Dram, 4), (PlanSource::Nvme, 500)]);
    let probing = Probing {
        probe_bytes: 3 * PAGE,
        ..Probing::default()
    };
    let p = plan(&k, &h100(), &figs(20.0, None, None), &probing);
    assert_eq!(
        (p.reason, p.cut_by),
        (PlanReason::Probe, Some(PlanSource::Nvme))
    );
    assert_eq!(p.keys, 4 + 3, "{}", p.note);
}

#[test]
fn a_stale_losing_path_is_probed_within_its_time_budget_so_recovery_is_seen() {
    let k = keys(&[(PlanSource::Nvme, 64)]);
    let stale = Figure {
        age_s: 120.0,
        ..fig(0.02)
    };
    let f = Figures {
        read: Some(fig(20.0)),
        nvme: Some(stale),
        peer: None,
    };
    let p = plan(&k, &h100(), &f, &Probing::default());
    // 20 ms at 20 MB/s is 400 kB: one page (at least one is taken).
    assert_eq!((p.keys, p.reason), (1, PlanReason::Probe), "{}", p.note);
    let fresh = Figures {
        nvme: Some(fig(0.02)),
        ..f
    };
    assert_eq!(plan(&k, &h100(), &fresh, &Probing::default()).keys, 0);
}

#[test]
fn plans_cut_at_page_boundaries_of_multi_segment_pages() {
    let cost = RecomputeCost {
        ctx_s: None,
        prompt_tokens: None,
        keys_per_page: 4,
        page_tokens: 256,
        ..h100()
    };
    let k = keys(&[(PlanSource::Dram, 6), (PlanSource::Nvme, 16)]);
    let p = plan(&k, &cost, &figs(20.0, Some(0.1), None), &Probing::default());
    assert_eq!(p.keys % 4, 0, "{}", p.note);
    assert_eq!(p.keys, 4);
}

#[test]
fn nothing_available_is_an_empty_plan() {
    let p = plan(&[], &h100(), &Figures::default(), &Probing::default());
    assert_eq!((p.keys, p.reason, p.available), (0, PlanReason::Nothing, 0));
    // Unmeasured DRAM uses the conservative default and is still fetched.
    let k = keys(&[(PlanSource::Dram, 16)]);
    let p = plan(&k, &h100(), &Figures::default(), &Probing::default());
    assert_eq!(p.keys, 16);
    assert!(p.fetch_s >= 16.0 * PAGE as f64 / DRAM_DEFAULT.bytes_per_s);
}

#[test]
fn the_plan_minimises_predicted_ttft_over_every_cut() {
    // Brute force over random prefixes: no cut predicts a lower TTFT than the plan's.
    let mut seed = 7u64;
    let mut rnd = || {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        seed >> 33
    };
    for _ in 0..200 {
        let runs: Vec<(PlanSource, usize)> = (0..=(rnd() % 4))
            .map(|_| {
                let s = [PlanSource::Dram, PlanSource::Nvme][(rnd() % 2) as usize];
                (s, 1 + (rnd() % 40) as usize)
            })
            .collect();
        let k = keys(&runs);
        let f = figs(
            5.0 + (rnd() % 20) as f64,
            Some(0.5 + (rnd() % 80) as f64 / 10.0),
            None,
        );
        let probing = Probing::default();
        let p = plan(&k, &h100(), &f, &probing);
        let m = super::Model {
            f,
            via: ReadPath::Copy,
        };
        let ttft = |n: usize| {
            let mut a = super::Acc::default();
            k[..n].iter().for_each(|x| a.add(*x));
            m.fetch_s(a) * (1.0 + probing.margin) - h100().saved_s(n as u64, k.len() as u64)
        };
        let best = (0..=k.len()).map(ttft).fold(f64::INFINITY, f64::min);
        assert!(ttft(p.keys as usize) <= best + 1e-9, "{runs:?}: {}", p.note);
    }
}
