//! A read- or write-rate limit on the disk under a path, for one process: a cgroup with
//! `blkio.throttle.{read,write}_bps_device` (cgroup v1) or `io.max` (cgroup v2). O_DIRECT
//! and io_uring transfers of the process are held to the limit; the cgroup is removed on drop
//! (after the process exited or was moved out).

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// A cgroup holding one process, with rate limits on one disk.
#[derive(Debug)]
pub struct DiskThrottle {
    dir: PathBuf,
    dev: String,
    v2: bool,
}

/// `MAJ:MIN` of the whole disk holding `path` (a partition's parent).
fn disk_of(path: &Path) -> Result<String, String> {
    let dev = std::fs::metadata(path)
        .map_err(|e| format!("stat {}: {e}", path.display()))?
        .dev();
    let (maj, min) = (libc::major(dev), libc::minor(dev));
    let sys = PathBuf::from(format!("/sys/dev/block/{maj}:{min}"));
    if !sys.exists() {
        return Err(format!(
            "{} is on device {maj}:{min}, which is no block device (tmpfs or overlay?)",
            path.display()
        ));
    }
    if sys.join("partition").exists() {
        let parent = std::fs::read_to_string(sys.join("../dev"))
            .map_err(|e| format!("parent of partition {maj}:{min}: {e}"))?;
        return Ok(parent.trim().to_owned());
    }
    Ok(format!("{maj}:{min}"))
}

impl DiskThrottle {
    /// Moves process `pid` into a new cgroup that may limit its reads from the disk under
    /// `path` (no limit yet). `Err` says what is missing.
    pub fn create(pid: u32, path: &Path) -> Result<Self, String> {
        let dev = disk_of(path)?;
        let name = format!("kvnode-e2e-throttle-{}-{pid}", std::process::id());
        let v1 = Path::new("/sys/fs/cgroup/blkio");
        let (dir, v2) = if v1.join("blkio.throttle.read_bps_device").exists() {
            (v1.join(&name), false)
        } else {
            let root = Path::new("/sys/fs/cgroup");
            let ctl = std::fs::read_to_string(root.join("cgroup.controllers")).unwrap_or_default();
            if !ctl.split_whitespace().any(|c| c == "io") {
                return Err("no blkio (cgroup v1) or io (cgroup v2) controller".into());
            }
            std::fs::write(root.join("cgroup.subtree_control"), "+io")
                .map_err(|e| format!("enabling the io controller: {e}"))?;
            (root.join(&name), true)
        };
        std::fs::create_dir(&dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
        let t = Self { dir, dev, v2 };
        std::fs::write(t.dir.join("cgroup.procs"), pid.to_string())
            .map_err(|e| format!("moving pid {pid} into {}: {e}", t.dir.display()))?;
        Ok(t)
    }

    /// Limits reads to `bytes_per_s` (`None`: no limit).
    pub fn set(&self, bytes_per_s: Option<u64>) {
        self.limit("r", bytes_per_s);
    }

    /// Limits writes to `bytes_per_s` (`None`: no limit).
    pub fn set_write(&self, bytes_per_s: Option<u64>) {
        self.limit("w", bytes_per_s);
    }

    fn limit(&self, dir: &str, bytes_per_s: Option<u64>) {
        let (file, line) = if self.v2 {
            let v = bytes_per_s.map_or("max".to_owned(), |b| b.to_string());
            ("io.max", format!("{} {dir}bps={v}", self.dev))
        } else {
            let v = bytes_per_s.unwrap_or(0);
            let file = if dir == "r" {
                "blkio.throttle.read_bps_device"
            } else {
                "blkio.throttle.write_bps_device"
            };
            (file, format!("{} {v}", self.dev))
        };
        std::fs::write(self.dir.join(file), &line)
            .unwrap_or_else(|e| panic!("writing `{line}` to {file}: {e}"));
    }
}

impl Drop for DiskThrottle {
    fn drop(&mut self) {
        // Whatever is left in it goes back to the root cgroup first.
        let root = self
            .dir
            .parent()
            .expect("cgroup parent")
            .join("cgroup.procs");
        if let Ok(pids) = std::fs::read_to_string(self.dir.join("cgroup.procs")) {
            for p in pids.lines() {
                let _ = std::fs::write(&root, p);
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}
