//! The namespace spec: everything that changes a block's bytes, folded into a 128-bit id.
//!
//! Two ranks that hold different slices of a page (TP rank, PP stage, head or layer range,
//! CP rank, byte layout, dtype) get different namespaces, so they can never share a key.

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use crate::key::NamespaceId;

/// Largest number of segments one namespace may declare.
pub const MAX_SEGMENTS: usize = 1024;
/// Largest `page_size` (tokens per page) a namespace may declare: a block's router metadata
/// holds one token id per token, so this bounds it (64 KiB a block).
pub const MAX_PAGE_SIZE: u32 = 16 << 10;

/// Largest slot size a segment may declare (1 TiB). Far above any slab a daemon can have,
/// and far enough below `u64::MAX` that rounding a slot up to its class never overflows.
pub const MAX_SLOT_BYTES: u64 = 1 << 40;

/// What a client declares when it registers a namespace. Every field takes part in the id,
/// except that `mla = true` drops the TP coordinates (every TP rank holds the same MLA bytes).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct NamespaceSpec {
    /// Model name or path.
    pub model: String,
    /// KV dtype (`bf16`, `fp8_e4m3`, ...).
    pub dtype: String,
    /// Tokens per page.
    pub page_size: u32,
    /// Host byte layout (`page_first`, `page_first_direct`, `layer_first`, ...).
    pub layout: String,
    /// KV shape, free-form (e.g. `[layers, kv_heads, head_dim]`).
    pub kv_shape: Vec<u64>,
    /// Tensor-parallel rank.
    pub tp_rank: u32,
    /// Tensor-parallel size.
    pub tp_size: u32,
    /// Pipeline stage.
    pub pp_rank: u32,
    /// Pipeline stages.
    pub pp_size: u32,
    /// Attention context-parallel rank.
    pub cp_rank: u32,
    /// Attention context-parallel size.
    pub cp_size: u32,
    /// KV head range `[start, end)` when heads are split across ranks.
    pub head_range: Option<(u32, u32)>,
    /// Layer range `[start, end)` held by this rank.
    pub layer_range: Option<(u32, u32)>,
    /// MLA model: one object per page, identical on every TP rank.
    pub mla: bool,
    /// Tenant salt; also published to the router as the cache salt.
    pub tenant_salt: String,
    /// Slot size in bytes of each segment (index = segment number).
    pub segments: Vec<u64>,
}

/// A spec that cannot be registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// No segments were declared.
    #[error("namespace declares no segments: give at least one slot size")]
    NoSegments,
    /// Too many segments.
    #[error("namespace declares {0} segments; at most {MAX_SEGMENTS} are allowed")]
    TooManySegments(usize),
    /// A zero slot size.
    #[error("segment {0} has slot size 0")]
    ZeroSlot(usize),
    /// A slot size above [`MAX_SLOT_BYTES`].
    #[error(
        "segment {segment} declares a slot of {size} bytes; at most {MAX_SLOT_BYTES} (1 TiB) is allowed: give the bytes of one page"
    )]
    SlotTooLarge {
        /// Segment index.
        segment: usize,
        /// Declared size.
        size: u64,
    },
    /// `page_size` is zero.
    #[error("page_size must be at least 1 token")]
    ZeroPageSize,
    /// `page_size` above [`MAX_PAGE_SIZE`].
    #[error("page_size {0} is above the largest accepted, {MAX_PAGE_SIZE} tokens per page")]
    PageSizeTooLarge(u32),
    /// A rank outside its size.
    #[error("{what} rank {rank} is not below its size {size}")]
    RankOutOfRange {
        /// Which coordinate.
        what: &'static str,
        /// Rank given.
        rank: u32,
        /// Size given.
        size: u32,
    },
}

impl NamespaceSpec {
    /// Checks the spec is registrable.
    pub fn validate(&self) -> Result<(), SpecError> {
        if self.segments.is_empty() {
            return Err(SpecError::NoSegments);
        }
        if self.segments.len() > MAX_SEGMENTS {
            return Err(SpecError::TooManySegments(self.segments.len()));
        }
        if let Some(i) = self.segments.iter().position(|&s| s == 0) {
            return Err(SpecError::ZeroSlot(i));
        }
        if let Some(segment) = self.segments.iter().position(|&s| s > MAX_SLOT_BYTES) {
            return Err(SpecError::SlotTooLarge {
                segment,
                size: self.segments[segment],
            });
        }
        if self.page_size == 0 {
            return Err(SpecError::ZeroPageSize);
        }
        if self.page_size > MAX_PAGE_SIZE {
            return Err(SpecError::PageSizeTooLarge(self.page_size));
        }
        for (what, rank, size) in [
            ("tp", self.tp_rank, self.tp_size),
            ("pp", self.pp_rank, self.pp_size),
            ("cp", self.cp_rank, self.cp_size),
        ] {
            // A size of 0 means "not set" and is treated as 1.
            if rank >= size.max(1) {
                return Err(SpecError::RankOutOfRange { what, rank, size });
            }
        }
        Ok(())
    }

