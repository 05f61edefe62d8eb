//! From what `[peer]` asks ([`UcxAsked`], built by `PeerConfig::ucx_asked`) to how UCX
//! starts ([`UcxSetup`]): which transports may carry remote memory access, and on which
//! network device software RMA is confined.
//!
//! The rule (issue 38, item 1): UCX exposes the arena only over transports whose NIC checks
//! the memory key, unless `ucx_insecure_software_rma` says the network is trusted; then UCX
//! listens and connects only on the peer interface (`ucx_net_devices`, else the interface
//! holding the `listen` address, else the `advertise` address, else those holding the
//! `peers` entries), never on every NIC. A
//! daemon without a peer listener starts no serving worker and exposes nothing.

use std::ffi::CStr;
use std::net::IpAddr;

use kvnode_proto::hint::Endpoint;

use super::ucx::{UcxExposure, UcxSetup};
use crate::peer::error::UcxSetupError;

/// What `[peer]` asks of UCX (`PeerConfig::ucx_asked`).
#[derive(Clone, Copy, Debug, Default)]
pub struct UcxAsked<'a> {
    /// `ucx_gets_in_flight`.
    pub window: u32,
    /// `ucx_insecure_software_rma`.
    pub insecure_software_rma: bool,
    /// `ucx_net_devices`.
    pub net_devices: Option<&'a str>,
    /// `listen`.
    pub listen: Option<&'a str>,
    /// `advertise`.
    pub advertise: Option<&'a str>,
    /// `peers`.
    pub peers: &'a [String],
}

impl UcxSetup {
    /// The setup `a` asks for; an error says what to configure.
    pub fn resolve(a: &UcxAsked<'_>) -> Result<Self, UcxSetupError> {
        let exposure = if a.insecure_software_rma {
            UcxExposure::TrustedNetwork {
                net_devices: net_devices(a)?,
            }
        } else {
            UcxExposure::HardwareOnly
        };
        Ok(Self {
            window: a.window as usize,
            exposure,
            serve: a.listen.is_some(),
        })
    }
}

/// The device list software RMA is confined to.
fn net_devices(a: &UcxAsked<'_>) -> Result<String, UcxSetupError> {
    if let Some(d) = a.net_devices {
        return Ok(d.to_owned());
    }
    let own = [a.listen, a.advertise]
        .into_iter()
        .flatten()
        .find_map(specific_ip);
    if let Some(ip) = own {
        return interface_of(ip).ok_or(UcxSetupError::NoInterface(ip));
    }
    // A daemon that only dials: the interfaces whose networks hold its listed peers.
    let mut devs: Vec<String> = Vec::new();
    for ip in a.peers.iter().filter_map(|p| peer_ip(p)) {
        let d = interface_of(ip).ok_or(UcxSetupError::NoNetworkFor(ip))?;
        if !devs.contains(&d) {
            devs.push(d);
        }
    }
    if devs.is_empty() {
        return Err(UcxSetupError::NoAddress);
    }
    Ok(devs.join(","))
}

/// The address a `--peers` entry names (`tcp://HOST:PORT` or a CIDR's network address).
fn peer_ip(p: &str) -> Option<IpAddr> {
    match p.split_once('/') {
        Some((a, _)) if !p.starts_with("tcp://") => a.parse().ok(),
        _ => specific_ip(p),
    }
}

/// The address of `HOST:PORT` or `tcp://HOST:PORT` when it is a specific IP (no wildcard).
fn specific_ip(a: &str) -> Option<IpAddr> {
    let bare = a.strip_prefix("tcp://").unwrap_or(a);
    let ip = match bare.parse::<std::net::SocketAddr>() {
        Ok(sa) => sa.ip(),
        Err(_) => Endpoint::parse(&format!("tcp://{bare}")).ok()?.ip()?,
    };
    (!ip.is_unspecified()).then_some(ip)
}

/// The name of the interface whose network holds `ip` (`lo` for any 127.0.0.0/8 address).
pub fn interface_of(ip: IpAddr) -> Option<String> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: out-pointer to a local; freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&raw mut head) } != 0 {
        return None;
    }
    let mut found = None;
    let mut at = head;
    while !at.is_null() && found.is_none() {
        // SAFETY: a node of the list getifaddrs returned, alive until freeifaddrs.
        let i = unsafe { &*at };
        at = i.ifa_next;
        // SAFETY: each pointer is NULL or points at a sockaddr of the family it says.
        let (addr, mask) = unsafe { (sockaddr_ip(i.ifa_addr), sockaddr_ip(i.ifa_netmask)) };
        if let (Some(a), Some(m)) = (addr, mask)
            && same_network(ip, a, m)
        {
            // SAFETY: ifa_name is a NUL-terminated string owned by the list.
            found = Some(
                unsafe { CStr::from_ptr(i.ifa_name) }
                    .to_string_lossy()
                    .into_owned(),
            );
        }
    }
    // SAFETY: the list getifaddrs returned, freed once.
    unsafe { libc::freeifaddrs(head) };
    found
}

