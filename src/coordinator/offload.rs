//! The state store's blocking calls (a redb commit and its fsync, a round of KV writes)
//! made from the engine's loop without holding up the runtime: on a worker of the
//! multi-thread runtime the call runs in place while the runtime hands this worker's other
//! tasks (the input, publications, drains, the lease's renewals) to other threads.

/// Runs `f`, which blocks, so that the runtime's other tasks go on meanwhile.
pub fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}
