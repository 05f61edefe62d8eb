//! Attacks on the spill files by other local users (issue 25 item 2). Pins: under umask 022
//! (as under systemd) the daemon creates its spill directory 0700 and `kvnode-spill.dat`
//! 0600, so another uid cannot read a demoted block; an existing spill file of ours that
//! others may read is tightened to 0600 with a loud warning; a spill directory others may
//! write, a spill file owned by another uid and a symlink in place of the file are refused
//! at start-up with a message that says why.
//! Run (as root): `cargo test --release -p kvnode-e2e --test attack_spill`.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use kvnode_e2e::{Daemon, key, kvnode_bin, not_root, prerequisite, spec, spill_dir};

const OTHER_UID: u32 = 64003;
const LEN: usize = 256 << 10;

fn mode(p: &Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
}

/// `kvnode serve` on a 16 MiB DRAM tier spilling into `dir`, with umask 022.
fn spilling_under_umask_022(dir: &Path) -> Daemon {
    let mut cmd = Command::new(kvnode_bin());
    // SAFETY: umask is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::umask(0o022);
            Ok(())
        });
    }
    Daemon::spawn(
        cmd,
        &[
            "--dram",
            "16MiB",
            "--slab-size",
            "2MiB",
            "--no-pin",
            "--spill-dir",
            dir.to_str().unwrap(),
            "--spill-size",
            "64MiB",
        ],
    )
}

/// Puts 128 blocks of 256 KiB (32 MiB) into a 16 MiB tier, so that half are demoted.
fn fill(d: &Daemon) {
    let mut c = d.client();
    let ns = c.register(&spec("spill-perms", LEN as u64)).unwrap().ns;
    for i in 0..128u64 {
        let b = vec![i as u8; LEN];
        let r = c.put(ns, &[key(i)], &[&b]).unwrap();
        assert_eq!(r.len(), 1);
    }
}

fn other_uid_can_read(p: &Path) -> bool {
    Command::new("head")
        .args(["-c", "4096"])
        .arg(p)
        .uid(OTHER_UID)
        .gid(OTHER_UID)
        .output()
        .expect("run head as another uid")
        .status
        .success()
}

fn can_switch_uids() -> bool {
    prerequisite(
        "root",
        not_root("the attack reads the spill file as uid 64003"),
    )
}

#[test]
fn spill_dir_and_file_are_private_under_umask_022() {
    if !can_switch_uids() {
        return;
    }
    let root = spill_dir("perms-new");
    // Let the other uid reach the directory (as /var/lib would), so only our modes stop it.
    std::fs::set_permissions(&*root, std::fs::Permissions::from_mode(0o755)).unwrap();
    let dir = root.join("spill");
    let d = spilling_under_umask_022(&dir);
    fill(&d);
    let file = dir.join("kvnode-spill.dat");
    assert_eq!(mode(&dir), 0o700, "spill dir mode");
    assert_eq!(mode(&file), 0o600, "spill file mode");
    assert!(
        !other_uid_can_read(&file),
        "uid {OTHER_UID} read the spill file"
    );
}

#[test]
fn a_world_readable_spill_file_is_made_private_with_a_loud_warning() {
    if !can_switch_uids() {
        return;
    }
    let root = spill_dir("perms-old");
    std::fs::set_permissions(&*root, std::fs::Permissions::from_mode(0o755)).unwrap();
    let file = root.join("kvnode-spill.dat");
    {
        let d = spilling_under_umask_022(&root);
        fill(&d);
    }
    // An older kvnode (or a copy) left the file 0644 and the directory 0755.
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert!(
        other_uid_can_read(&file),
        "the attack setup must be readable"
    );
    let d = spilling_under_umask_022(&root);
    assert_eq!(mode(&file), 0o600, "spill file mode after start");
    assert!(!other_uid_can_read(&file));
    let log = d.log();
    assert!(log.contains("SPILL FILE WAS READABLE"), "{log}");
    assert!(log.contains("SPILL DIRECTORY IS READABLE"), "{log}");
}

#[test]
fn a_spill_dir_others_can_write_is_refused() {
    let root = spill_dir("perms-writable");
    std::fs::set_permissions(&*root, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let (status, log) = Daemon::start_failing(
        &[
            "--dram",
            "16MiB",
            "--no-pin",
            "--spill-dir",
            root.to_str().unwrap(),
            "--spill-size",
            "64MiB",
        ],
        Duration::from_secs(10),
    );
    assert!(!status.success());
    assert!(log.contains("other users may create"), "{log}");
    assert!(!root.join("kvnode-spill.dat").exists(), "nothing created");
}

#[test]
fn a_planted_spill_file_or_symlink_is_refused() {
    if !can_switch_uids() {
        return;
    }
    let args = |dir: &Path| {
        vec![
            "--dram".to_owned(),
            "16MiB".into(),
            "--no-pin".into(),
            "--spill-dir".into(),
            dir.to_str().unwrap().to_owned(),
            "--spill-size".into(),
            "64MiB".into(),
        ]
    };
    // Another uid's empty file (it could read whatever kvnode wrote into it).
    let root = spill_dir("perms-planted");
    let file = root.join("kvnode-spill.dat");
    std::fs::write(&file, b"").unwrap();
    std::os::unix::fs::chown(&file, Some(OTHER_UID), Some(OTHER_UID)).unwrap();
    let a = args(&root);
    let (status, log) = Daemon::start_failing(
        &a.iter().map(String::as_str).collect::<Vec<_>>(),
        Duration::from_secs(10),
    );
    assert!(!status.success());
    assert!(
        log.contains(&format!("belongs to uid {OTHER_UID}")),
        "{log}"
    );
    assert_eq!(std::fs::metadata(&file).unwrap().len(), 0, "file untouched");

    // A symlink to a file the attacker can read.
    let root = spill_dir("perms-symlink");
    let target = root.join("bait");
    std::fs::write(&target, b"").unwrap();
    std::os::unix::fs::symlink(&target, root.join("kvnode-spill.dat")).unwrap();
    let a = args(&root);
    let (status, log) = Daemon::start_failing(
        &a.iter().map(String::as_str).collect::<Vec<_>>(),
        Duration::from_secs(10),
    );
    assert!(!status.success());
    assert!(log.contains("symbolic link"), "{log}");
    assert_eq!(std::fs::metadata(&target).unwrap().len(), 0);
    assert_eq!(std::fs::metadata(&target).unwrap().uid(), 0);
}
