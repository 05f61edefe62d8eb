//! Human byte sizes: `4096`, `512KiB`, `512MiB`, `16GiB`, `1G`, `2TiB`.

use std::fmt;

/// A size string that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid size {0:?}: use a number with an optional unit (B, KiB, MiB, GiB, TiB, K, M, G, T, KB, MB, GB, TB)"
)]
pub struct SizeError(pub String);

/// Parses a byte size. Binary units (`KiB`) and single letters (`K`) are powers of 1024;
/// `KB`/`MB`/`GB`/`TB` are powers of 1000.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| SizeError(s.to_owned()))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(SizeError(s.to_owned())),
    };
    n.checked_mul(mult).ok_or_else(|| SizeError(s.to_owned()))
}

/// Displays a byte count in the largest binary unit that divides it, else in bytes.
#[derive(Clone, Copy, Debug)]
pub struct ByteSize(pub u64);

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (unit, shift) in [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)] {
            let m = 1u64 << shift;
            if self.0 >= m && self.0.is_multiple_of(m) {
                return write!(f, "{}{unit}", self.0 / m);
            }
        }
        if self.0 >= 1 << 20 {
            return write!(f, "{:.1}MiB", self.0 as f64 / f64::from(1u32 << 20));
        }
        write!(f, "{}B", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_binary_and_decimal_units() {
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("16GiB"), Ok(16 << 30));
        assert_eq!(parse_size("16G"), Ok(16 << 30));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("1GB"), Ok(1_000_000_000));
        assert!(parse_size("12XB").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("99999999999TiB").is_err());
    }

    #[test]
    fn displays_in_largest_exact_unit() {
        assert_eq!(ByteSize(16 << 30).to_string(), "16GiB");
        assert_eq!(ByteSize(1536 << 10).to_string(), "1536KiB");
        assert_eq!(ByteSize(7).to_string(), "7B");
    }
}
