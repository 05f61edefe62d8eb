//! kvtrace placeholder while building.
mod skel {
    include!(concat!(env!("OUT_DIR"), "/kvtrace.skel.rs"));
}
fn main() {}
