//! Compiles `ebpf/kvtrace.bpf.c` with clang into a libbpf skeleton. `vmlinux.h` (kernel
//! types for CO-RE) is generated into OUT_DIR with bpftool from the build machine's BTF.

use std::path::{Path, PathBuf};
use std::process::Command;

const SRC: &str = "../../ebpf/kvtrace.bpf.c";

fn vmlinux_h(out: &Path) -> PathBuf {
    let dir = out.join("vmlinux");
    let h = dir.join("vmlinux.h");
    if h.exists() {
        return dir;
    }
    std::fs::create_dir_all(&dir).expect("create OUT_DIR/vmlinux");
    let btf = std::env::var("KVTRACE_BTF").unwrap_or_else(|_| "/sys/kernel/btf/vmlinux".into());
    let fail = |why: String| -> ! {
        panic!(
            "kvtrace build: cannot generate vmlinux.h from {btf}: {why}\n\
             install bpftool (`apt-get install bpftool`, or run scripts/install-deps.sh) on a \
             kernel with CONFIG_DEBUG_INFO_BTF=y, or point KVTRACE_BTF at a BTF file"
        )
    };
    let o = Command::new("bpftool")
        .args(["btf", "dump", "file", &btf, "format", "c"])
        .output()
        .unwrap_or_else(|e| fail(format!("running bpftool: {e}")));
    if !o.status.success() {
        fail(String::from_utf8_lossy(&o.stderr).into_owned());
    }
    std::fs::write(&h, &o.stdout).expect("write vmlinux.h");
    dir
}

/// The BPF target-architecture macro (`bpf_tracing.h` reads registers by it) and Debian's
/// multiarch include directory (where `asm/` headers live, which `clang -target bpf` does
/// not search), for the architecture being built for.
fn arch_args() -> (String, String) {
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").expect("CARGO_CFG_TARGET_ARCH");
    let (macro_arch, multiarch) = match arch.as_str() {
        "x86_64" => ("x86", "x86_64-linux-gnu"),
        "aarch64" => ("arm64", "aarch64-linux-gnu"),
        "riscv64" => ("riscv", "riscv64-linux-gnu"),
        "powerpc64" => ("powerpc", "powerpc64le-linux-gnu"),
        "s390x" => ("s390", "s390x-linux-gnu"),
        other => panic!("kvtrace build: no BPF register layout known for target arch {other}"),
    };
    (
        format!("-D__TARGET_ARCH_{macro_arch}"),
        format!("-I/usr/include/{multiarch}"),
    )
}

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let vmlinux = vmlinux_h(&out);
    let inc = format!("-I{}", vmlinux.display());
    let (target_arch, multiarch_inc) = arch_args();
    libbpf_cargo::SkeletonBuilder::new()
        .source(SRC)
        .clang_args([
            inc.as_str(),
            "-I../../ebpf",
            target_arch.as_str(),
            multiarch_inc.as_str(),
        ])
        .build_and_generate(out.join("kvtrace.skel.rs"))
        .unwrap_or_else(|e| {
            panic!(
                "kvtrace build: compiling {SRC} failed (needs clang and libelf-dev: run \
                 scripts/install-deps.sh): {e:#}"
            )
        });
    println!("cargo:rerun-if-changed={SRC}");
    println!("cargo:rerun-if-changed=../../ebpf/kvtrace.h");
    println!("cargo:rerun-if-env-changed=KVTRACE_BTF");
}
