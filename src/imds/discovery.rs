//! Endpoint discovery for VMs outside a VNet (classic VMs, Cloud Services), as Azure's
//! non-VNet sample does it: the host's address comes from DHCP option 245 in the lease files,
//! and the metadata service answers on that address instead of 169.254.169.254.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

/// Where the usual DHCP clients keep their leases: dhclient (Debian, Ubuntu, RHEL),
/// NetworkManager, systemd-networkd and wicked (SUSE).
pub const DEFAULT_LEASE_PATHS: &[&str] = &[
    "/var/lib/dhcp",
    "/var/lib/dhclient",
    "/var/lib/NetworkManager",
    "/run/systemd/netif/leases",
    "/var/lib/wicked",
];

/// Option 245 in one lease file's text; the last one wins, as later leases are appended.
/// Understands dhclient's `option unknown-245 a8:3f:81:10;` and networkd's `OPTION_245=a83f8110`.
pub fn lease_option_245(text: &str) -> Option<Ipv4Addr> {
    text.lines()
        .filter_map(|line| {
            let line = line.trim();
            if let Some(rest) = line.strip_prefix("option unknown-245") {
                let hex: String = rest
                    .trim()
                    .trim_end_matches(';')
                    .split(':')
                    .map(|byte| format!("{:0>2}", byte.trim()))
                    .collect();
                return hex_to_ipv4(&hex);
            }
            line.strip_prefix("OPTION_245=").and_then(hex_to_ipv4)
        })
        .next_back()
}

fn hex_to_ipv4(hex: &str) -> Option<Ipv4Addr> {
    let value = u32::from_str_radix(hex.trim().trim_matches('"'), 16).ok()?;
    (hex.trim().len() == 8).then(|| Ipv4Addr::from(value))
}

/// Searches lease files (or directories of them) for option 245; the most recently modified
/// file that has it wins. Returns the address and the file it came from.
pub fn discover_endpoint(paths: &[PathBuf]) -> Option<(Ipv4Addr, PathBuf)> {
    let mut files: Vec<(std::time::SystemTime, PathBuf)> = Vec::new();
    for path in paths {
        collect_files(path, &mut files);
    }
    files.sort_by_key(|(modified, _)| std::cmp::Reverse(*modified));
    files.into_iter().find_map(|(_, file)| {
        let text = std::fs::read_to_string(&file).ok()?;
        lease_option_245(&text).map(|address| (address, file))
    })
}

fn collect_files(path: &Path, files: &mut Vec<(std::time::SystemTime, PathBuf)>) {
    let Ok(metadata) = std::fs::metadata(path) else {
        return;
    };
    if metadata.is_dir() {
        if let Ok(entries) = std::fs::read_dir(path) {
            for entry in entries.flatten() {
                let child = entry.path();
                if child.is_file() {
                    collect_files(&child, files);
                }
            }
        }
    } else if let Ok(modified) = metadata.modified() {
        files.push((modified, path.to_path_buf()));
    }
}

/// The metadata service's base URL: as configured, or for `"discover"` the address in
/// a DHCP lease's option 245 (VMs outside a VNet), else the usual 169.254.169.254.
pub fn resolve_endpoint(config: &super::ImdsConfig) -> url::Url {
    let fallback = || url::Url::parse("http://169.254.169.254").expect("a valid URL");
    if config.endpoint != "discover" {
        return url::Url::parse(&config.endpoint).expect("validated by Config::validate");
    }
    match discover_endpoint(&config.lease_paths) {
        Some((address, lease)) => {
            tracing::info!(address = %address, lease = %lease.display(), "Discovered the metadata endpoint from DHCP option 245");
            url::Url::parse(&format!("http://{address}")).unwrap_or_else(|_| fallback())
        }
        None => {
            tracing::warn!(searched = ?config.lease_paths, "No DHCP lease with option 245 found; using 169.254.169.254");
            fallback()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dhclient_and_networkd_leases_yield_the_host_address() {
        let dhclient = "lease {\n  interface \"eth0\";\n  option unknown-245 a8:3f:81:10;\n}\n\
                        lease {\n  option unknown-245 a8:3f:81:11;\n}\n";
        assert_eq!(
            lease_option_245(dhclient),
            Some(Ipv4Addr::new(168, 63, 129, 17))
        );
        assert_eq!(
            lease_option_245("ADDRESS=10.0.0.4\nOPTION_245=a83f8110\n"),
            Some(Ipv4Addr::new(168, 63, 129, 16))
        );
        // dhclient drops leading zeros of a byte.
        assert_eq!(
            lease_option_245("option unknown-245 a:0:0:1;"),
            Some(Ipv4Addr::new(10, 0, 0, 1))
        );
        assert_eq!(lease_option_245("option routers 10.0.0.1;"), None);
    }

    #[test]
    fn discovery_reads_lease_directories_and_skips_files_without_the_option() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("other.lease"), "option routers 10.0.0.1;").unwrap();
        std::fs::write(
            dir.path().join("dhclient.eth0.leases"),
            "option unknown-245 a8:3f:81:10;",
        )
        .unwrap();
        let (address, file) = discover_endpoint(&[dir.path().to_path_buf()]).unwrap();
        assert_eq!(address, Ipv4Addr::new(168, 63, 129, 16));
        assert!(file.ends_with("dhclient.eth0.leases"));
        assert_eq!(discover_endpoint(&[dir.path().join("missing")]), None);
    }
}
