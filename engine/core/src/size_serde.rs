//! Serde helpers for byte sizes in the config file (`"16GiB"` or a plain integer).

use serde::{Deserialize, Deserializer, Serializer};

#[derive(Deserialize)]
#[serde(untagged)]
enum SizeRepr {
    Int(u64),
    Str(String),
}

pub(crate) fn de_size<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    match SizeRepr::deserialize(d)? {
        SizeRepr::Int(n) => Ok(n),
        SizeRepr::Str(s) => kvnode_proto::size::parse_size(&s).map_err(serde::de::Error::custom),
    }
}

pub(crate) fn de_opt_size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    de_size(d).map(Some)
}

#[expect(
    clippy::trivially_copy_pass_by_ref,
    reason = "serde serialize_with passes references"
)]
pub(crate) fn ser_size<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
    // `ByteSize` rounds sizes that are no whole unit ("1.5MiB"); print those exactly, so
    // that a printed config (`--print-config`) parses back to the same bytes.
    let text = kvnode_proto::size::ByteSize(*v).to_string();
    if kvnode_proto::size::parse_size(&text) == Ok(*v) {
        s.serialize_str(&text)
    } else {
        s.serialize_str(&format!("{v}B"))
    }
}

#[expect(clippy::ref_option, reason = "serde serialize_with passes references")]
pub(crate) fn ser_opt_size<S: Serializer>(v: &Option<u64>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(v) => ser_size(v, s),
        None => s.serialize_none(),
    }
}
