//! An in-memory device for tests: IPC handles name host buffers, copies run when a fence is
//! waited on, and an optional gate holds fences back so tests can cancel mid-transfer.
//!
//! A daemon built with the test seams runs on this device when `KVNODE_TEST_FAKE_GPU` is set
//! ([`file_hub`]): an IPC handle then names a FILE (its path, NUL-padded to 64 bytes) that
//! stands for the device allocation, so a test in another process (the Python connector's)
//! sees what the daemon's copies wrote; each fence waits the configured delay first, so a
//! layer-wise onload lands layer after layer, observably.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::backend::{Backend, CopyOp, Dir};
use crate::{DeviceWorker, GpuError, GpuHub, WorkerConfig};

/// Environment variable that puts a test-seams daemon on the file-backed fake device; its
/// value is the delay of each fence in microseconds.
pub const FAKE_GPU_ENV: &str = "KVNODE_TEST_FAKE_GPU";

#[derive(Debug, Default)]
struct State {
    allocs: HashMap<[u8; 64], (u64, Vec<u8>)>,
    /// File-backed mode: handles name files; the file of each allocation.
    files: Option<HashMap<u64, File>>,
    fence_delay: Duration,
    open: Vec<u64>,
    closed: Vec<u64>,
    /// `Some(n)`: n more fences may complete; `None`: no gate.
    permits: Option<u32>,
    host_to_device_copies: u64,
    device_to_host_copies: u64,
    /// A wait is held at the gate now.
    blocked: bool,
}

/// Shared view of the fake device (held by the test and by the backend).
#[derive(Debug, Clone, Default)]
pub struct FakeDevice {
    inner: Arc<(Mutex<State>, Condvar)>,
}

impl FakeDevice {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.inner.0.lock().expect("fake device lock")
    }

    /// A device whose handles name files (see the module docs); each fence waits `fence_delay`.
    pub fn over_files(fence_delay: Duration) -> Self {
        let d = Self::default();
        {
            let mut s = d.lock();
            s.files = Some(HashMap::new());
            s.fence_delay = fence_delay;
        }
        d
    }

    /// Allocates `len` bytes filled with `fill`; returns the handle that names them.
    pub fn alloc(&self, len: usize, fill: u8) -> [u8; 64] {
        let mut s = self.lock();
        let n = s.allocs.len() as u64 + 1;
        let mut h = [0u8; 64];
        h[..8].copy_from_slice(&n.to_le_bytes());
        s.allocs.insert(h, (n << 40, vec![fill; len]));
        h
    }

    /// A copy of the allocation's bytes.
    pub fn bytes(&self, h: &[u8; 64]) -> Vec<u8> {
        self.lock().allocs[h].1.clone()
    }

    /// Overwrites the allocation's bytes.
    pub fn write(&self, h: &[u8; 64], f: impl FnOnce(&mut [u8])) {
        f(&mut self.lock().allocs.get_mut(h).expect("alloc").1);
    }

    /// Holds every fence until [`FakeDevice::release`] lets it through.
    pub fn gate(&self) {
        self.lock().permits = Some(0);
    }

    /// Lets `n` more fences complete.
    pub fn release(&self, n: u32) {
        let mut s = self.lock();
        s.permits = Some(s.permits.unwrap_or(0) + n);
        self.inner.1.notify_all();
    }

    /// Removes the gate.
    pub fn ungate(&self) {
        self.lock().permits = None;
        self.inner.1.notify_all();
    }

    /// Host-to-device copies (ops, each of any number of rows) executed so far.
    pub fn host_to_device_copies(&self) -> u64 {
        self.lock().host_to_device_copies
    }

    /// Device-to-host copies (ops) executed so far.
    pub fn device_to_host_copies(&self) -> u64 {
        self.lock().device_to_host_copies
    }

    /// Whether a fence wait is being held at the gate right now.
    pub fn blocked(&self) -> bool {
        self.lock().blocked
    }

    /// Mappings open now, and closed so far.
    pub fn mappings(&self) -> (usize, usize) {
        let s = self.lock();
        (s.open.len(), s.closed.len())
    }
}

/// The backend over a [`FakeDevice`].
#[derive(Debug)]
pub struct FakeBackend {
    dev: FakeDevice,
    queued: Vec<(Dir, CopyOp)>,
    done: usize,
}

impl FakeBackend {
    /// A backend over `dev`.
    pub fn new(dev: FakeDevice) -> Self {
        Self {
            dev,
            queued: Vec::new(),
            done: 0,
        }
    }
}

