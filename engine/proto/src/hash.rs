//! SGLang's chained SHA-256 page digests (interop.md §2).

use sha2::{Digest as _, Sha256};

use crate::key::Digest;

/// Digest of one page: `SHA256(prior (32 raw bytes, if any) || tokens as u32 LE)`.
pub fn page_digest(prior: Option<&Digest>, tokens: &[u32]) -> Digest {
    let mut h = Sha256::new();
    if let Some(p) = prior {
        h.update(p.0);
    }
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    Digest(h.finalize().into())
}

/// Digests of every *full* page of `tokens`, chained from `seed` (a trailing partial page is
/// not hashed: the same prefix must hash the same wherever it was cut).
pub fn page_digests(tokens: &[u32], page_size: usize, seed: Option<Digest>) -> Vec<Digest> {
    assert!(page_size > 0, "page_size must be positive");
    let mut prior = seed;
    tokens
        .chunks_exact(page_size)
        .map(|page| {
            let d = page_digest(prior.as_ref(), page);
            prior = Some(d);
            d
        })
        .collect()
}

/// SGLang's namespace seed for requests with an `extra_key` or `cache_salt`: SHA-256 of
/// `b"sglang-cache-namespace-v1"` then, for each of the two, `\x00` if absent or
/// `\x01 | u64-LE length | utf8 bytes`. `None` when both are absent (the chain is unseeded).
pub fn sglang_namespace_seed(extra_key: Option<&str>, cache_salt: Option<&str>) -> Option<Digest> {
    if extra_key.is_none() && cache_salt.is_none() {
        return None;
    }
    let mut h = Sha256::new();
    h.update(b"sglang-cache-namespace-v1");
    for part in [extra_key, cache_salt] {
        match part {
            None => h.update([0u8]),
            Some(s) => {
                h.update([1u8]);
                h.update((s.len() as u64).to_le_bytes());
                h.update(s.as_bytes());
            }
        }
    }
    Some(Digest(h.finalize().into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_page_is_plain_sha256_of_le_tokens() {
        // sha256(b"\x01\x00\x00\x00\x02\x00\x00\x00"), computed independently with Python's hashlib.
        let d = page_digest(None, &[1, 2]);
        assert_eq!(
            d.to_hex(),
            "34fb5c825de7ca4aea6e712f19d439c1da0c92c37b423936c5f618545ca4fa1f"
        );
        let manual = {
            let mut h = Sha256::new();
            h.update([1, 0, 0, 0, 2, 0, 0, 0]);
            Digest(h.finalize().into())
        };
        assert_eq!(d, manual);
    }

    #[test]
    fn chain_feeds_parent_digest_and_drops_partial_page() {
        let toks: Vec<u32> = (0..10).collect();
        let ds = page_digests(&toks, 4, None);
        assert_eq!(ds.len(), 2);
        assert_eq!(ds[0], page_digest(None, &[0, 1, 2, 3]));
        assert_eq!(ds[1], page_digest(Some(&ds[0]), &[4, 5, 6, 7]));
    }

    #[test]
    fn seed_changes_every_digest_and_absent_seed_is_none() {
        assert_eq!(sglang_namespace_seed(None, None), None);
        let a = sglang_namespace_seed(Some("k"), None).unwrap();
        let b = sglang_namespace_seed(None, Some("k")).unwrap();
        assert_ne!(a, b);
        let toks: Vec<u32> = (0..8).collect();
        assert_ne!(
            page_digests(&toks, 4, Some(a)),
            page_digests(&toks, 4, None)
        );
    }
}
