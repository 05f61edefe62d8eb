//! GPU path wire types: CUDA IPC handles, the page layout of an exported KV buffer, and its arithmetic.
//!
//! An engine exports one GPU allocation (a CUDA IPC handle) and describes where its KV
//! pages are. Page `p`'s block is the concatenation, in order, of its objects:
//!
//! ```text
//! object j of page p = device bytes [base + p * page_stride + objects[j].offset, .. + objects[j].size)
//! block bytes        = object 0 ‖ object 1 ‖ … (page_bytes = Σ size)
//! ```
//!
//! One object per page is the `page_first` layout; one object per layer (offset = layer
//! stride) describes a `layer_first` buffer. Every extent must lie inside the `len` bytes
//! the client declares, and `len` inside the allocation the handle names.

use serde::{Deserialize, Serialize};

/// Bytes of a CUDA IPC memory handle (`CUipcMemHandle`, `cudaIpcMemHandle_t`).
pub const IPC_HANDLE_LEN: usize = 64;
/// Alignment required of `base`, `page_stride` and every object offset and size. DMA engines
/// run at full rate on 16-byte aligned transfers, and every KV dtype's rows are 16-byte multiples.
pub const GPU_ALIGN: u64 = 16;
/// Most objects (gathered extents) per page.
pub const MAX_OBJECTS: usize = 4096;
/// Most layers of a layer-wise onload ([`PageMove::layers`]).
pub const MAX_LAYERS: u32 = 4096;

/// One contiguous part of a page in GPU memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuObject {
    /// Offset from the page's start (`base + p * page_stride`).
    pub offset: u64,
    /// Bytes.
    pub size: u64,
}

/// Where the pages of an exported buffer are.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuLayout {
    /// Byte offset of page 0 from the start of the IPC allocation (torch's storage offset).
    pub base: u64,
    /// Bytes between the starts of consecutive pages.
    pub page_stride: u64,
    /// Number of pages; valid page ids are `0..pages`.
    pub pages: u64,
    /// The parts of each page, in block order.
    pub objects: Vec<GpuObject>,
}

/// A page's objects as one strided run (see [`GpuLayout::strided`]): row `r` is the device bytes
/// `[page_start + offset + r * pitch, + width)` and block bytes `[r * width, + width)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Strided {
    /// Offset of the first object from the page's start.
    pub offset: u64,
    /// Bytes of each object.
    pub width: u64,
    /// Objects.
    pub rows: u64,
    /// Device bytes from one object's start to the next (≥ `width`; equal: contiguous).
    pub pitch: u64,
}

/// `AttachGpu`: map an exported GPU buffer into the daemon.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachGpu {
    /// The raw CUDA IPC memory handle ([`IPC_HANDLE_LEN`] bytes).
    pub handle: serde_bytes::ByteBuf,
    /// CUDA device ordinal as the daemon sees it (same `CUDA_VISIBLE_DEVICES` as the engine).
    pub device: u32,
    /// Bytes of the allocation the client vouches for (from offset 0 of the handle).
    pub len: u64,
    /// Page layout.
    pub layout: GpuLayout,
}

/// `Offload` / `Onload` / `OnloadAsync`: move pages between an attached buffer and the DRAM tier.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageMove {
    /// Namespace handle.
    pub ns: u32,
    /// One key per page.
    pub keys: Vec<crate::Key>,
    /// GPU page ids, parallel to `keys`.
    pub page_ids: Vec<u64>,
    /// Buffer id from `GpuAttached` (default 0: the first attached buffer).
    #[serde(default)]
    pub buffer: u32,
    /// Onloads only: copy layer by layer instead of page by page. Each page's block is `layers`
    /// equal runs in model order (layer `l` = block bytes `[l*B/layers, (l+1)*B/layers)`); the
    /// daemon copies every page's layer 0, then every page's layer 1, …, and `OnloadLayerWait`
    /// reports each layer as it lands. 0 (the default) = page by page.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub layers: u32,
    /// Onloads only: a router hint (the JSON of a hinted `Get`). Keys this node lacks are
    /// pulled from the hinted peer, and each page is copied into the GPU as soon as its block
    /// has landed verified, while later blocks are still on the wire. Page by page only
    /// (`layers` 0). The reply's `pull` reports the pull.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
    /// With `hint`: the pull's deadline (default: the declared timeout for the keys to pull).
    /// Pages not landed by then are not onloaded; their blocks still land in the DRAM tier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_ms: Option<u64>,
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if passes a reference
fn is_zero(v: &u32) -> bool {
    *v == 0
}

