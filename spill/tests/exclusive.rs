//! One spill file, one owner: a directory given twice is refused at build, a second tier on
//! a directory already open is refused while the first lives (the file lock), a failed
//! preallocation leaves no file behind, a file whose start-up died before its superblock is
//! taken over, and foreign or resized files get errors that say what to do.
//! Run: `cargo test --release -p kvnode-spill --test exclusive` (the small-disk case mounts a
//! tmpfs, so it needs root; `KVNODE_TEST_ALLOW_SKIP=root` skips it elsewhere, see README).

mod common;

use common::{TempDir, read_vec, small, write_vec};
use kvnode_spill::{IoEngineKind, ReadOutcome, SpillConfig, SpillError, SpillTier};

#[test]
fn the_same_dir_given_twice_is_refused_naming_both_entries() {
    let d = TempDir::disk();
    // Fresh directory, and again once the file exists.
    for _ in 0..2 {
        let e = small(&d.0, 8 << 20, IoEngineKind::Uring)
            .dir(&d.0, 8 << 20)
            .build()
            .unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("given twice (entries 0 and 1"), "{msg}");
        drop(SpillTier::open(small(&d.0, 8 << 20, IoEngineKind::Uring).build().unwrap()).unwrap());
    }
    // The same directory spelled differently.
    let other = d.0.join("..").join(d.0.file_name().unwrap());
    let e = small(&d.0, 8 << 20, IoEngineKind::Uring)
        .dir(&other, 8 << 20)
        .build()
        .unwrap_err();
    assert!(e.to_string().contains("is the same directory"), "{e}");
}

#[test]
fn a_second_tier_on_an_open_dir_is_refused_until_the_first_closes() {
    let d = TempDir::disk();
    let cfg = || small(&d.0, 8 << 20, IoEngineKind::Uring).build().unwrap();
    let first = SpillTier::open(cfg()).unwrap();
    write_vec(&first, 1, 5000);
    let err = SpillTier::open(cfg()).unwrap_err();
    match &err {
        SpillError::Locked { holder, .. } => assert_eq!(*holder, Some(std::process::id())),
        other => panic!("expected Locked, got {other}"),
    }
    assert!(err.to_string().contains("configured twice"), "{err}");
    // The refused open changed nothing: the first tier still reads its block.
    assert!(matches!(read_vec(&first, 1).0, ReadOutcome::Hit { .. }));
    drop(first);
    let second = SpillTier::open(cfg()).unwrap();
    assert!(matches!(read_vec(&second, 1).0, ReadOutcome::Hit { .. }));
}

#[test]
fn a_file_whose_start_died_before_the_superblock_is_taken_over() {
    let d = TempDir::disk();
    // What an interrupted start leaves: the preallocated size, all zeroes.
    let f = std::fs::File::create(d.file()).unwrap();
    f.set_len(8 << 20).unwrap();
    drop(f);
    let t = SpillTier::open(small(&d.0, 8 << 20, IoEngineKind::Uring).build().unwrap()).unwrap();
    assert!(t.recovery().files[0].fresh);
    write_vec(&t, 1, 5000);
    assert!(matches!(read_vec(&t, 1).0, ReadOutcome::Hit { .. }));
}

#[test]
fn foreign_and_resized_files_are_explained() {
    let d = TempDir::disk();
    drop(SpillTier::open(small(&d.0, 8 << 20, IoEngineKind::Uring).build().unwrap()).unwrap());
    let e =
        SpillTier::open(small(&d.0, 16 << 20, IoEngineKind::Uring).build().unwrap()).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, SpillError::GeometryMismatch { .. }), "{msg}");
    assert!(msg.contains("restore the old --spill-size"), "{msg}");
    assert!(msg.contains("delete the file to start empty"), "{msg}");
    std::fs::write(d.file(), b"somebody else's file").unwrap();
    let e =
        SpillTier::open(small(&d.0, 8 << 20, IoEngineKind::Uring).build().unwrap()).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, SpillError::NotASpillFile { .. }), "{msg}");
    assert!(
        msg.contains("never overwrites a file it did not write"),
        "{msg}"
    );
    assert_eq!(std::fs::read(d.file()).unwrap(), b"somebody else's file");
}

/// A 4 MiB tmpfs mounted on a fresh directory; unmounted on drop.
struct SmallDisk(TempDir);

impl SmallDisk {
    fn mount() -> Option<Self> {
        if !common::require_root("mounting a small tmpfs") {
            return None;
        }
        let d = TempDir::new("/tmp");
        let st = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=4m,mode=0700", "kvnode-test"])
            .arg(&d.0)
            .status()
            .expect("run mount");
        assert!(st.success(), "mount -t tmpfs failed ({st})");
        Some(Self(d))
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0.0).status();
    }
}

#[test]
fn a_failed_preallocation_leaves_no_file_and_the_next_start_works() {
    let Some(disk) = SmallDisk::mount() else {
        return;
    };
    let cfg = |size| {
        SpillConfig::builder()
            .dir(&disk.0.0, size)
            .engine(IoEngineKind::Psync)
            .region_size(1 << 20)
            .max_block_size(256 << 10)
            .build()
            .unwrap()
    };
    let e = SpillTier::open(cfg(16 << 20)).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, SpillError::Preallocate { .. }), "{msg}");
    assert!(msg.contains("lower --spill-size"), "{msg}");
    assert!(
        !disk.0.file().exists(),
        "the partial spill file was left behind"
    );
    let t = SpillTier::open(cfg(3 << 20)).unwrap();
    write_vec(&t, 1, 5000);
    assert!(matches!(read_vec(&t, 1).0, ReadOutcome::Hit { .. }));
}
