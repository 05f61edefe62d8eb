//! The USDT site encoding: `nop; nop5` and a `.note.stapsdt` entry, so uprobes can be optimized.

// The note layout is that of `<sys/sdt.h>` and the `probe` crate (note type 3, owner `stapsdt`,
// site / `.stapsdt.base` / semaphore addresses, provider, name, `-8@%reg` argument strings; no
// semaphore). The site is the 6 bytes `90 0f 1f 44 00 00` instead of a lone `90`: the
// `nop, nop5` combination of libbpf's `usdt.h`. The note points at the 1-byte `nop`, so every
// USDT consumer attaches there and traps with `int3` as before. libbpf >= 1.7 on a kernel with
// the `uprobe` syscall (Linux 6.18+, x86-64) attaches one byte later, on the `nop5`, which the
// kernel rewrites after the first hit into a `call` to a uprobe trampoline that enters through
// the `uprobe` syscall instead of a breakpoint trap. Untraced, a site costs two nops.
// That `call` pushes its return address below the stack pointer, and the trampoline saves
// three registers there too (Linux 6.18; later kernels move to a `jmp` that skips the red
// zone): 32 bytes the compiler may have been using as red zone. So the asm is NOT `nostack`:
// without it the compiler must assume the block uses stack space below the stack pointer and
// keeps nothing live there. (The `probe` crate's `nostack` is safe only for an `int3` site.)
// Other architectures use the `probe` crate's one-`nop` site.

/// Emits one USDT site (`provider:name`) with up to 8 integer arguments in fixed registers.
///
/// Argument `i` is in the `i`-th of `rdi rsi rdx rcx r8 r9 r10 r11`, and the note says so, so
/// a BPF program may read `ctx->di`... directly instead of going through the USDT argument
/// spec (kvtrace's `op_done` does after checking the note against
/// [`kvnode_proto::obs::OP_DONE_X86_ARGS`]).
#[cfg(target_arch = "x86_64")]
macro_rules! usdt {
    ($provider:ident, $name:ident $(,)?) => {
        $crate::probes::site::usdt!(@site $provider, $name, [])
    };
    ($provider:ident, $name:ident, $arg1:expr $(, $arg:expr)* $(,)?) => {
        $crate::probes::site::usdt!(@pair $provider, $name, [("", "rdi", $arg1)],
            ["rsi" "rdx" "rcx" "r8" "r9" "r10" "r11"], $($arg,)*)
    };
    // Pairs each further argument with the next register.
    (@pair $p:ident, $n:ident, [$($done:tt)*], [$reg:tt $($regs:tt)*], $arg:expr, $($rest:expr,)*) => {
        $crate::probes::site::usdt!(@pair $p, $n, [$($done)* (" ", $reg, $arg)], [$($regs)*],
            $($rest,)*)
    };
    (@pair $p:ident, $n:ident, [$($done:tt)*], [$($regs:tt)*],) => {
        $crate::probes::site::usdt!(@site $p, $n, [$($done)*])
    };
    (@site $provider:ident, $name:ident, [$(($sep:tt, $reg:tt, $arg:expr))*]) => {
        // SAFETY: the asm only executes two nops; everything else is section data. It reads
        // its register operands and touches no memory or flags. Not `nostack`: an optimized
        // uprobe turns the nop5 into a call that writes below the stack pointer.
        unsafe {
            ::core::arch::asm!(
                concat!(
                    "990: nop\n",
                    "     .byte 0x0f, 0x1f, 0x44, 0x00, 0x00\n",
                    "     .pushsection .note.stapsdt,\"?\",\"note\"\n",
                    "     .balign 4\n",
                    "     .4byte 992f-991f, 994f-993f, 3\n",
                    "991: .asciz \"stapsdt\"\n",
                    "992: .balign 4\n",
                    "993: .8byte 990b\n",
                    "     .8byte _.stapsdt.base\n",
                    "     .8byte 0\n",
                    "     .asciz \"", stringify!($provider), "\"\n",
                    "     .asciz \"", stringify!($name), "\"\n",
                    "     .asciz \"", $($sep, "-8@%", $reg,)* "\"\n",
                    "994: .balign 4\n",
                    "     .popsection\n",
                    ".ifndef _.stapsdt.base\n",
                    "     .pushsection .stapsdt.base,\"aGR\",\"progbits\",.stapsdt.base,comdat\n",
                    "     .weak _.stapsdt.base\n",
                    "     .hidden _.stapsdt.base\n",
                    "_.stapsdt.base: .space 1\n",
                    "     .size _.stapsdt.base, 1\n",
                    "     .popsection\n",
                    ".endif\n",
                ),
                $(in($reg) $crate::probes::site::UsdtArg::reg($arg),)*
                options(readonly, preserves_flags, att_syntax),
            )
        }
    };
}

/// Emits one USDT site through the `probe` crate (a single `nop`; never optimized).
#[cfg(not(target_arch = "x86_64"))]
macro_rules! usdt {
    ($provider:ident, $name:ident $(, $arg:expr)* $(,)?) => {
        ::probe::probe!($provider, $name $(, $arg)*)
    };
}

pub(crate) use usdt;

/// An integer probe argument, widened to the 8-byte register the note describes (`-8@%reg`).
pub(crate) trait UsdtArg {
    fn reg(self) -> u64;
}

impl UsdtArg for u64 {
    fn reg(self) -> u64 {
        self
    }
}

impl UsdtArg for u32 {
    fn reg(self) -> u64 {
        u64::from(self)
    }
}

impl UsdtArg for i64 {
    fn reg(self) -> u64 {
        self.cast_unsigned()
    }
}