/// Outcome of one key of an onload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum OnloadStatus {
    /// The block's bytes are in the GPU page.
    Loaded,
    /// Not in the DRAM tier.
    Miss,
    /// The block's length differs from the layout's page bytes; nothing was written.
    SizeMismatch,
    /// Cancelled before its copy was issued; nothing was written to the page.
    Cancelled,
}

/// GPU section of the statistics report.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct GpuStats {
    /// `ready`, `no CUDA driver`, or the initialisation error.
    pub driver: String,
    /// Arena bytes registered with CUDA (page-locked for DMA).
    pub registered_bytes: u64,
    /// Size of each registration piece (whole slabs, at most 4 GiB); clients registering their
    /// own mapping should use the same boundaries.
    pub register_piece_bytes: u64,
    /// Buffers attached over all connections.
    pub attached: u64,
    /// Bytes copied GPU -> arena.
    pub offload_bytes: u64,
    /// Bytes copied arena -> GPU.
    pub onload_bytes: u64,
}

/// A layout or handle the daemon refuses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    /// Handle is not 64 bytes.
    #[error(
        "CUDA IPC handle must be {IPC_HANDLE_LEN} bytes, got {0} (send cudaIpcMemHandle_t verbatim)"
    )]
    HandleLength(usize),
    /// Handle is all zeroes.
    #[error("CUDA IPC handle is all zeroes: export it with cuIpcGetMemHandle / torch _share_cuda_")]
    HandleZero,
    /// No pages or no objects.
    #[error("layout has no pages or no objects")]
    Empty,
    /// Too many objects.
    #[error("layout has {0} objects per page; at most {MAX_OBJECTS}")]
    TooManyObjects(usize),
    /// An object has size 0.
    #[error("object {0} has size 0")]
    ZeroObject(usize),
    /// A value is not a multiple of [`GPU_ALIGN`].
    #[error("{what} = {value} is not a multiple of {GPU_ALIGN} bytes")]
    Misaligned {
        /// Field.
        what: &'static str,
        /// Value.
        value: u64,
    },
    /// A page extent ends past `len`.
    #[error("page {page} object {object} ends at byte {end}, past the buffer's {len} bytes")]
    OutOfRange {
        /// Page.
        page: u64,
        /// Object.
        object: usize,
        /// End offset (saturated on overflow).
        end: u64,
        /// Buffer length.
        len: u64,
    },
    /// `len` exceeds the allocation the handle names.
    #[error("declared length {len} exceeds the exported allocation's {alloc} bytes")]
    BeyondAllocation {
        /// Declared.
        len: u64,
        /// Actual allocation size.
        alloc: u64,
    },
    /// A page id is outside `0..pages`.
    #[error("page id {page} is out of range: the buffer has {pages} pages")]
    PageId {
        /// Page id.
        page: u64,
        /// Pages in the layout.
        pages: u64,
    },
    /// `keys` and `page_ids` differ in length.
    #[error("{keys} keys but {pages} page ids")]
    Mismatch {
        /// Keys.
        keys: usize,
        /// Page ids.
        pages: usize,
    },
    /// A layer-wise move whose layer count does not split the page evenly.
    #[error(
        "layer-wise onload: {layers} layers do not split a {page_bytes}-byte page into equal runs \
         (1..={MAX_LAYERS} layers dividing the page's bytes)"
    )]
    Layers {
        /// Layers asked for.
        layers: u32,
        /// Bytes of a page's block.
        page_bytes: u64,
    },
}

/// Checks a raw handle and returns it as an array.
pub fn check_handle(h: &[u8]) -> Result<[u8; IPC_HANDLE_LEN], LayoutError> {
    let a: [u8; IPC_HANDLE_LEN] = h
        .try_into()
        .map_err(|_| LayoutError::HandleLength(h.len()))?;
    if a.iter().all(|&b| b == 0) {
        return Err(LayoutError::HandleZero);
    }
    Ok(a)
}

impl GpuLayout {
    /// Bytes of each layer's run of a block split into `layers` equal runs.
    pub fn layer_bytes(&self, layers: u32) -> Result<u64, LayoutError> {
        let page_bytes = self.page_bytes();
        let bad = LayoutError::Layers { layers, page_bytes };
        if layers == 0 || layers > MAX_LAYERS || !page_bytes.is_multiple_of(u64::from(layers)) {
            return Err(bad);
        }
        Ok(page_bytes / u64::from(layers))
    }

