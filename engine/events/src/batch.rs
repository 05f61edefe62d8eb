//! The published batch: `[ts, events, data_parallel_rank]` over validated events only.

use serde::ser::{Serialize, SerializeTuple, Serializer};

use crate::validate::ValidEvent;

/// A batch as published: `[ts, events, data_parallel_rank]`, always exactly 3 elements.
///
/// It holds only [`ValidEvent`]s, so a batch with an invalid event cannot be built.
#[derive(Debug, Clone)]
pub struct EventBatch<'a> {
    /// Seconds since the Unix epoch when the batch was sealed.
    pub ts: f64,
    /// Events in publication order.
    pub events: &'a [ValidEvent],
    /// Overrides the DP rank the router registered for this endpoint, when set.
    pub dp_rank: Option<u32>,
}

impl Serialize for EventBatch<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut t = s.serialize_tuple(3)?;
        t.serialize_element(&self.ts)?;
        t.serialize_element(self.events)?;
        t.serialize_element(&self.dp_rank)?;
        t.end()
    }
}

impl EventBatch<'_> {
    /// Encodes the batch as positional msgpack (arrays, never maps).
    pub fn encode(&self) -> Result<Vec<u8>, rmp_serde::encode::Error> {
        let mut out = Vec::with_capacity(64 + self.events.len() * 48);
        self.encode_into(&mut out)?;
        Ok(out)
    }

    /// Encodes the batch, appending to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), rmp_serde::encode::Error> {
        let mut ser = rmp_serde::Serializer::new(out);
        self.serialize(&mut ser)
    }
}
