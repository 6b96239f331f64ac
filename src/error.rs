//! The crate's one error type.

use std::fmt;

/// Which pool or allocator an error concerns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PoolKind {
    /// Page-locked host memory.
    Pinned,
    /// Device memory.
    Device,
    /// A pool outside the manager (tests, user pools).
    Standalone,
    /// Managed (unified) memory, reachable from the host and kernels.
    Managed,
}

impl fmt::Display for PoolKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PoolKind::Pinned => "pinned",
            PoolKind::Device => "device",
            PoolKind::Standalone => "standalone",
            PoolKind::Managed => "managed",
        })
    }
}

/// A pool's state at the moment an allocation failed, carried by
/// [`Error::OutOfMemory`] so the message says what was free and why it did
/// not fit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OomState {
    /// Bytes handed out to live allocations.
    pub in_use: usize,
    /// Bytes reserved from the upstream but not in use (cached).
    pub reserved_free: usize,
    /// The largest free block.
    pub largest_free: usize,
    /// The pool's size limit, if one is set.
    pub limit: Option<usize>,
    /// The device's free memory as the driver reports it, if known.
    pub device_free: Option<usize>,
    /// What the upstream said when it refused, if it did.
    pub upstream: Option<String>,
    /// Advice that applies to this failure, if any.
    pub hint: Option<&'static str>,
    /// The device whose memory ran out, for a request on a known device.
    pub device: Option<usize>,
}

