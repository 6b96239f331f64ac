//! `CUMEM_CONF`'s text as a [`Config`]: `key=value` pairs, sizes with
//! units, fractions, booleans.

use std::path::PathBuf;

use super::config::{BackendChoice, Config, ThreadCache};
use crate::error::{Error, Result};

/// Parses a byte size: a number with an optional unit, `B`, `KiB`, `MiB`,
/// `GiB`, `TiB` (powers of 1024; `K`, `M`, `G`, `T` too) or `KB`, `MB`,
/// `GB`, `TB` (powers of 1000). Fractions are allowed (`1.5GiB`).
pub fn parse_size(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    if num.is_empty() {
        return None;
    }
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return None,
    };
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mult);
    }
    let f: f64 = num.parse().ok()?;
    let v = f * mult as f64;
    (v.is_finite() && v >= 0.0 && v < u64::MAX as f64).then_some(v.round() as u64)
}

fn size_value(key: &str, value: &str) -> Result<usize> {
    parse_size(value)
        .and_then(|v| usize::try_from(v).ok())
        .ok_or_else(|| Error::Config(format!("{key}: '{value}' is not a size (examples: 4096, 64KiB, 256MiB, 1.5GiB)")))
}

/// A fraction written as `0.01` or `1%`, in millionths (at most 1000 %).
fn fraction_ppm(key: &str, value: &str) -> Result<u32> {
    let (num, scale) = match value.trim().strip_suffix('%') {
        Some(n) => (n.trim(), 10_000.0),
        None => (value.trim(), 1_000_000.0),
    };
    num.parse::<f64>()
        .ok()
        .map(|f| f * scale)
        .filter(|v| v.is_finite() && (0.0..=10_000_000.0).contains(v))
        .map(|v| v.round() as u32)
        .ok_or_else(|| Error::Config(format!("{key}: '{value}' is not a fraction from 0 to 10 (examples: 0.01, 1%)")))
}

fn bool_value(key: &str, value: &str) -> Result<bool> {
    match value.to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" | "on" => Ok(true),
        "0" | "false" | "no" | "off" => Ok(false),
        _ => Err(Error::Config(format!("{key}: '{value}' is not true or false"))),
    }
}

/// What per-thread shards' keys say now.
const NO_SHARDS: &str = "per-thread shards were removed: the pinned pool and each device's sync pool are one pool \
                         for every thread, with per-thread caches (pinned_thread_cache, device_thread_cache)";

/// Keys of options that were removed, with why.
const REMOVED: &[(&str, &str)] = &[
    ("arenas", NO_SHARDS),
    ("shared_device_arenas", NO_SHARDS),
    ("fresh_thread_budget", NO_SHARDS),
    ("arenas_hand_over", NO_SHARDS),
    ("idle_arenas_give", NO_SHARDS),
    ("idle_arenas_trim", NO_SHARDS),
    ("learn_placement", "learned placement was removed: it was off by default and measured no better than best fit"),
    ("background_mapper", "the background mapper's reserve was removed: it was off by default and measured no better"),
    ("tail_last", "placing into the free tail last was removed: it was off by default and measured no better"),
];

/// The keys `CUMEM_CONF` knows.
const KNOWN: &str = "pinned_pool_size, device_pool_size, mode, device, min_chunk, remap_slack, \
                     max_pinned_pool_size, max_device_pool_size, release_threshold, expandable, \
                     exportable_native_pool, track_allocations, thread_cache, pinned_thread_cache, \
                     device_thread_cache, hot_block, thread_cache_bytes, backend, peer_access, \
                     host_devices, log, promise_registered_captures";

/// The error for a key `CUMEM_CONF` does not know (or no longer knows).
fn unknown_key(key: &str) -> Error {
    match REMOVED.iter().find(|(k, _)| *k == key) {
        Some((_, why)) => Error::Config(format!("'{key}' is no longer supported: {why}")),
        None => Error::Config(format!("unknown key '{key}' (known: {KNOWN})")),
    }
}

impl std::str::FromStr for Config {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self> {
        let mut c = Config::default();
        for entry in crate::conf::entries(s) {
            let (key, value) = entry?;
            match key {
                "pinned_pool_size" => c.pinned_pool_size = size_value(key, value)?,
                "device_pool_size" => c.device_pool_size = size_value(key, value)?,
                "min_chunk" => c.min_chunk = size_value(key, value)?,
                "remap_slack" => c.remap_slack_ppm = fraction_ppm(key, value)?,
                "max_pinned_pool_size" => c.max_pinned_pool_size = Some(size_value(key, value)?),
                "max_device_pool_size" => c.max_device_pool_size = Some(size_value(key, value)?),
                "release_threshold" => {
                    c.release_threshold = if value.eq_ignore_ascii_case("max") {
                        u64::MAX
                    } else {
                        parse_size(value)
                            .ok_or_else(|| Error::Config(format!("{key}: '{value}' is not a size or 'max'")))?
                    }
                }
                "mode" => c.mode = value.parse()?,
                "device" => {
                    c.device = value
                        .parse()
                        .map_err(|_| Error::Config(format!("device: '{value}' is not a device ordinal")))?
                }
                "expandable" => c.expandable = bool_value(key, value)?,
                "exportable_native_pool" => c.exportable_native_pool = bool_value(key, value)?,
                "track_allocations" => c.track_allocations = bool_value(key, value)?,
                "thread_cache" => {
                    c.pinned_thread_cache = bool_value(key, value)?;
                    c.device_thread_cache = if c.pinned_thread_cache { ThreadCache::On } else { ThreadCache::Off };
                }
                "pinned_thread_cache" => c.pinned_thread_cache = bool_value(key, value)?,
                "device_thread_cache" => c.device_thread_cache = value.parse()?,
                "hot_block" => c.hot_block = bool_value(key, value)?,
                "thread_cache_bytes" => c.thread_cache_bytes = size_value(key, value)?,
                "backend" => {
                    c.backend = match value {
                        "auto" => BackendChoice::Auto,
                        "host" => BackendChoice::Host,
                        _ => return Err(Error::Config(format!("backend: '{value}' is not auto or host"))),
                    }
                }
                "promise_registered_captures" => c.promise_registered_captures = bool_value(key, value)?,
                // The former key: captures are now always checked unless the
                // program makes the promise above.
                "capture_check" if value == "always" => c.promise_registered_captures = false,
                "capture_check" => {
                    return Err(Error::Config(format!(
                        "capture_check: '{value}' is no longer supported: captures are checked by default; set \
                         promise_registered_captures=true if the program registers every capture with cumem"
                    )))
                }
                "peer_access" => c.peer_access = value.parse()?,
                "host_devices" => {
                    c.host_devices =
                        value.parse().ok().filter(|n| *n >= 1).ok_or_else(|| {
                            Error::Config(format!("host_devices: '{value}' is not a count of at least 1"))
                        })?
                }
                "log" if !value.is_empty() => c.log_path = Some(PathBuf::from(value)),
                "log" => return Err(Error::Config("log: expected a file path".into())),
                _ => return Err(unknown_key(key)),
            }
        }
        if c.min_chunk == 0 {
            return Err(Error::Config("min_chunk: must be at least 1 byte".into()));
        }
        Ok(c)
    }
}
