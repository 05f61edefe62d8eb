//! The client's mapping of the daemon's arena.
//!
//! The mapping is a `memmap2::MmapRaw` (`MAP_SHARED`, read-write, of the memfd the daemon
//! passed): memmap2 covers every flag this mapping needs, and a raw map (pointer, no slice)
//! because the daemon and other clients write the same pages, which no `&[u8]` over the whole
//! arena could describe. The daemon seals its arena memfd against resizing (`F_SEAL_SHRINK`),
//! so no page of this mapping can go away and no SIGBUS guard is needed here (the daemon
//! guards the client memfds it maps: kvnode-shmguard).

use std::cell::Cell;
use std::marker::PhantomData;
use std::os::fd::{AsRawFd, OwnedFd};

use kvnode_proto::client::Extent;
use memmap2::{MmapOptions, MmapRaw};

/// A shared, read-write mapping of the daemon's arena memfd, or none (a tenant without the
/// arena mapping: `arena_bytes` 0 and no descriptor; every extent is outside it).
#[derive(Debug)]
pub struct ArenaMap {
    map: Option<MmapRaw>,
    len: u64,
    _fd: Option<OwnedFd>,
    /// Send but not Sync (as before memmap2): `write` hands out `&mut` slices from `&self`, so
    /// one thread at a time drives a mapping.
    _not_sync: PhantomData<Cell<()>>,
}

impl ArenaMap {
    pub(crate) fn map(fd: &OwnedFd, len: u64) -> std::io::Result<Self> {
        let bytes = usize::try_from(len).map_err(|_| std::io::ErrorKind::InvalidInput)?;
        let map = MmapOptions::new().len(bytes).map_raw(fd.as_raw_fd())?;
        Ok(Self {
            map: Some(map),
            len,
            _fd: Some(fd.try_clone()?),
            _not_sync: PhantomData,
        })
    }

    /// No mapping: the daemon withholds the arena from this client's tenant.
    pub(crate) fn none() -> Self {
        Self {
            map: None,
            len: 0,
            _fd: None,
            _not_sync: PhantomData,
        }
    }

    fn raw(&self) -> &MmapRaw {
        self.map
            .as_ref()
            .expect("an extent inside the arena implies a mapping")
    }

    /// Arena size.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the mapping is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check(&self, e: Extent) {
        assert!(
            e.offset
                .checked_add(e.len)
                .is_some_and(|end| end <= self.len),
            "extent {e:?} outside the arena"
        );
    }

    /// The bytes of a leased extent. Valid until the lease is released.
    pub fn read(&self, e: Extent) -> &[u8] {
        self.check(e);
        // SAFETY: in bounds; a leased block is immutable until released.
        unsafe {
            std::slice::from_raw_parts(self.raw().as_ptr().add(e.offset as usize), e.len as usize)
        }
    }

    /// The bytes of a granted (reserved) extent, to fill before commit.
    #[expect(
        clippy::mut_from_ref,
        reason = "the arena is shared memory; exclusivity comes from the reservation"
    )]
    pub fn write(&self, e: Extent) -> &mut [u8] {
        self.check(e);
        // SAFETY: in bounds; a reserved slot belongs to this connection until commit/abort.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.raw().as_mut_ptr().add(e.offset as usize),
                e.len as usize,
            )
        }
    }
}

impl ArenaMap {
    /// Registers this mapping with CUDA in the calling thread's current context (device 0's
    /// primary context if none is current), page-locked and portable, in `piece`-byte pieces
    /// (use the daemon's `gpu.register_piece_bytes` so no slot straddles two pieces). GPU copies
    /// to and from arena extents then run at pinned speed. Unregistered when the value drops;
    /// keep it alive no longer than this mapping.
    pub fn register_cuda(
        &self,
        piece: u64,
    ) -> Result<kvnode_gpu::register::HostRegistration, kvnode_gpu::GpuError> {
        let stop = std::sync::atomic::AtomicBool::new(false);
        let Some(map) = &self.map else {
            return Err(kvnode_gpu::GpuError::NoArenaMapping);
        };
        // SAFETY: the range is this mapping; the caller drops the registration before it.
        unsafe {
            kvnode_gpu::register::HostRegistration::register(
                map.as_mut_ptr(),
                self.len,
                piece,
                &stop,
                |_| {},
            )
        }
        .map_err(|(_, e)| e)
    }
}