/// Everything that can go wrong in cumem.
///
/// # Examples
/// ```
/// use cumem::{Error, MemoryManager};
/// let mm = MemoryManager::global()?;
/// match mm.allocate_pinned(0) {
///     Err(Error::InvalidSize { size: 0, .. }) => {}
///     other => panic!("expected InvalidSize, got {other:?}"),
/// }
/// # Ok::<(), cumem::Error>(())
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The pool could not satisfy a request, even after releasing cached memory.
    #[error("out of memory in the {pool} pool: requested {requested} B; {state}")]
    OutOfMemory {
        /// Which pool.
        pool: PoolKind,
        /// The request, in bytes.
        requested: usize,
        /// The pool's state when it failed.
        state: Box<OomState>,
    },
    /// A size of zero, or too large to represent once rounded.
    #[error("invalid size {size} B: {reason}")]
    InvalidSize {
        /// The size asked for.
        size: usize,
        /// Why it is invalid.
        reason: &'static str,
    },
    /// An alignment that is not a power of two or larger than supported.
    #[error("invalid alignment {align}: alignments must be powers of two no larger than {max}")]
    InvalidAlignment {
        /// The alignment asked for.
        align: usize,
        /// The largest supported alignment.
        max: usize,
    },
    /// A pointer this pool never handed out.
    #[error("pointer {addr:#x} was not allocated by the {pool} pool")]
    UnknownPointer {
        /// Which pool.
        pool: PoolKind,
        /// The address.
        addr: usize,
    },
    /// A pointer inside a block rather than at its start.
    #[error("pointer {addr:#x} points inside the {pool} block at {block:#x} ({size} B), not at its start")]
    InteriorPointer {
        /// Which pool.
        pool: PoolKind,
        /// The address.
        addr: usize,
        /// The start of the block it points into.
        block: usize,
        /// That block's size.
        size: usize,
    },
    /// A block freed a second time.
    #[error("double free of {addr:#x} in the {pool} pool: the block is already free")]
    DoubleFree {
        /// Which pool.
        pool: PoolKind,
        /// The address.
        addr: usize,
    },
    /// `MemoryManager::init` after the manager was initialised.
    #[error("the memory manager is already initialised; call init() once, before first use")]
    AlreadyInitialized,
    /// A setting changed after the moment it can be changed has passed.
    #[error("{what} can no longer be changed: {why}")]
    ConfigTooLate {
        /// The setting.
        what: &'static str,
        /// Why it is too late, and what to do instead.
        why: &'static str,
    },
    /// A configuration string or value that can't be used.
    #[error("bad configuration: {0}")]
    Config(String),
    /// An operation after `shutdown()`.
    #[error("the memory manager is shut down; {0} is no longer possible")]
    ShutDown(&'static str),
    /// A CUDA driver call failed.
    #[error("CUDA driver call {call} failed{}: {message}", on_device(*device))]
    Driver {
        /// The driver function.
        call: &'static str,
        /// The driver's error name and text.
        message: String,
        /// The device the call worked on, where cumem knows it.
        device: Option<usize>,
    },
    /// The operation needs a GPU and the crate runs on the host fallback.
    #[error("{0} needs a CUDA device; cumem runs on the host fallback here")]
    NeedsGpu(&'static str),
    /// A device allocator mode the device does not support.
    #[error("device allocator mode {mode} is not supported: {reason}")]
    UnsupportedMode {
        /// The mode asked for.
        mode: &'static str,
        /// Why not.
        reason: String,
    },
    /// Peer access two devices can't have, or that the driver refused.
    #[error("device {accessor} can't access the memory of device {owner}: {reason}")]
    PeerAccess {
        /// The device whose kernels were to access the memory.
        accessor: usize,
        /// The device that owns the memory.
        owner: usize,
        /// Why not.
        reason: String,
    },
    /// A device ordinal with no device behind it.
    #[error("no CUDA device with ordinal {ordinal} ({count} present)")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices there are.
        count: usize,
    },
    /// An operating-system call failed (host fallback memory).
    #[error("{call} failed: {source}")]
    Os {
        /// The system call.
        call: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A malformed line in an allocation trace.
    #[error("trace {source_name}, line {line}: {reason}")]
    Trace {
        /// The file (or other source) read.
        source_name: String,
        /// The line, from 1.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// A request that is well-formed but not valid now (arena, buffers).
    #[error("{0}")]
    InvalidState(String),
    /// Sharing memory with another process failed: memory that can't be
    /// exported, a malformed or foreign handle, a closed connection.
    #[error("inter-process sharing: {0}")]
    Ipc(String),
    /// An arena plan's block can't hold what the plan needs. The plan is
    /// unchanged: a failed `satisfy` assigns nothing and leaves its requests
    /// pending; a request larger than the whole block is not taken.
    #[error(
        "the arena's {memory} block is too small: the plan needs {desired} B, the block holds {available} B; \
         the plan is unchanged"
    )]
    ArenaTooSmall {
        /// Which block: [`PoolKind::Pinned`] (host) or [`PoolKind::Device`].
        memory: PoolKind,
        /// The bytes the block would need (the plan's end offset).
        desired: usize,
        /// The bytes the block holds.
        available: usize,
    },
    /// A request that a CUDA graph capture under way makes impossible or
    /// unsafe (the capture is left intact: nothing illegal was called).
    #[error("graph capture: {0}")]
    Capture(String),
    /// A change to an arena plan after `commit()`.
    #[error("the arena plan is committed: {0} is no longer possible (release_all() reopens it)")]
    ArenaCommitted(&'static str),
    /// An arena handle the plan can't resolve: from another plan, from
    /// before `release_all()`, or not assigned yet.
    #[error("arena handle rejected: {0}")]
    InvalidHandle(String),
    /// A memory tag's request that its state or kind forbids: allocating
    /// in a tag that sleeps, sleeping twice, waking a tag that is awake,
    /// memory that can't sleep (the message says why). Nothing changed.
    #[error("memory tag '{tag}': {why}")]
    Tag {
        /// The tag.
        tag: String,
        /// What is wrong.
        why: String,
    },
}

impl fmt::Display for OomState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} B in use, {} B reserved but free, largest free block {} B",
            self.in_use, self.reserved_free, self.largest_free
        )?;
        if let Some(limit) = self.limit {
            write!(f, ", pool limit {limit} B")?;
        }
        if let Some(free) = self.device_free {
            write!(f, ", device free {free} B")?;
        }
        if let Some(up) = &self.upstream {
            write!(f, "; upstream: {up}")?;
        }
        if let Some(hint) = self.hint {
            write!(f, " (hint: {hint})")?;
        }
        if let Some(device) = self.device {
            write!(f, "; device {device}")?;
        }
        Ok(())
    }
}

fn on_device(device: Option<usize>) -> String {
    device.map_or_else(String::new, |d| format!(" on device {d}"))
}

impl Error {
    /// The same error, naming device `ordinal` where it concerns a device
    /// and names none yet (driver errors, device out-of-memory).
    pub(crate) fn on_device(mut self, ordinal: usize) -> Error {
        match &mut self {
            Error::Driver { device, .. } if device.is_none() => *device = Some(ordinal),
            Error::OutOfMemory { pool: PoolKind::Device, state, .. } if state.device.is_none() => {
                state.device = Some(ordinal)
            }
            _ => {}
        }
        self
    }
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