    /// Bytes of one page's block.
    pub fn page_bytes(&self) -> u64 {
        self.objects.iter().map(|o| o.size).sum()
    }

    /// Validates alignment and that every page's every object lies in `[0, len)`.
    pub fn validate(&self, len: u64) -> Result<(), LayoutError> {
        if self.pages == 0 || self.objects.is_empty() {
            return Err(LayoutError::Empty);
        }
        if self.objects.len() > MAX_OBJECTS {
            return Err(LayoutError::TooManyObjects(self.objects.len()));
        }
        let aligned = |what, value: u64| {
            if value.is_multiple_of(GPU_ALIGN) {
                Ok(())
            } else {
                Err(LayoutError::Misaligned { what, value })
            }
        };
        aligned("base", self.base)?;
        aligned("page_stride", self.page_stride)?;
        for (j, o) in self.objects.iter().enumerate() {
            if o.size == 0 {
                return Err(LayoutError::ZeroObject(j));
            }
            aligned("object offset", o.offset)?;
            aligned("object size", o.size)?;
        }
        // Offsets grow with the page id, so the last page bounds every page.
        let last = self.pages - 1;
        for (j, o) in self.objects.iter().enumerate() {
            let end = last
                .checked_mul(self.page_stride)
                .and_then(|x| x.checked_add(self.base))
                .and_then(|x| x.checked_add(o.offset))
                .and_then(|x| x.checked_add(o.size));
            match end {
                Some(e) if e <= len => {}
                _ => {
                    return Err(LayoutError::OutOfRange {
                        page: last,
                        object: j,
                        end: end.unwrap_or(u64::MAX),
                        len,
                    });
                }
            }
        }
        Ok(())
    }

    /// Checks a request's page ids against the layout.
    pub fn check_pages(&self, keys: usize, page_ids: &[u64]) -> Result<(), LayoutError> {
        if keys != page_ids.len() {
            return Err(LayoutError::Mismatch {
                keys,
                pages: page_ids.len(),
            });
        }
        match page_ids.iter().find(|&&p| p >= self.pages) {
            Some(&page) => Err(LayoutError::PageId {
                page,
                pages: self.pages,
            }),
            None => Ok(()),
        }
    }

    /// Offset of page `p`'s start from the allocation's start. Call only on a validated layout.
    pub fn page_start(&self, p: u64) -> u64 {
        self.base + p * self.page_stride
    }

    /// The page's objects as one strided run, when there are at least two, all of one size, and
    /// each starts a constant step after the previous one with no overlap (every layer-outermost
    /// layout: the step is the layer stride). `None` for one object or any other shape.
    pub fn strided(&self) -> Option<Strided> {
        let [first, second, ..] = self.objects.as_slice() else {
            return None;
        };
        let width = first.size;
        let pitch = second.offset.checked_sub(first.offset)?;
        if pitch < width {
            return None;
        }
        let regular = self
            .objects
            .windows(2)
            .all(|w| w[1].size == width && w[1].offset.checked_sub(w[0].offset) == Some(pitch));
        regular.then_some(Strided {
            offset: first.offset,
            width,
            rows: self.objects.len() as u64,
            pitch,
        })
    }