    /// The namespace id: the first 16 bytes of SHA-256 over a tagged, length-prefixed
    /// encoding of every field (so no two different specs can encode alike).
    pub fn id(&self) -> NamespaceId {
        let mut h = Sha256::new();
        h.update(b"kvnode-namespace-v1");
        let mut field = |tag: &str, bytes: &[u8]| {
            h.update((tag.len() as u32).to_le_bytes());
            h.update(tag.as_bytes());
            h.update((bytes.len() as u64).to_le_bytes());
            h.update(bytes);
        };
        let u32s = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let u64s = |v: &[u64]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let range = |r: Option<(u32, u32)>| r.map_or_else(Vec::new, |(a, b)| u32s(&[a, b]));
        field("model", self.model.as_bytes());
        field("dtype", self.dtype.as_bytes());
        field("page_size", &self.page_size.to_le_bytes());
        field("layout", self.layout.as_bytes());
        field("kv_shape", &u64s(&self.kv_shape));
        let (tp_rank, tp_size) = if self.mla {
            (0, 1)
        } else {
            (self.tp_rank, self.tp_size.max(1))
        };
        field("tp", &u32s(&[tp_rank, tp_size]));
        field("pp", &u32s(&[self.pp_rank, self.pp_size.max(1)]));
        field("cp", &u32s(&[self.cp_rank, self.cp_size.max(1)]));
        field("head_range", &range(self.head_range));
        field("layer_range", &range(self.layer_range));
        field("mla", &[u8::from(self.mla)]);
        field("tenant_salt", self.tenant_salt.as_bytes());
        field("segments", &u64s(&self.segments));
        let d: [u8; 32] = h.finalize().into();
        NamespaceId(u128::from_be_bytes(d[..16].try_into().expect("16 bytes")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> NamespaceSpec {
        NamespaceSpec {
            model: "qwen3-8b".into(),
            dtype: "bf16".into(),
            page_size: 64,
            layout: "page_first".into(),
            tp_size: 2,
            segments: vec![1 << 20],
            ..NamespaceSpec::default()
        }
    }

    #[test]
    fn every_byte_changing_field_changes_the_id() {
        let b = base();
        let variants: Vec<NamespaceSpec> = vec![
            NamespaceSpec {
                tp_rank: 1,
                ..base()
            },
            NamespaceSpec {
                pp_rank: 1,
                pp_size: 2,
                ..base()
            },
            NamespaceSpec {
                cp_rank: 1,
                cp_size: 2,
                ..base()
            },
            NamespaceSpec {
                head_range: Some((0, 4)),
                ..base()
            },
            NamespaceSpec {
                layer_range: Some((0, 16)),
                ..base()
            },
            NamespaceSpec {
                layout: "page_first_direct".into(),
                ..base()
            },
            NamespaceSpec {
                dtype: "fp8".into(),
                ..base()
            },
            NamespaceSpec {
                tenant_salt: "t".into(),
                ..base()
            },
            NamespaceSpec {
                segments: vec![1 << 19, 1 << 19],
                ..base()
            },
            NamespaceSpec {
                model: "qwen3-8b ".into(),
                ..base()
            },
        ];
        let mut ids: Vec<NamespaceId> = variants.iter().map(NamespaceSpec::id).collect();
        ids.push(b.id());
        let n = ids.len();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), n, "two specs collided");
    }

    #[test]
    fn mla_ranks_share_one_namespace() {
        let a = NamespaceSpec {
            mla: true,
            tp_rank: 0,
            ..base()
        };
        let b = NamespaceSpec {
            mla: true,
            tp_rank: 1,
            ..base()
        };
        assert_eq!(a.id(), b.id());
    }

    #[test]
    fn validation_refuses_bad_specs() {
        assert_eq!(
            NamespaceSpec {
                segments: vec![],
                ..base()
            }
            .validate(),
            Err(SpecError::NoSegments)
        );
        assert_eq!(
            NamespaceSpec {
                segments: vec![0],
                ..base()
            }
            .validate(),
            Err(SpecError::ZeroSlot(0))
        );
        assert!(matches!(
            NamespaceSpec {
                tp_rank: 2,
                ..base()
            }
            .validate(),
            Err(SpecError::RankOutOfRange { what: "tp", .. })
        ));
        assert_eq!(base().validate(), Ok(()));
    }

    #[test]
    fn slot_sizes_whose_class_would_overflow_are_refused() {
        for size in [u64::MAX, u64::MAX - 4095, MAX_SLOT_BYTES + 1] {
            let spec = NamespaceSpec {
                segments: vec![4096, size],
                ..base()
            };
            assert_eq!(
                spec.validate(),
                Err(SpecError::SlotTooLarge { segment: 1, size })
            );
        }
        let at_limit = NamespaceSpec {
            segments: vec![MAX_SLOT_BYTES],
            ..base()
        };
        assert_eq!(at_limit.validate(), Ok(()));
    }
}
