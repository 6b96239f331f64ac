//! Finding the driver and the devices; one primary context per device.

use std::sync::Arc;

use cudarc::driver::sys;
use cudarc::driver::CudaContext;
use once_cell::sync::OnceCell;

use crate::error::{Error, Result};
use crate::sync::{Ordering, StaticAtomicU64};

/// The default device once the process-wide manager set it; `u64::MAX`
/// before. An identity, ordering no memory.
static DEFAULT_ORDINAL: StaticAtomicU64 = StaticAtomicU64::new(u64::MAX);

/// The default device's ordinal: the one the process-wide manager was
/// configured with (`Config::device`) once it exists, else `CUMEM_CONF`'s
/// `device` (0 when unset or unreadable).
pub fn default_ordinal() -> usize {
    match DEFAULT_ORDINAL.load(Ordering::Relaxed) {
        u64::MAX => crate::conf::env_value("device").and_then(|v| v.parse().ok()).unwrap_or(0),
        n => n as usize,
    }
}

/// Makes `ordinal` the default device (the process-wide manager calls it
/// once, when it is created; there is none under loom).
#[cfg(not(loom))]
pub(crate) fn set_default_ordinal(ordinal: usize) {
    DEFAULT_ORDINAL.store(ordinal as u64, Ordering::Relaxed);
}

/// Whether CUDA can be used here, and why not when it can't.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DriverStatus {
    /// The driver loaded and reports this many devices (at least one).
    Available {
        /// Number of CUDA devices.
        devices: usize,
    },
    /// No CUDA: the reason, for the user.
    Unavailable(String),
}

impl DriverStatus {
    /// Whether the driver and at least one device are there.
    pub fn is_available(&self) -> bool {
        matches!(self, DriverStatus::Available { .. })
    }

    /// The number of devices (0 when unavailable).
    pub fn devices(&self) -> usize {
        match self {
            DriverStatus::Available { devices } => *devices,
            DriverStatus::Unavailable(_) => 0,
        }
    }
}

/// Looks for the CUDA driver library and devices, once per process
/// (`cuInit`, `cuDeviceGetCount`). `CUMEM_FORCE_HOST=1` pretends there is
/// none, to run the host fallback on a GPU machine.
pub fn driver_status() -> &'static DriverStatus {
    static STATUS: OnceCell<DriverStatus> = OnceCell::new();
    STATUS.get_or_init(|| {
        if std::env::var_os("CUMEM_FORCE_HOST").is_some_and(|v| v == "1") {
            return DriverStatus::Unavailable("CUMEM_FORCE_HOST=1 is set".into());
        }
        // SAFETY: probing for the library only dlopen()s and closes it.
        if !unsafe { sys::is_culib_present() } {
            return DriverStatus::Unavailable("the CUDA driver library (libcuda.so) is not installed".into());
        }
        if let Err(e) = cudarc::driver::result::init() {
            return DriverStatus::Unavailable(format!("cuInit failed: {e}"));
        }
        match cudarc::driver::result::device::get_count() {
            Ok(0) => DriverStatus::Unavailable("the CUDA driver reports no devices".into()),
            Ok(n) => DriverStatus::Available { devices: n as usize },
            Err(e) => DriverStatus::Unavailable(format!("cuDeviceGetCount failed: {e}")),
        }
    })
}

/// The primary context of device `ordinal` (retained once per process and
/// kept), or `Ok(None)` when the driver is unavailable.
///
/// # Errors
/// [`Error::NoSuchDevice`] for an ordinal past the last device; a driver
/// error if the context can't be retained.
pub fn device_context(ordinal: usize) -> Result<Option<Arc<CudaContext>>> {
    static CONTEXTS: OnceCell<Vec<OnceCell<Arc<CudaContext>>>> = OnceCell::new();
    let count = match driver_status() {
        DriverStatus::Available { devices } => *devices,
        DriverStatus::Unavailable(_) => return Ok(None),
    };
    if ordinal >= count {
        return Err(Error::NoSuchDevice { ordinal, count });
    }
    let cells = CONTEXTS.get_or_init(|| (0..count).map(|_| OnceCell::new()).collect());
    let ctx =
        cells[ordinal].get_or_try_init(|| CudaContext::new(ordinal).map_err(driver_err("cuDevicePrimaryCtxRetain")))?;
    Ok(Some(ctx.clone()))
}

/// Converts a cudarc driver error into [`Error::Driver`] naming `call`.
pub fn driver_err(call: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Driver { call, message: e.to_string(), device: None }
}

/// For GPU tests: the context of the default device (`CUMEM_CONF`'s
/// `device`, 0 when unset), or `None` after printing why the test is
/// skipped. With `CUMEM_REQUIRE_GPU=1` a missing GPU is a failure instead,
/// so a GPU test on the device machine can't pass by skipping.
///
/// # Panics
/// When `CUMEM_REQUIRE_GPU=1` and no device is usable.
#[doc(hidden)]
pub fn gpu_for_test(test: &str) -> Option<Arc<CudaContext>> {
    let required = std::env::var_os("CUMEM_REQUIRE_GPU").is_some_and(|v| v == "1");
    let reason = match device_context(default_ordinal()) {
        Ok(Some(ctx)) => return Some(ctx),
        Ok(None) => match driver_status() {
            DriverStatus::Unavailable(why) => why.clone(),
            DriverStatus::Available { .. } => "no device context".to_string(),
        },
        Err(e) => e.to_string(),
    };
    if required {
        panic!("{test}: CUMEM_REQUIRE_GPU=1 but no GPU is usable: {reason}");
    }
    println!("{test}: skipped, no GPU: {reason}");
    None
}

/// For tests that need `n` GPUs: the contexts of devices `0..n`, or `None`
/// after printing why the test is skipped (no GPU, or fewer than `n`).
/// With `CUMEM_REQUIRE_GPU=1`, no GPU is a failure, and so are fewer than
/// `n` when `CUMEM_GPUS` is `n` or more, so the test can't pass by
/// skipping on the machine meant to run it (with `CUMEM_REQUIRE_GPU=1`
/// alone, one GPU still skips: the single-GPU suite).
///
/// # Panics
/// When `CUMEM_REQUIRE_GPU=1` and the test can't run for a reason other
/// than "fewer than `n` GPUs on a machine not promised `n`".
#[doc(hidden)]
pub fn gpus_for_test(n: usize, test: &str) -> Option<Vec<Arc<CudaContext>>> {
    let required = std::env::var_os("CUMEM_REQUIRE_GPU").is_some_and(|v| v == "1");
    let promised = std::env::var("CUMEM_GPUS").ok().and_then(|v| v.trim().parse::<usize>().ok()).unwrap_or(0);
    let present = driver_status().devices();
    let reason = if present < n {
        match driver_status() {
            DriverStatus::Unavailable(why) => format!("no GPU: {why}"),
            DriverStatus::Available { devices } => format!("needs {n} GPUs, {devices} present"),
        }
    } else {
        match (0..n).map(device_context).collect::<Result<Vec<_>>>() {
            Ok(ctxs) if ctxs.iter().all(Option::is_some) => return Some(ctxs.into_iter().flatten().collect()),
            Ok(_) => "no device context".to_string(),
            Err(e) => e.to_string(),
        }
    };
    // Under CUMEM_REQUIRE_GPU=1 only "fewer GPUs than this test needs, on a
    // machine not promised to have them" may skip.
    if required && (promised >= n || present == 0 || present >= n) {
        panic!("{test}: CUMEM_REQUIRE_GPU=1 (CUMEM_GPUS={promised}) but {reason}");
    }
    println!("{test}: skipped, {reason}");
    None
}
