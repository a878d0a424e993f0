//! Facts about the host from the `sysinfo` crate, so that they are found on
//! Linux, macOS and Windows alike (kiln read `/proc/meminfo` and
//! `/proc/cpuinfo` by hand before, which only Linux has). Each answer is
//! `None` where the OS does not tell.

use crate::base::error::HostLimit;
use sysinfo::{CpuRefreshKind, MemoryRefreshKind, System};

/// The host's RAM in bytes (all of it, not a container's limit).
pub(crate) fn host_memory_total() -> Option<usize> {
    memory(|s| s.total_memory())
}

/// Host memory the OS could give without swapping, in bytes.
pub(crate) fn host_memory_available() -> Option<usize> {
    memory(|s| s.available_memory())
}

fn memory(read: impl Fn(&System) -> u64) -> Option<usize> {
    let mut sys = System::new();
    sys.refresh_memory_specifics(MemoryRefreshKind::nothing().with_ram());
    // sysinfo reports 0 on a system it does not know.
    usize::try_from(read(&sys)).ok().filter(|&b| b > 0)
}

/// The limit that most likely refused a host allocation of `requested`
/// bytes: the first of the process's address-space limit, its data limit
/// and its control group's limit that the allocation would cross, else the
/// machine. Read from the OS when an allocation has failed (never on the
/// way of one that succeeds).
pub(crate) fn refusing_limit(requested: usize) -> HostLimit {
    #[cfg(target_os = "linux")]
    {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let kb = |key: &str| -> Option<usize> {
            let line = status.lines().find(|l| l.starts_with(key))?;
            line[key.len()..].trim().trim_end_matches("kB").trim().parse::<usize>().ok().map(|v| v.saturating_mul(1024))
        };
        let crosses = |used: usize, limit: usize| used.saturating_add(requested) > limit;
        if let Some(limit) = rlimit(libc::RLIMIT_AS) {
            let mapped = kb("VmSize:").unwrap_or(0);
            if crosses(mapped, limit) {
                return HostLimit::AddressSpace { limit, mapped };
            }
        }
        if let Some(limit) = rlimit(libc::RLIMIT_DATA) {
            let used = kb("VmData:").unwrap_or(0);
            if crosses(used, limit) {
                return HostLimit::Data { limit, used };
            }
        }
        if let Some((path, limit, used)) = cgroup_limit()
            && crosses(used, limit)
        {
            return HostLimit::Cgroup { path, limit, used };
        }
    }
    HostLimit::Machine { total: host_memory_total().unwrap_or(0), available: host_memory_available().unwrap_or(0) }
}

/// `OutOfMemory` for `requested` bytes of host memory that the OS refused
/// to `device` (the CPU, or a simulated GPU's host RAM), with `in_use`
/// bytes booked by kiln there, naming the limit that refused it.
pub(crate) fn host_out_of_memory(device: crate::Device, requested: usize, in_use: usize) -> crate::Error {
    let limit = refusing_limit(requested);
    let capacity = match &limit {
        HostLimit::AddressSpace { limit, .. } | HostLimit::Data { limit, .. } | HostLimit::Cgroup { limit, .. } => *limit,
        HostLimit::Machine { total, .. } => *total,
    };
    crate::Error::OutOfMemory { device, requested, in_use, capacity, limit: Some(limit) }
}

/// A resource limit's soft value, None when unlimited.
#[cfg(target_os = "linux")]
fn rlimit(resource: libc::__rlimit_resource_t) -> Option<usize> {
    let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct we pass.
    if unsafe { libc::getrlimit(resource, &mut l) } != 0 || l.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    usize::try_from(l.rlim_cur).ok()
}

/// (file, limit, usage) of the process's memory cgroup, v2 or v1, when it
/// has a limit.
#[cfg(target_os = "linux")]
fn cgroup_limit() -> Option<(String, usize, usize)> {
    let groups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let read = |p: &str| std::fs::read_to_string(p).ok().and_then(|v| v.trim().parse::<usize>().ok());
    for line in groups.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let (root, max, current) = if controllers.is_empty() {
            ("/sys/fs/cgroup", "memory.max", "memory.current")
        } else if controllers.split(',').any(|c| c == "memory") {
            ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes")
        } else {
            continue;
        };
        // Inside a container the group's own path may not be visible: its
        // files are then at the root of the mount.
        for dir in [format!("{root}{path}"), root.to_string()] {
            let file = format!("{}/{max}", dir.trim_end_matches('/'));
            if let (Some(limit), Some(used)) = (read(&file), read(&format!("{}/{current}", dir.trim_end_matches('/')))) {
                // v1 reports "no limit" as a huge number (a page-rounded i64::MAX).
                if limit < (1usize << 62) {
                    return Some((file, limit, used));
                }
            }
        }
    }
    None
}

/// The CPU's model name (`AMD EPYC 7B13`), looked up once.
pub(crate) fn cpu_name() -> Option<String> {
    static NAME: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    NAME.get_or_init(|| {
        let mut sys = System::new();
        sys.refresh_cpu_list(CpuRefreshKind::nothing());
        sys.cpus().first().map(|c| c.brand().trim().to_string()).filter(|b| !b.is_empty())
    })
    .clone()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_host_reports_its_memory_and_cpu() {
        // Every OS sysinfo supports answers; this one runs the tests.
        let total = super::host_memory_total().expect("total memory");
        let available = super::host_memory_available().expect("available memory");
        assert!(available <= total, "{available} available of {total}");
        assert!(total >= 64 << 20, "a host with {total} bytes of RAM");
        let name = super::cpu_name().expect("a CPU name");
        assert!(!name.is_empty());
    }
}
