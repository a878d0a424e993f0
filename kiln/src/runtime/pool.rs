//! kiln's own thread pool for the CPU's kernels, and the rule for when a
//! kernel may use it.

/// kiln's own thread pool for the CPU's kernels (all cores, or
/// `RAYON_NUM_THREADS`), apart from rayon's global pool.
///
/// Why a pool of its own: its threads only ever run pieces of kernels,
/// which take no lock and wait for nothing but each other. A thread that
/// holds a kernel's storage locks and waits for the pieces therefore always
/// sees them finish. In a shared pool, a worker waiting for its pieces
/// runs other queued jobs meanwhile; one that writes a storage it is
/// reading (a user's `par_iter` doing `a.assign(..)` beside `a.matmul(..)`)
/// would wait on its own lock forever, and every worker blocked on a lock
/// held by a thread waiting for the pool would stall it.
fn pool() -> Option<&'static rayon::ThreadPool> {
    static POOL: std::sync::OnceLock<Option<rayon::ThreadPool>> = std::sync::OnceLock::new();
    POOL.get_or_init(|| rayon::ThreadPoolBuilder::new().thread_name(|i| format!("kiln-cpu-{i}")).build().ok()).as_ref()
}

/// Runs `f` on kiln's pool, where rayon's parallel iterators and gemm's
/// `Parallelism::Rayon` inside it spread their work; the calling thread
/// waits without running anything else. Kernels call it only with the
/// locks they need already taken, and with `threads() > 1`.
pub(crate) fn on_pool<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    match pool() {
        Some(p) => p.install(f),
        None => f(),
    }
}

/// Threads a CPU kernel started on this thread may use: the pool's, or 1
/// on a thread that is itself a worker of some rayon pool (a user's
/// `par_iter` already spreads the work; PyTorch's `parallel_for` runs
/// serially inside a parallel region for the same reason, and a kernel
/// waiting there would let the worker run other jobs while it holds its
/// locks) and in a child process made by `fork`, where the pool's threads
/// do not exist.
#[inline]
pub(crate) fn threads() -> usize {
    if rayon::current_thread_index().is_some() || crate::runtime::fork::in_child() {
        return 1;
    }
    size()
}

/// Threads of kiln's pool (looked up once).
pub(crate) fn size() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(|| pool().map_or(1, |p| p.current_num_threads()))
}