fn run(s: &mut State, dir: Dir, op: CopyOp) -> Result<(), GpuError> {
    let fail = || GpuError::Cuda {
        call: "fake copy",
        code: 1,
        name: "CUDA_ERROR_INVALID_VALUE".into(),
    };
    if op.rows == 0 || (op.rows > 1 && (op.dev_pitch < op.len || op.host_pitch < op.len)) {
        return Err(fail());
    }
    let last = op.dev + (op.rows - 1) * op.dev_pitch + op.len;
    let (base, bytes) = s
        .allocs
        .values_mut()
        .find(|(base, b)| op.dev >= *base && last <= *base + b.len() as u64)
        .ok_or_else(fail)?;
    let base = *base;
    let file = s.files.as_ref().and_then(|f| f.get(&base));
    let io = |e: std::io::Error| GpuError::Cuda {
        call: "fake file copy",
        code: 1,
        name: e.to_string(),
    };
    for (dev, host) in op.row_addrs() {
        let at = (dev - base) as usize;
        let d = &mut bytes[at..at + op.len as usize];
        // SAFETY: the worker guarantees the host range is valid until this fence is waited on.
        let h = unsafe { std::slice::from_raw_parts_mut(host as *mut u8, op.len as usize) };
        match dir {
            Dir::DeviceToHost => {
                if let Some(f) = file {
                    f.read_exact_at(d, at as u64).map_err(io)?;
                }
                h.copy_from_slice(d);
            }
            Dir::HostToDevice => {
                d.copy_from_slice(h);
                if let Some(f) = file {
                    f.write_all_at(d, at as u64).map_err(io)?;
                }
            }
        }
    }
    match dir {
        Dir::DeviceToHost => s.device_to_host_copies += 1,
        Dir::HostToDevice => s.host_to_device_copies += 1,
    }
    Ok(())
}

impl Backend for FakeBackend {
    type Fence = usize;

    fn open(&mut self, handle: &[u8; 64]) -> Result<(u64, u64), GpuError> {
        let mut s = self.dev.lock();
        if s.files.is_some() && !s.allocs.contains_key(handle) {
            open_file(&mut s, handle)?;
        }
        let Some((base, b)) = s.allocs.get(handle).map(|(a, b)| (*a, b.len() as u64)) else {
            return Err(GpuError::Cuda {
                call: "cuIpcOpenMemHandle",
                code: 1,
                name: "CUDA_ERROR_INVALID_VALUE".into(),
            });
        };
        s.open.push(base);
        Ok((base, b))
    }

    fn close(&mut self, dev: u64) -> Result<(), GpuError> {
        let mut s = self.dev.lock();
        s.open.retain(|&b| b != dev);
        s.closed.push(dev);
        Ok(())
    }

    unsafe fn copy(&mut self, dir: Dir, op: CopyOp) -> Result<(), GpuError> {
        self.queued.push((dir, op));
        Ok(())
    }

    fn fence(&mut self, _dir: Dir) -> Result<usize, GpuError> {
        Ok(self.queued.len())
    }

    fn wait(&mut self, f: usize) -> Result<(), GpuError> {
        let delay = self.dev.lock().fence_delay;
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        let (m, cv) = &*self.dev.inner;
        let mut s = m.lock().expect("fake device lock");
        while s.permits == Some(0) {
            s.blocked = true;
            s = cv.wait(s).expect("fake device lock");
        }
        s.blocked = false;
        if let Some(p) = s.permits.as_mut() {
            *p -= 1;
        }
        while self.done < f {
            let (dir, op) = self.queued[self.done];
            self.done += 1;
            run(&mut s, dir, op)?;
        }
        Ok(())
    }
}

/// File-backed mode: the handle is a NUL-padded path; the file's bytes are the allocation.
fn open_file(s: &mut State, handle: &[u8; 64]) -> Result<(), GpuError> {
    let bad = |why: String| GpuError::Cuda {
        call: "cuIpcOpenMemHandle (fake: file)",
        code: 1,
        name: why,
    };
    let end = handle.iter().position(|&b| b == 0).unwrap_or(64);
    let path = std::str::from_utf8(&handle[..end])
        .map_err(|_| bad("handle is not a UTF-8 path".into()))?;
    let file = File::options()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| bad(format!("{path}: {e}")))?;
    let len = file.metadata().map_err(|e| bad(e.to_string()))?.len();
    let mut bytes = vec![0; len as usize];
    file.read_exact_at(&mut bytes, 0)
        .map_err(|e| bad(e.to_string()))?;
    let base = (s.allocs.len() as u64 + 1) << 40;
    s.allocs.insert(*handle, (base, bytes));
    s.files.get_or_insert_with(HashMap::new).insert(base, file);
    Ok(())
}

/// The daemon's GPU hub over a file-backed fake device (test builds with
/// `KVNODE_TEST_FAKE_GPU`): each fence waits `fence_delay`.
pub fn file_hub(fence_delay: Duration, cfg: WorkerConfig) -> GpuHub {
    let dev = FakeDevice::over_files(fence_delay);
    GpuHub::with_spawner(move |device| {
        let d = dev.clone();
        Ok(DeviceWorker::spawn(device, cfg, move || {
            Ok(FakeBackend::new(d))
        }))
    })
}
