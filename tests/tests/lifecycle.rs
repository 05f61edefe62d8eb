//! Daemon lifecycle: zero-config start, config precedence, fast start with a 16 GiB tier,
//! SIGTERM/SIGINT drain with exit 0, socket ownership. Run: `cargo test --release -p kvnode-e2e`.

use std::process::Command;
use std::time::{Duration, Instant};

use kvnode_e2e::{Daemon, block, key, kvnode_bin, kvnode_cmd, spec, temp_dir};

#[test]
fn sixteen_gib_tier_answers_stats_within_one_second() {
    let t = Instant::now();
    let d = Daemon::start(&["--dram", "16GiB"]);
    let mut c = d.client();
    let s = c.stats().unwrap();
    let elapsed = t.elapsed();
    assert_eq!(s.tiers[0].capacity_bytes, 16 << 30);
    assert!(
        elapsed < Duration::from_secs(1),
        "first stats after {elapsed:?}"
    );
    eprintln!("16GiB tier: first stats answered {elapsed:?} after spawn");
    // Population proceeds in the background and is visible.
    let t2 = Instant::now();
    while c.stats().unwrap().tiers[0].populated_bytes == 0 && t2.elapsed() < Duration::from_secs(5)
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(c.stats().unwrap().tiers[0].populated_bytes > 0);
}

#[test]
fn sigterm_and_sigint_drain_and_exit_zero() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let mut d = Daemon::start(&["--dram", "32MiB"]);
        let mut c = d.client();
        let ns = c.register(&spec("m", 4096)).unwrap().ns;
        c.put(ns, &[key(1)], &[&block(1, 4096)]).unwrap();
        d.signal(sig);
        let status = d
            .wait_exit(Duration::from_secs(10))
            .expect("daemon did not exit");
        assert_eq!(status.code(), Some(0), "log:\n{}", d.log());
        assert!(d.log().contains("kvnode stopped"));
        assert!(!d.socket().exists(), "socket file left behind");
    }
}

#[test]
fn config_file_is_overridden_by_flags_and_printed() {
    let dir = temp_dir("cfg");
    let cfg = dir.join("kvnode.toml");
    std::fs::write(
        &cfg,
        "dram = \"64MiB\"\neviction = \"s3fifo\"\nslab_size = 4194304\n",
    )
    .unwrap();
    let out = kvnode_cmd()
        .args(["serve", "--print-config", "--config"])
        .arg(&cfg)
        .args(["--dram", "128MiB", "--socket", "/tmp/x.sock"])
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success());
    assert!(text.contains("dram = \"128MiB\""), "{text}");
    assert!(text.contains("eviction = \"s3fifo\""), "{text}");
    assert!(text.contains("slab_size = \"4MiB\""), "{text}");
    assert!(text.contains("socket = \"/tmp/x.sock\""), "{text}");
    // Unknown keys and bad sizes are refused with the reason.
    std::fs::write(&cfg, "dram = \"lots\"\n").unwrap();
    let out = kvnode_cmd()
        .args(["serve", "--print-config", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid size"));
    std::fs::write(&cfg, "drm = \"1GiB\"\n").unwrap();
    let out = kvnode_cmd()
        .args(["serve", "--print-config", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown field"));
    // Zero configuration works: defaults print without any file.
    let out = kvnode_cmd()
        .args(["serve", "--print-config"])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("kvnode/kvnode.sock"));
}

#[test]
fn second_daemon_on_a_live_socket_is_refused_and_stale_socket_is_replaced() {
    let d = Daemon::start(&["--dram", "16MiB"]);
    let out = kvnode_cmd()
        .args(["serve", "--dram", "16MiB", "--socket"])
        .arg(d.socket())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("already listening"));
    d.client().stats().unwrap();
    // A socket file nobody listens on is replaced.
    let dir = temp_dir("stale");
    let stale = dir.join("s.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    let mut child = kvnode_cmd()
        .args(["serve", "--dram", "16MiB", "--socket"])
        .arg(&stale)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while kvnode_client::Client::connect(&stale).is_err() {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "daemon did not replace the stale socket"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap();
    child.wait().unwrap();
}

#[test]
fn cli_put_get_exists_by_tokens_round_trip() {
    let d = Daemon::start(&["--dram", "32MiB"]);
    let sock = d.socket().to_str().unwrap().to_owned();
    let toks: Vec<String> = (1..=200).map(|t| t.to_string()).collect();
    let toks = toks.join(",");
    let run = |args: &[&str]| {
        let out = Command::new(kvnode_bin())
            .args(args)
            .args(["--socket", &sock])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let ns = [
        "--model",
        "qwen",
        "--page-size",
        "64",
        "--page-bytes",
        "4KiB",
    ];
    let put = run(&[&["put", "--tokens", &toks, "--seed", "42"][..], &ns[..]].concat());
    assert!(put.contains("stored 3 of 3"), "{put}");
    let dir = temp_dir("cli");
    let out = dir.join("o.bin");
    let get = run(&[
        &["get", "--tokens", &toks, "--out", out.to_str().unwrap()][..],
        &ns[..],
    ]
    .concat());
    assert!(get.contains("3 of 3 leading pages hit"), "{get}");
    let bytes = std::fs::read(&out).unwrap();
    assert_eq!(bytes.len(), 3 * 4096);
    // The same pages under another model are misses; one more page is a partial hit.
    let other = run(&[
        "exists",
        "--tokens",
        &toks,
        "--model",
        "llama",
        "--page-size",
        "64",
        "--page-bytes",
        "4KiB",
    ]);
    assert!(other.contains("0 of 3"), "{other}");
    let longer: Vec<String> = (1..=300).map(|t| t.to_string()).collect();
    let ex = run(&[&["exists", "--tokens", &longer.join(",")][..], &ns[..]].concat());
    assert!(ex.contains("3 of 4"), "{ex}");
    // A file round trip.
    let src = dir.join("in.bin");
    std::fs::write(&src, block(9, 2 * 4096)).unwrap();
    let two: Vec<String> = (1000..1128).map(|t| t.to_string()).collect();
    run(&[
        &[
            "put",
            "--tokens",
            &two.join(","),
            "--file",
            src.to_str().unwrap(),
        ][..],
        &ns[..],
    ]
    .concat());
    run(&[
        &[
            "get",
            "--zero-copy",
            "--tokens",
            &two.join(","),
            "--out",
            out.to_str().unwrap(),
        ][..],
        &ns[..],
    ]
    .concat());
    assert_eq!(std::fs::read(&out).unwrap(), block(9, 2 * 4096));
    let cleared = run(&[&["clear"][..], &ns[..]].concat());
    assert!(cleared.contains("cleared 5 blocks"), "{cleared}");
}
