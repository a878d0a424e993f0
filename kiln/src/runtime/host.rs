//! Facts about the host from the `sysinfo` crate, so that they are found on
//! Linux, macOS and Windows alike (kiln read `/proc/meminfo` and
//! `/proc/cpuinfo` by hand before, which only Linux has). Each answer is
//! `None` where the OS does not tell.

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
