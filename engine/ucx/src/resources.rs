//! Which UCT transports a context would use, and whether each one enforces memory keys in
//! hardware.
//!
//! A one-sided GET is only as safe as the transport that serves it. Over InfiniBand/RoCE
//! (`rc_verbs`, `rc_mlx5`, `dc_mlx5`) the target's NIC checks every RDMA READ against the
//! registration's key and bounds and refuses anything else; the target's CPU never sees it.
//! Every other transport serves RMA in software inside the target's UCX worker: over `tcp`
//! the worker reads or writes whatever address a connected peer names, whatever key it
//! presents (every TCP key packs to the same constant bytes), and an unmapped address
//! crashes the target. Shared-memory transports (`sysv`, `posix`, `cma`, `knem`, `xpmem`)
//! are the same for local processes. [`Resource::enforces_keys_in_hardware`] is the one
//! place that tells them apart.
//!
//! `ud_verbs` / `ud_mlx5` have no RMA of their own: UCX uses them to wire up RC endpoints
//! (they reach only the InfiniBand/RoCE fabric) and would emulate RMA over them in software
//! only where no RC/DC lane exists, which [`Resources::check_hardware_rma`] refuses.

use std::ffi::c_char;
use std::fmt;

use crate::context::Context;
use crate::error::UcxError;
use crate::sys;

/// Transports whose RMA the NIC checks against the memory key: what a production daemon
/// may expose its memory over.
const HARDWARE_RMA: &[&str] = &["rc_verbs", "rc_mlx5", "dc_mlx5"];
/// Verbs transports without RMA, accepted beside a hardware-RMA one (connection wire-up).
const VERBS_WIREUP: &[&str] = &["ud_verbs", "ud_mlx5"];

/// The `UCX_TLS` a context gets when nothing else is asked for and only hardware-checked
/// RMA is acceptable: the verbs transports above and `self` (this process only).
pub const HARDWARE_TLS: &str = "rc_verbs,rc_mlx5,dc_mlx5,ud_verbs,ud_mlx5,self";

/// One transport on one device (`tcp` on `lo`, `rc_mlx5` on `mlx5_0:1`, ...).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resource {
    /// The UCT transport name.
    pub transport: String,
    /// The device it runs on.
    pub device: String,
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.transport, self.device)
    }
}

impl Resource {
    /// Whether remote memory access over this transport is checked by the NIC against the
    /// registration's key (or, for `self`, never leaves this process).
    pub fn enforces_keys_in_hardware(&self) -> bool {
        HARDWARE_RMA.contains(&self.transport.as_str()) || self.transport == "self"
    }

    fn verbs_wireup(&self) -> bool {
        VERBS_WIREUP.contains(&self.transport.as_str())
    }
}

/// Every transport a context selected (`ucp_context_print_info`'s resource lines).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resources(pub Vec<Resource>);

impl Resources {
    /// Parses the resource lines of `ucp_context_print_info`
    /// (`#      resource 1  :  md 0  dev 1  flags -- tcp/lo`).
    pub fn parse(text: &str) -> Self {
        let list = text
            .lines()
            .filter(|l| l.trim_start_matches(['#', ' ']).starts_with("resource"))
            .filter_map(|l| l.rsplit_once("--"))
            .filter_map(|(_, tail)| tail.trim().split_once('/'))
            .map(|(t, d)| Resource {
                transport: t.to_owned(),
                device: d.to_owned(),
            })
            .collect();
        Self(list)
    }

    /// `Ok` when every transport enforces memory keys in hardware (UD beside one that
    /// does, for wire-up); otherwise the transports that would serve RMA in software.
    pub fn check_hardware_rma(&self) -> Result<(), Vec<Resource>> {
        let hardware = self
            .0
            .iter()
            .any(|r| HARDWARE_RMA.contains(&r.transport.as_str()));
        let soft: Vec<Resource> = self
            .0
            .iter()
            .filter(|r| !(r.enforces_keys_in_hardware() || (hardware && r.verbs_wireup())))
            .cloned()
            .collect();
        if hardware && soft.is_empty() {
            Ok(())
        } else {
            Err(soft)
        }
    }
}

