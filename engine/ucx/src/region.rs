//! Memory registration (`ucp_mem_map`) and packed remote keys.

use std::fmt;
use std::ptr::null_mut;
use std::sync::Arc;

use crate::context::{Context, Ctx};
use crate::error::{UcxError, check};
use crate::sys;

/// What kind of memory a registration covers.
///
/// Only host memory is built. `Cuda` is the seam for GPUDirect RDMA (a NIC reading GPU
/// memory directly): a UCX built with its CUDA module registers device memory with
/// `ucp_mem_map` and `memory_type = UCS_MEMORY_TYPE_CUDA`, and the daemon would then
/// register each device's KV region next to the DRAM arena and name it in `Block` answers.
/// None of that is built or tested here (no GPU, and Debian's UCX has no CUDA module), so
/// [`Region::map`] refuses it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryKind {
    /// Ordinary (host) memory, such as the daemon's DRAM arena.
    Host,
    /// Device memory of one CUDA device (not built).
    Cuda {
        /// CUDA device ordinal.
        device: i32,
    },
}

/// Who may touch a registration (`ucp_mem_map_params_t::prot`). Without the field UCX
/// registers memory remote-readable **and remote-writable**; kvnode always sets it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Local read and write, remote read only: what a source offers peers (GETs). On verbs
    /// the memory region is registered without `IBV_ACCESS_REMOTE_WRITE`, so the NIC refuses
    /// an RDMA WRITE (PUT) naming its key.
    RemoteRead,
    /// Local read and write only: memory one-sided reads land in; its key is never packed.
    Local,
}

impl Access {
    /// The UCP protection flags.
    pub fn prot(self) -> u32 {
        let local = sys::UCP_MEM_MAP_PROT_LOCAL_READ | sys::UCP_MEM_MAP_PROT_LOCAL_WRITE;
        match self {
            Self::RemoteRead => local | sys::UCP_MEM_MAP_PROT_REMOTE_READ,
            Self::Local => local,
        }
    }
}

/// A remote key packed for another process (`ucp_rkey_pack`). It lets whoever holds it read
/// the whole region it was packed from: send it only over an authenticated connection, and
/// never log it (`Debug` prints its length only).
#[derive(Clone, PartialEq, Eq)]
pub struct PackedRkey(pub Vec<u8>);

impl fmt::Debug for PackedRkey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PackedRkey(<{} bytes>)", self.0.len())
    }
}

/// A registered memory range (`ucp_mem_map` of caller memory). Unmapped on drop, which
/// revokes its remote keys where the transport enforces them (verbs deregisters the MR).
#[derive(Debug)]
pub struct Region {
    ctx: Arc<Ctx>,
    memh: sys::ucp_mem_h,
    base: u64,
    len: usize,
    access: Access,
}

// SAFETY: a memory handle is an immutable description of a registration; UCP accepts it in
// requests on any worker of the (thread-shared) context.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    /// Registers `len` bytes at `base` with `access`.
    ///
    /// # Safety
    /// The memory must stay mapped for the region's life, and remote peers holding its key
    /// may read it until then (where the transport enforces keys and protection: verbs;
    /// UCX's TCP and shared-memory transports enforce neither).
    pub unsafe fn map(
        ctx: &Context,
        base: *mut u8,
        len: usize,
        kind: MemoryKind,
        access: Access,
    ) -> Result<Self, UcxError> {
        if let MemoryKind::Cuda { device } = kind {
            return Err(UcxError::Invalid(format!(
                "registering CUDA memory (device {device}) with UCX is not built: GPUDirect RDMA is a seam only"
            )));
        }
        if len == 0 {
            return Err(UcxError::Invalid("cannot register 0 bytes".into()));
        }
        let params = sys::ucp_mem_map_params_t {
            field_mask: u64::from(
                sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                    | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                    | sys::UCP_MEM_MAP_PARAM_FIELD_PROT,
            ),
            address: base.cast(),
            length: len,
            prot: access.prot(),
            ..Default::default()
        };
        let mut memh: sys::ucp_mem_h = null_mut();
        // SAFETY: the caller vouches for the range; out-pointer to a local.
        check("ucp_mem_map", unsafe {
            sys::ucp_mem_map(ctx.ctx.0, &raw const params, &raw mut memh)
        })?;
        Ok(Self {
            ctx: Arc::clone(&ctx.ctx),
            memh,
            base: base as u64,
            len,
            access,
        })
    }

    /// The access it was registered with.
    pub fn access(&self) -> Access {
        self.access
    }

    /// The first registered address.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// Registered bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true (zero-length registrations are refused).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `[addr, addr + len)` lies inside the registration.
    pub fn contains(&self, addr: u64, len: usize) -> bool {
        addr >= self.base
            && addr
                .checked_add(len as u64)
                .is_some_and(|end| end <= self.base + self.len as u64)
    }

    /// A key other processes unpack to read this region (`ucp_rkey_pack`). Refused for a
    /// [`Access::Local`] region.
    pub fn pack_rkey(&self) -> Result<PackedRkey, UcxError> {
        if self.access == Access::Local {
            return Err(UcxError::Invalid(
                "a local-only registration has no remote key".into(),
            ));
        }
        let mut buf: *mut std::ffi::c_void = null_mut();
        let mut len = 0usize;
        // SAFETY: out-pointers to locals; memh is live.
        check("ucp_rkey_pack", unsafe {
            sys::ucp_rkey_pack(self.ctx.0, self.memh, &raw mut buf, &raw mut len)
        })?;
        // SAFETY: UCP returned `len` bytes at `buf`, released right after the copy.
        let v = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len) }.to_vec();
        // SAFETY: buf came from ucp_rkey_pack.
        unsafe { sys::ucp_rkey_buffer_release(buf) };
        Ok(PackedRkey(v))
    }

    pub(crate) fn memh(&self) -> sys::ucp_mem_h {
        self.memh
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: mapped by us, unmapped once; the context outlives it (Arc).
        let st = unsafe { sys::ucp_mem_unmap(self.ctx.0, self.memh) };
        if let Err(e) = check("ucp_mem_unmap", st) {
            eprintln!("kvnode-ucx: {e}");
        }
    }
}
