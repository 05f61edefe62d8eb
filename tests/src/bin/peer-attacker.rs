//! A scripted attacker against kvnode's peer channel, holding no cluster key (tests only;
//! driven by tests/tests/peer_attack.rs). Prints what it saw as `key=value` lines.
//!
//! ```text
//! peer-attacker relay  LISTEN TO [REWRITE_DIALLED]   one destination, relayed to TO
//! peer-attacker forge  TO DIALLED KEY_ID_HEX         a forged proof sent to a keyed source
//! peer-attacker proxy  LISTEN TO MODE [RECORD_FILE]  on-path proxy (pass, flip-payload,
//!                                                    flip-header, drop, swap, replay,
//!                                                    flip-header-up: destination to source,
//!                                                    trickle: one byte every 600 ms)
//! peer-attacker ucx-steal RECORD_FILE                what a UCX offer and slots read from a
//!                                                    recording give: GET, PUT (ucxsteal.rs)
//! peer-attacker ucx-forge PID OWN_PORTS ADDR LEN     a forged worker address to the daemon's
//!                                                    UCX ports, one GET of LEN at hex ADDR
//!                                                    (ucxforge.rs)
//! ```
//! `relay` and `proxy` print `listening` once bound.

use std::io::Write;
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

use kvnode_e2e::peerwire::{Tamper, forge, proxy, relay};

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize| a.get(i).map(String::as_str);
    let usage = || -> ! {
        eprintln!(
            "usage: peer-attacker relay LISTEN TO [DIALLED] | forge TO DIALLED KEY_ID | proxy LISTEN TO MODE [FILE] | ucx-steal FILE | ucx-forge PID OWN_PORTS ADDR LEN"
        );
        std::process::exit(2)
    };
    let report = match arg(0) {
        Some("relay") => {
            let (Some(listen), Some(to)) = (arg(1), arg(2)) else {
                usage()
            };
            let l = TcpListener::bind(listen).expect("bind");
            println!("listening");
            std::io::stdout().flush().unwrap();
            relay(&l, to, arg(3))
        }
        Some("forge") => {
            let (Some(to), Some(dialled), Some(id)) = (arg(1), arg(2), arg(3)) else {
                usage()
            };
            let id = u64::from_str_radix(id, 16).unwrap_or_else(|_| usage());
            forge(to, dialled, id)
        }
        Some("proxy") => {
            let (Some(listen), Some(to), Some(mode)) = (arg(1), arg(2), arg(3)) else {
                usage()
            };
            let mode = Tamper::parse(mode).unwrap_or_else(|| usage());
            let l = TcpListener::bind(listen).expect("bind");
            let rec = arg(4).map(|f| (f.to_owned(), Arc::new(Mutex::new(Vec::new()))));
            if let Some((file, buf)) = rec.clone() {
                // Flush what was recorded every 100 ms (the test reads the file).
                std::thread::spawn(move || {
                    loop {
                        std::thread::sleep(std::time::Duration::from_millis(100));
                        let b = buf.lock().unwrap().clone();
                        let _ = std::fs::write(&file, b);
                    }
                });
            }
            println!("listening");
            std::io::stdout().flush().unwrap();
            proxy(&l, to, mode, rec.as_ref().map(|r| &r.1))
        }
        Some("ucx-steal") => {
            let Some(file) = arg(1) else { usage() };
            let r = kvnode_e2e::ucxsteal::steal(&std::fs::read(file).expect("read the recording"));
            for line in r.0 {
                println!("{line}");
            }
            return;
        }
        Some("ucx-forge") => {
            let (Some(pid), Some(own), Some(addr), Some(len)) = (arg(1), arg(2), arg(3), arg(4))
            else {
                usage()
            };
            let own: Vec<u16> = own.split(',').filter_map(|p| p.parse().ok()).collect();
            let addr =
                u64::from_str_radix(addr.trim_start_matches("0x"), 16).unwrap_or_else(|_| usage());
            let len = len.parse().unwrap_or_else(|_| usage());
            for line in kvnode_e2e::ucxforge::attack(pid, &own, addr, len).0 {
                println!("{line}");
            }
            return;
        }
        _ => usage(),
    };
    for line in report.0 {
        println!("{line}");
    }
}