    /// The device extents `(offset from allocation start, size)` of page `p`, paired with
    /// their offsets inside the page's block. Call only on a validated layout with `p < pages`.
    pub fn extents(&self, p: u64) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        let start = self.page_start(p);
        let mut in_block = 0;
        self.objects.iter().map(move |o| {
            let e = (start + o.offset, in_block, o.size);
            in_block += o.size;
            e
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page_first(pages: u64, page: u64) -> GpuLayout {
        GpuLayout {
            base: 512,
            page_stride: page,
            pages,
            objects: vec![GpuObject {
                offset: 0,
                size: page,
            }],
        }
    }

    #[test]
    fn page_first_layout_fits_exactly_and_not_one_byte_less() {
        let l = page_first(4, 4096);
        assert_eq!(l.validate(512 + 4 * 4096), Ok(()));
        assert!(matches!(
            l.validate(512 + 4 * 4096 - 16),
            Err(LayoutError::OutOfRange { page: 3, .. })
        ));
        assert_eq!(
            l.extents(2).collect::<Vec<_>>(),
            vec![(512 + 8192, 0, 4096)]
        );
    }

    #[test]
    fn layer_first_objects_gather_into_one_block_in_order() {
        // 3 layers x (K, V), 8 pages of 256 bytes per object.
        let layer = 8 * 256;
        let objects = (0..6)
            .map(|j| GpuObject {
                offset: j * layer,
                size: 256,
            })
            .collect();
        let l = GpuLayout {
            base: 0,
            page_stride: 256,
            pages: 8,
            objects,
        };
        assert_eq!(l.validate(6 * layer), Ok(()));
        assert_eq!(l.page_bytes(), 6 * 256);
        let e: Vec<_> = l.extents(5).collect();
        assert_eq!(e[0], (5 * 256, 0, 256));
        assert_eq!(e[4], (4 * layer + 5 * 256, 4 * 256, 256));
    }

    fn objects(v: &[(u64, u64)]) -> GpuLayout {
        GpuLayout {
            base: 0,
            page_stride: 256,
            pages: 8,
            objects: v
                .iter()
                .map(|&(offset, size)| GpuObject { offset, size })
                .collect(),
        }
    }

    #[test]
    fn strided_only_for_equal_sizes_at_a_constant_non_overlapping_step() {
        // Layer-first: 4 objects of 256 B, one layer (2048 B) apart, starting at 32.
        let l = objects(&[(32, 256), (2080, 256), (4128, 256), (6176, 256)]);
        assert_eq!(
            l.strided(),
            Some(Strided {
                offset: 32,
                width: 256,
                rows: 4,
                pitch: 2048
            })
        );
        // Back to back is strided too (pitch = width: the copy collapses to one run).
        assert_eq!(
            objects(&[(0, 64), (64, 64), (128, 64)])
                .strided()
                .map(|s| s.pitch),
            Some(64)
        );
        // One object: nothing to stride.
        assert_eq!(page_first(4, 4096).strided(), None);
        // Unequal sizes.
        assert_eq!(
            objects(&[(0, 256), (2048, 128), (4096, 256)]).strided(),
            None
        );
        assert_eq!(
            objects(&[(0, 256), (2048, 256), (4096, 128)]).strided(),
            None
        );
        // Step not constant.
        assert_eq!(
            objects(&[(0, 256), (2048, 256), (4112, 256)]).strided(),
            None
        );
        // Decreasing offsets, and overlapping objects.
        assert_eq!(
            objects(&[(4096, 256), (2048, 256), (0, 256)]).strided(),
            None
        );
        assert_eq!(objects(&[(0, 256), (128, 256)]).strided(), None);
    }

    #[test]
    fn misaligned_or_empty_or_overflowing_layouts_are_refused() {
        let mut l = page_first(4, 4096);
        l.base = 8;
        assert_eq!(
            l.validate(1 << 30),
            Err(LayoutError::Misaligned {
                what: "base",
                value: 8
            })
        );
        let mut l = page_first(4, 4096);
        l.objects[0].size = 0;
        assert_eq!(l.validate(1 << 30), Err(LayoutError::ZeroObject(0)));
        assert_eq!(
            page_first(0, 4096).validate(1 << 30),
            Err(LayoutError::Empty)
        );
        let l = page_first(u64::MAX, 1 << 20);
        assert!(matches!(
            l.validate(u64::MAX),
            Err(LayoutError::OutOfRange { end: u64::MAX, .. })
        ));
    }

    #[test]
    fn page_ids_outside_the_layout_and_count_mismatches_are_refused() {
        let l = page_first(4, 4096);
        assert_eq!(l.check_pages(2, &[0, 3]), Ok(()));
        assert_eq!(
            l.check_pages(2, &[0, 4]),
            Err(LayoutError::PageId { page: 4, pages: 4 })
        );
        assert_eq!(
            l.check_pages(3, &[0, 1]),
            Err(LayoutError::Mismatch { keys: 3, pages: 2 })
        );
    }

    #[test]
    fn handles_must_be_64_nonzero_bytes() {
        assert_eq!(check_handle(&[1; 63]), Err(LayoutError::HandleLength(63)));
        assert_eq!(check_handle(&[0; 64]), Err(LayoutError::HandleZero));
        assert_eq!(check_handle(&[7; 64]).map(|h| h[63]), Ok(7));
    }
}
