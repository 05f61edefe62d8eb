//! Block keys: `(namespace, page digest, segment)`, plus hex helpers.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Error for a digest or namespace given in the wrong form.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// The byte string is not 32 bytes long.
    #[error("page digest must be 32 bytes (64 hex chars), got {0} bytes")]
    DigestLength(usize),
    /// A character outside `[0-9a-fA-F]`, or an odd number of them.
    #[error("invalid hex string {0:?}: expected an even number of [0-9a-f] characters")]
    BadHex(String),
}

/// A page digest: SHA-256 of the page's tokens chained with its parent (interop.md §2).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    /// Parses 64 hex characters.
    pub fn from_hex(s: &str) -> Result<Self, KeyError> {
        let bytes = decode_hex(s)?;
        Self::from_slice(&bytes)
    }

    /// Takes exactly 32 bytes.
    pub fn from_slice(b: &[u8]) -> Result<Self, KeyError> {
        <[u8; 32]>::try_from(b)
            .map(Digest)
            .map_err(|_| KeyError::DigestLength(b.len()))
    }

    /// Lowercase hex, 64 characters (SGLang's key string).
    pub fn to_hex(&self) -> String {
        encode_hex(&self.0)
    }

    /// The router's hash of this page: the first 8 bytes read big-endian.
    pub fn router_hash(&self) -> u64 {
        u64::from_be_bytes(self.0[..8].try_into().expect("8 bytes"))
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Digest({})", &self.to_hex()[..16])
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl Serialize for Digest {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

struct DigestVisitor;

impl<'de> serde::de::Visitor<'de> for DigestVisitor {
    type Value = Digest;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a 32-byte page digest")
    }

    fn visit_bytes<E: serde::de::Error>(self, v: &[u8]) -> Result<Digest, E> {
        Digest::from_slice(v).map_err(E::custom)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Digest, A::Error> {
        // Some msgpack writers send byte strings as arrays of small ints.
        let mut d = [0u8; 32];
        for (i, b) in d.iter_mut().enumerate() {
            *b = seq
                .next_element()?
                .ok_or_else(|| serde::de::Error::custom(KeyError::DigestLength(i)))?;
        }
        if seq.next_element::<u8>()?.is_some() {
            return Err(serde::de::Error::custom("page digest longer than 32 bytes"));
        }
        Ok(Digest(d))
    }
}

impl<'de> Deserialize<'de> for Digest {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Borrowed bytes: no allocation per key on the hot path.
        d.deserialize_bytes(DigestVisitor)
    }
}

/// The 128-bit identity of a namespace: a digest of everything that changes a block's bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NamespaceId(pub u128);

impl fmt::Debug for NamespaceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ns:{:032x}", self.0)
    }
}

impl fmt::Display for NamespaceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

/// A key as a client sends it: page digest and segment, inside an already chosen namespace.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
pub struct Key(pub Digest, pub u16);

impl Key {
    /// Segment 0 of a page.
    pub fn page(d: Digest) -> Self {
        Key(d, 0)
    }
}

/// A fully qualified block key. Two blocks with different namespaces never compare equal.
#[derive(Clone, Copy, PartialEq, Eq, Debug, PartialOrd, Ord)]
pub struct BlockKey {
    /// Namespace identity.
    pub ns: NamespaceId,
    /// Page digest.
    pub digest: Digest,
    /// Segment of the page (K/V half, layer, sidecar pool, ...).
    pub segment: u16,
}

impl std::hash::Hash for BlockKey {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        // Feed whole words: cheaper than 50 single-byte writes and collision-resistant
        // under a keyed hasher even for adversarially chosen digests.
        h.write_u128(self.ns.0);
        h.write(&self.digest.0);
        h.write_u16(self.segment);
    }
}

/// Lowercase hex encoding.
pub fn encode_hex(b: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(b.len() * 2);
    for &x in b {
        s.push(HEX[usize::from(x >> 4)] as char);
        s.push(HEX[usize::from(x & 15)] as char);
    }
    s
}

/// Hex decoding (either case).
pub fn decode_hex(s: &str) -> Result<Vec<u8>, KeyError> {
    let s = s.trim();
    if !s.len().is_multiple_of(2) {
        return Err(KeyError::BadHex(s.to_owned()));
    }
    let nib = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        b'A'..=b'F' => Some(c - b'A' + 10),
        _ => None,
    };
    s.as_bytes()
        .chunks(2)
        .map(|p| match (nib(p[0]), nib(p[1])) {
            (Some(h), Some(l)) => Ok(h << 4 | l),
            _ => Err(KeyError::BadHex(s.to_owned())),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_rejects_garbage() {
        let d = Digest([0xab; 32]);
        assert_eq!(Digest::from_hex(&d.to_hex()).unwrap(), d);
        assert!(matches!(Digest::from_hex("abc"), Err(KeyError::BadHex(_))));
        assert!(matches!(Digest::from_hex("zz"), Err(KeyError::BadHex(_))));
        assert_eq!(Digest::from_hex("abcd"), Err(KeyError::DigestLength(2)));
    }

    #[test]
    fn router_hash_is_first_eight_bytes_big_endian() {
        let mut b = [0u8; 32];
        b[..8].copy_from_slice(&[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(Digest(b).router_hash(), 0x0102_0304_0506_0708);
    }
}
