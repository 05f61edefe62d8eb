//! Links the system's UCX (Debian: libucx-dev; at run time libucx0). The Rust declarations
//! are checked in (src/ucp_1_13.rs), so no bindgen or libclang runs here.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rustc-link-lib=ucp");
    println!("cargo:rustc-link-lib=ucs");
}
