//! An in-memory device for tests: IPC handles name host buffers, copies run when a fence is
//! waited on, and an optional gate holds fences back so tests can cancel mid-transfer.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};

use crate::GpuError;
use crate::backend::{Backend, CopyOp, Dir};

#[derive(Debug, Default)]
struct State {
    allocs: HashMap<[u8; 64], (u64, Vec<u8>)>,
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
    if op.rows == 0 || (op.rows > 1 && op.dev_pitch < op.len) {
        return Err(fail());
    }
    let last = op.dev + (op.rows - 1) * op.dev_pitch + op.len;
    let (base, bytes) = s
        .allocs
        .values_mut()
        .find(|(base, b)| op.dev >= *base && last <= *base + b.len() as u64)
        .ok_or_else(fail)?;
    let base = *base;
    for (dev, host) in op.row_addrs() {
        let at = (dev - base) as usize;
        let d = &mut bytes[at..at + op.len as usize];
        // SAFETY: the worker guarantees the host range is valid until this fence is waited on.
        let h = unsafe { std::slice::from_raw_parts_mut(host as *mut u8, op.len as usize) };
        match dir {
            Dir::DeviceToHost => h.copy_from_slice(d),
            Dir::HostToDevice => d.copy_from_slice(h),
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
