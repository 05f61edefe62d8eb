//! Buffer descriptions an operation owns while in flight and hands back with its result.

use crate::error::SpillError;
use crate::format::SECTOR;
use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

/// A heap buffer aligned to 4096 bytes (`O_DIRECT`-ready), zero-initialised, with a length
/// that may be less than its capacity (a whole number of sectors).
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    cap: usize,
    len: usize,
}

// SAFETY: AlignedBuf uniquely owns its allocation, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only reads.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zero bytes; the capacity is `len` rounded up to 4096 (at least 4096).
    pub fn zeroed(len: usize) -> Self {
        let cap = (len.max(1)).div_ceil(SECTOR as usize) * SECTOR as usize;
        let layout = Layout::from_size_align(cap, SECTOR as usize).expect("layout");
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self { ptr, cap, len }
    }

    /// Copies `data` into a new aligned buffer.
    pub fn from_slice(data: &[u8]) -> Self {
        let mut b = Self::zeroed(data.len());
        b.copy_from_slice(data);
        b
    }

    /// Allocated bytes (a multiple of 4096).
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Sets the visible length; bytes beyond the old length keep their previous contents
    /// (zero or earlier data), so they are always initialised.
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.cap, "AlignedBuf::set_len beyond capacity");
        self.len = len;
    }

    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        let layout = Layout::from_size_align(self.cap, SECTOR as usize).expect("layout");
        // SAFETY: allocated in `zeroed` with the same layout.
        unsafe { dealloc(self.ptr.as_ptr(), layout) };
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is valid for cap >= len initialised bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for cap >= len initialised bytes and uniquely owned.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("cap", &self.cap)
            .finish_non_exhaustive()
    }
}

/// A range of the arena registered with [`crate::SpillTier::register_arena`].
///
/// Ranges inside one 1 GiB registration piece use `READ_FIXED/WRITE_FIXED`; a range that
/// straddles two pieces still goes straight to the device, just without the fixed-buffer fast
/// path. Keep blocks 4096-aligned and sized in whole sectors to avoid the bounce buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArenaSlice {
    /// Byte offset from the arena start.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

/// Memory the engine owns outside the arena (e.g. a client's memfd mapping).
#[derive(Debug)]
pub struct RawBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the creator of a RawBuf promised exclusive access for the operation's duration.
unsafe impl Send for RawBuf {}

impl RawBuf {
    /// Describes `len` bytes at `ptr`.
    ///
    /// # Safety
    /// The memory must stay valid until the operation using this buffer has completed and
    /// handed it back; during a write nobody may modify it, during a read nobody may access it.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        Self { ptr, len }
    }

    /// Start of the memory.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// The source of a write or the destination of a read.
///
/// For reads, `Vec` and `Aligned` buffers are resized to the block's length on a hit; `Arena`
/// and `Raw` keep their length and the hit reports how many leading bytes were filled.
#[derive(Debug)]
#[non_exhaustive]
pub enum IoBuf {
    /// A slice of the registered arena (zero-copy, fixed buffers).
    Arena(ArenaSlice),
    /// An aligned heap buffer (zero-copy, not a fixed buffer).
    Aligned(AlignedBuf),
    /// A plain heap buffer (bounced through an aligned buffer under `O_DIRECT`).
    Vec(Vec<u8>),
    /// Foreign memory (zero-copy when 4096-aligned, else bounced).
    Raw(RawBuf),
}

/// Where an operation's bytes live, resolved against the arena on the worker thread.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Mem {
    pub ptr: *mut u8,
    /// Usable bytes (capacity for reads).
    pub len: usize,
    /// Fixed-buffer index when the whole range lies in one registered piece.
    pub fixed: Option<u16>,
}

impl IoBuf {
    /// Bytes this buffer provides as a write source.
    pub fn len(&self) -> usize {
        match self {
            IoBuf::Arena(s) => s.len,
            IoBuf::Aligned(b) => b.len(),
            IoBuf::Vec(v) => v.len(),
            IoBuf::Raw(r) => r.len,
        }
    }