/// The IP a `sockaddr` holds, for IPv4 and IPv6.
///
/// # Safety
/// `sa` is NULL or points at a valid sockaddr of the family it names.
unsafe fn sockaddr_ip(sa: *const libc::sockaddr) -> Option<IpAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: the caller's guarantee; the family says which struct it is.
    unsafe {
        match i32::from((*sa).sa_family) {
            libc::AF_INET => {
                let v4 = sa.cast::<libc::sockaddr_in>().read_unaligned();
                Some(IpAddr::from(u32::from_be(v4.sin_addr.s_addr).to_be_bytes()))
            }
            libc::AF_INET6 => {
                let v6 = sa.cast::<libc::sockaddr_in6>().read_unaligned();
                Some(IpAddr::from(v6.sin6_addr.s6_addr))
            }
            _ => None,
        }
    }
}

fn same_network(ip: IpAddr, addr: IpAddr, mask: IpAddr) -> bool {
    match (ip, addr, mask) {
        (IpAddr::V4(i), IpAddr::V4(a), IpAddr::V4(m)) => {
            let m = u32::from(m);
            u32::from(i) & m == u32::from(a) & m
        }
        (IpAddr::V6(i), IpAddr::V6(a), IpAddr::V6(m)) => {
            let m = u128::from(m);
            u128::from(i) & m == u128::from(a) & m
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg<'a>(listen: Option<&'a str>, advertise: Option<&'a str>, trusted: bool) -> UcxAsked<'a> {
        UcxAsked {
            window: 16,
            insecure_software_rma: trusted,
            listen,
            advertise,
            ..UcxAsked::default()
        }
    }

    #[test]
    fn loopback_addresses_are_on_lo() {
        assert_eq!(
            interface_of("127.0.0.1".parse().unwrap()).as_deref(),
            Some("lo")
        );
        assert_eq!(
            interface_of("127.4.5.6".parse().unwrap()).as_deref(),
            Some("lo")
        );
        assert_eq!(interface_of("198.51.100.77".parse().unwrap()), None);
    }

    #[test]
    fn the_default_exposes_only_hardware_checked_rma_and_serves_only_with_a_listener() {
        let s = UcxSetup::resolve(&cfg(None, None, false)).unwrap();
        assert_eq!(s.exposure, UcxExposure::HardwareOnly);
        assert!(!s.serve);
        assert!(
            UcxSetup::resolve(&cfg(Some("0.0.0.0:7000"), None, false))
                .unwrap()
                .serve
        );
    }

    #[test]
    fn software_rma_is_confined_to_the_peer_interface_or_refused() {
        let s = UcxSetup::resolve(&cfg(Some("127.0.0.1:0"), None, true)).unwrap();
        assert_eq!(
            s.exposure,
            UcxExposure::TrustedNetwork {
                net_devices: "lo".into()
            }
        );
        let s = UcxSetup::resolve(&cfg(
            Some("0.0.0.0:7000"),
            Some("tcp://127.0.0.9:7000"),
            true,
        ))
        .unwrap();
        assert!(
            matches!(s.exposure, UcxExposure::TrustedNetwork { net_devices } if net_devices == "lo")
        );
        let e = UcxSetup::resolve(&cfg(Some("0.0.0.0:7000"), None, true)).unwrap_err();
        assert_eq!(e, UcxSetupError::NoAddress, "{e}");
        let e = UcxSetup::resolve(&cfg(None, None, true)).unwrap_err();
        assert_eq!(e, UcxSetupError::NoAddress, "{e}");
        let peers = ["tcp://127.0.0.1:7000".to_owned(), "127.0.0.0/8".to_owned()];
        let dialler = UcxAsked {
            peers: &peers,
            ..cfg(None, None, true)
        };
        assert!(matches!(
            UcxSetup::resolve(&dialler).unwrap().exposure,
            UcxExposure::TrustedNetwork { net_devices } if net_devices == "lo"
        ));
        let named = UcxAsked {
            net_devices: Some("eth1"),
            ..cfg(None, None, true)
        };
        assert!(matches!(
            UcxSetup::resolve(&named).unwrap().exposure,
            UcxExposure::TrustedNetwork { net_devices } if net_devices == "eth1"
        ));
    }
}
