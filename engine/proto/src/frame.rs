//! Frame layout shared by client and daemon.
//!
//! ```text
//! offset 0  u32 LE  header_len   (1 ..= MAX_HEADER)
//! offset 4  u32 LE  payload_len  (0 ..= MAX_PAYLOAD)
//! offset 8  header  msgpack map (a Request or a Reply, named fields)
//!           payload raw bytes: block contents, described by the header
//! ```
//! Bulk bytes never pass through msgpack, so the daemon can read them straight into arena
//! slots and write them straight out of them.

use serde::{Serialize, de::DeserializeOwned};

/// Bytes in the fixed prefix.
pub const PREFIX_LEN: usize = 8;
/// Largest msgpack header accepted.
pub const MAX_HEADER: u32 = 16 << 20;
/// Largest raw payload accepted in one frame.
pub const MAX_PAYLOAD: u32 = 1 << 30;

/// A frame that cannot be accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// Header length 0 or above the limit.
    #[error("frame header length {0} is outside 1..={MAX_HEADER}")]
    HeaderLength(u32),
    /// Payload above the limit.
    #[error("frame payload length {0} exceeds {MAX_PAYLOAD}; split the batch")]
    PayloadLength(u32),
    /// The header is not a valid message of the expected type.
    #[error("malformed frame header: {0}")]
    Decode(String),
    /// The message could not be encoded (a bug, or a value msgpack cannot carry).
    #[error("cannot encode frame header: {0}")]
    Encode(String),
    /// The stream ended inside a frame.
    #[error("connection closed inside a frame")]
    Truncated,
}

/// The decoded fixed prefix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FramePrefix {
    /// Length of the msgpack header.
    pub header_len: u32,
    /// Length of the raw payload after it.
    pub payload_len: u32,
}

impl FramePrefix {
    /// Validates the 8-byte prefix.
    pub fn decode(b: [u8; PREFIX_LEN]) -> Result<Self, FrameError> {
        let header_len = u32::from_le_bytes(b[..4].try_into().expect("4"));
        let payload_len = u32::from_le_bytes(b[4..].try_into().expect("4"));
        if header_len == 0 || header_len > MAX_HEADER {
            return Err(FrameError::HeaderLength(header_len));
        }
        if payload_len > MAX_PAYLOAD {
            return Err(FrameError::PayloadLength(payload_len));
        }
        Ok(Self {
            header_len,
            payload_len,
        })
    }

    /// Encodes the prefix.
    pub fn encode(self) -> [u8; PREFIX_LEN] {
        let mut b = [0u8; PREFIX_LEN];
        b[..4].copy_from_slice(&self.header_len.to_le_bytes());
        b[4..].copy_from_slice(&self.payload_len.to_le_bytes());
        b
    }
}

/// Encodes `msg` as prefix + header for a frame carrying `payload_len` raw bytes after it.
pub fn encode_frame<T: Serialize>(msg: &T, payload_len: u64) -> Result<Vec<u8>, FrameError> {
    let payload_len = u32::try_from(payload_len)
        .ok()
        .filter(|&p| p <= MAX_PAYLOAD)
        .ok_or(FrameError::PayloadLength(u32::MAX))?;
    let mut out = vec![0u8; PREFIX_LEN];
    rmp_serde::encode::write_named(&mut out, msg).map_err(|e| FrameError::Encode(e.to_string()))?;
    let header_len = (out.len() - PREFIX_LEN) as u32;
    if header_len > MAX_HEADER {
        return Err(FrameError::HeaderLength(header_len));
    }
    out[..PREFIX_LEN].copy_from_slice(
        &FramePrefix {
            header_len,
            payload_len,
        }
        .encode(),
    );
    Ok(out)
}

/// Decodes a msgpack header.
pub fn decode_header<T: DeserializeOwned>(b: &[u8]) -> Result<T, FrameError> {
    rmp_serde::from_slice(b).map_err(|e| FrameError::Decode(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::{Op, Request};

    #[test]
    fn prefix_rejects_zero_and_oversized_lengths() {
        let mk = |h: u32, p: u32| {
            FramePrefix {
                header_len: h,
                payload_len: p,
            }
            .encode()
        };
        assert_eq!(
            FramePrefix::decode(mk(0, 0)),
            Err(FrameError::HeaderLength(0))
        );
        assert!(FramePrefix::decode(mk(MAX_HEADER + 1, 0)).is_err());
        assert!(FramePrefix::decode(mk(1, MAX_PAYLOAD + 1)).is_err());
        assert_eq!(
            FramePrefix::decode(mk(5, 7)),
            Ok(FramePrefix {
                header_len: 5,
                payload_len: 7
            })
        );
    }

    #[test]
    fn request_round_trips_through_a_frame() {
        let req = Request {
            id: 9,
            op: Op::Stats,
        };
        let f = encode_frame(&req, 0).unwrap();
        let p = FramePrefix::decode(f[..8].try_into().unwrap()).unwrap();
        assert_eq!(p.header_len as usize, f.len() - 8);
        let back: Request = decode_header(&f[8..]).unwrap();
        assert_eq!(back, req);
    }
}