    /// True when the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Resolves the memory this buffer describes; for reads, grows owned buffers to `want`.
    pub(crate) fn region(
        &mut self,
        arena: &Arena,
        want_for_read: Option<usize>,
    ) -> Result<Mem, SpillError> {
        match self {
            IoBuf::Arena(s) => arena.resolve(*s),
            IoBuf::Aligned(b) => {
                if let Some(want) = want_for_read {
                    if want > b.capacity() {
                        *b = AlignedBuf::zeroed(want);
                    }
                    b.set_len(b.capacity());
                }
                Ok(Mem {
                    ptr: b.as_mut_ptr(),
                    len: b.len(),
                    fixed: None,
                })
            }
            IoBuf::Vec(v) => {
                if let Some(want) = want_for_read {
                    v.resize(want, 0);
                }
                Ok(Mem {
                    ptr: v.as_mut_ptr(),
                    len: v.len(),
                    fixed: None,
                })
            }
            IoBuf::Raw(r) => Ok(Mem {
                ptr: r.ptr,
                len: r.len,
                fixed: None,
            }),
        }
    }

    /// After a read hit of `len` bytes, trims owned buffers to the block length.
    pub(crate) fn trim_after_read(&mut self, len: usize) {
        match self {
            IoBuf::Aligned(b) => b.set_len(len),
            IoBuf::Vec(v) => v.truncate(len),
            IoBuf::Arena(_) | IoBuf::Raw(_) => {}
        }
    }
}

/// Largest fixed-buffer registration (the kernel caps one registered buffer at 1 GiB).
pub const ARENA_PIECE: usize = 1 << 30;

/// The engine's registered arena as seen by one IO worker.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Arena {
    pub base: usize,
    pub len: usize,
    /// The pieces are registered with the ring as fixed buffers (else plain reads/writes).
    pub registered: bool,
}

impl Arena {
    pub fn resolve(&self, s: ArenaSlice) -> Result<Mem, SpillError> {
        let end = s.offset.checked_add(s.len);
        if self.len == 0 || end.is_none_or(|e| e > self.len) {
            return Err(SpillError::ArenaRange {
                offset: s.offset,
                len: s.len,
                arena_len: self.len,
            });
        }
        let first = s.offset / ARENA_PIECE;
        let last = (s.offset + s.len.max(1) - 1) / ARENA_PIECE;
        let fixed = (self.registered && first == last).then_some(first as u16);
        Ok(Mem {
            ptr: (self.base + s.offset) as *mut u8,
            len: s.len,
            fixed,
        })
    }

    /// The iovecs to register as fixed buffers, one per 1 GiB piece.
    pub fn pieces(&self) -> Vec<libc::iovec> {
        (0..self.len.div_ceil(ARENA_PIECE))
            .map(|i| libc::iovec {
                iov_base: (self.base + i * ARENA_PIECE) as *mut libc::c_void,
                iov_len: (self.len - i * ARENA_PIECE).min(ARENA_PIECE),
            })
            .collect()
    }
}

/// A finished operation: the buffer it owned and what happened.
#[derive(Debug)]
pub struct Done<T> {
    /// The buffer the operation was given, handed back.
    pub buf: IoBuf,
    /// The outcome.
    pub result: Result<T, SpillError>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attached_but_unregistered_arena_uses_plain_transfers() {
        let a = Arena {
            base: 1 << 40,
            len: ARENA_PIECE,
            registered: false,
        };
        let r = a
            .resolve(ArenaSlice {
                offset: 4096,
                len: 4096,
            })
            .unwrap();
        assert_eq!(r.fixed, None);
    }

    #[test]
    fn arena_slices_inside_one_piece_use_fixed_buffers() {
        let a = Arena {
            base: 1 << 40,
            len: 3 * ARENA_PIECE,
            registered: true,
        };
        let r = a
            .resolve(ArenaSlice {
                offset: ARENA_PIECE + 4096,
                len: 1 << 20,
            })
            .unwrap();
        assert_eq!(r.fixed, Some(1));
        let r = a
            .resolve(ArenaSlice {
                offset: ARENA_PIECE - 4096,
                len: 8192,
            })
            .unwrap();
        assert_eq!(r.fixed, None);
        assert!(
            a.resolve(ArenaSlice {
                offset: 3 * ARENA_PIECE - 1,
                len: 2
            })
            .is_err()
        );
        assert_eq!(a.pieces().len(), 3);
    }

    #[test]
    fn aligned_buffers_are_sector_aligned_and_rounded() {
        let b = AlignedBuf::zeroed(5000);
        assert_eq!(b.capacity(), 8192);
        assert_eq!(b.len(), 5000);
        assert_eq!(b.as_ptr() as usize % 4096, 0);
    }
}