impl Context {
    /// The transports (and devices) this context selected, read from
    /// `ucp_context_print_info`.
    pub fn resources(&self) -> Result<Resources, UcxError> {
        let mut buf: *mut c_char = std::ptr::null_mut();
        let mut len: libc::size_t = 0;
        // SAFETY: out-pointers to locals; the stream is closed below before `buf` is read.
        let f = unsafe { libc::open_memstream(&raw mut buf, &raw mut len) };
        if f.is_null() {
            return Err(UcxError::Invalid(format!(
                "open_memstream: {}",
                std::io::Error::last_os_error()
            )));
        }
        // SAFETY: the context is live; `f` is a valid stream (libc's FILE is the same type
        // as the binding's opaque `FILE`).
        unsafe { sys::ucp_context_print_info(self.ctx.0, f.cast()) };
        // SAFETY: closed once; afterwards `buf` holds `len` bytes (NUL-terminated).
        unsafe { libc::fclose(f) };
        if buf.is_null() {
            return Ok(Resources(Vec::new()));
        }
        // SAFETY: open_memstream wrote `len` bytes at `buf`; freed right after the copy.
        let text = String::from_utf8_lossy(unsafe {
            std::slice::from_raw_parts(buf.cast::<u8>().cast_const(), len)
        })
        .into_owned();
        // SAFETY: allocated by open_memstream with malloc.
        unsafe { libc::free(buf.cast()) };
        Ok(Resources::parse(&text))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TCP: &str = "#\n# UCP context\n#\n#     component 1  :  tcp\n#\n#            md 0  :  component 1  tcp \n#\n#      resource 0  :  md 0  dev 0  flags -- tcp/eth0\n#      resource 1  :  md 0  dev 1  flags -- tcp/lo\n#\n";

    fn r(list: &[&str]) -> Resources {
        Resources(
            list.iter()
                .map(|s| {
                    let (t, d) = s.split_once('/').unwrap();
                    Resource {
                        transport: t.into(),
                        device: d.into(),
                    }
                })
                .collect(),
        )
    }

    #[test]
    fn print_info_resource_lines_are_parsed_and_nothing_else() {
        assert_eq!(Resources::parse(TCP), r(&["tcp/eth0", "tcp/lo"]));
        assert_eq!(Resources::parse("# component 0 : self\n"), r(&[]));
    }

    #[test]
    fn tcp_and_shared_memory_are_software_rma() {
        let e = r(&["self/memory0", "tcp/lo", "sysv/memory", "cma/memory"])
            .check_hardware_rma()
            .unwrap_err();
        assert_eq!(e, r(&["tcp/lo", "sysv/memory", "cma/memory"]).0);
    }

    #[test]
    fn verbs_rc_and_dc_pass_with_ud_for_wireup_but_ud_alone_does_not() {
        assert!(
            r(&["rc_mlx5/mlx5_0:1", "ud_mlx5/mlx5_0:1", "self/memory0"])
                .check_hardware_rma()
                .is_ok()
        );
        assert!(r(&["dc_mlx5/mlx5_0:1"]).check_hardware_rma().is_ok());
        assert_eq!(
            r(&["ud_verbs/mlx5_0:1"]).check_hardware_rma().unwrap_err(),
            r(&["ud_verbs/mlx5_0:1"]).0
        );
        assert!(r(&["self/memory0"]).check_hardware_rma().is_err());
        assert!(
            r(&["rc_verbs/mlx5_0:1", "tcp/ib0"])
                .check_hardware_rma()
                .is_err()
        );
    }

    #[test]
    fn a_tcp_context_reports_its_tcp_resources() {
        let ctx = Context::with_settings(&[("TLS", "tcp"), ("NET_DEVICES", "lo")]).unwrap();
        let res = ctx.resources().unwrap();
        assert_eq!(res, r(&["tcp/lo"]));
        assert!(res.check_hardware_rma().is_err());
    }
}
