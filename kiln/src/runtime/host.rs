//! Facts about the host machine: its memory, as the OS reports it.

/// Host memory installed.
pub(crate) fn host_memory_total() -> Option<usize> {
    meminfo("MemTotal:")
}

/// Host memory the OS could give without swapping.
pub(crate) fn host_memory_available() -> Option<usize> {
    meminfo("MemAvailable:")
}

/// One field of /proc/meminfo, in bytes, where the OS reports it.
fn meminfo(key: &str) -> Option<usize> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace().nth(1)?.parse::<usize>().ok().map(|kb| kb * 1024)
}
