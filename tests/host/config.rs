//! `CUMEM_CONF` parsing: good strings give the configuration, bad ones an
//! error that names the bad key or value.

use cumem::manager::parse_size;
use cumem::{BackendChoice, Config, DeviceAllocatorMode, Error};

#[test]
fn good_strings() {
    let c: Config = "pinned_pool_size=256MiB,device_pool_size=1GiB,mode=sync_pool".parse().unwrap();
    assert_eq!(c.pinned_pool_size, 256 << 20);
    assert_eq!(c.device_pool_size, 1 << 30);
    assert_eq!(c.mode, DeviceAllocatorMode::SyncPool);

    let c: Config = " mode = cuda_async_pool , release_threshold=64MB, device=0, expandable=false, backend=host, \
                     max_device_pool_size=1.5GiB, min_chunk=20M, max_pinned_pool_size=4096 ,"
        .parse()
        .unwrap();
    assert_eq!(c.mode, DeviceAllocatorMode::CudaAsyncPool);
    assert_eq!(c.release_threshold, 64_000_000);
    assert!(!c.expandable);
    assert_eq!(c.backend, BackendChoice::Host);
    assert_eq!(c.max_device_pool_size, Some(3 << 29));
    assert_eq!(c.min_chunk, 20 << 20);
    assert_eq!(c.max_pinned_pool_size, Some(4096));

    assert!(!Config::default().exportable_native_pool);
    let c: Config = "exportable_native_pool=true".parse().unwrap();
    assert!(c.exportable_native_pool);

    let c: Config = "mode=async_stream_ordered,release_threshold=max".parse().unwrap();
    assert_eq!(c.mode, DeviceAllocatorMode::AsyncStreamOrdered);
    assert_eq!(c.release_threshold, u64::MAX);
    assert_eq!("".parse::<Config>().unwrap(), Config::default());

    assert_eq!(Config::default().remap_slack_ppm, 10_000);
    for (text, ppm) in [("remap_slack=0.05", 50_000), ("remap_slack=2.5%", 25_000), ("remap_slack=0", 0)] {
        assert_eq!(text.parse::<Config>().unwrap().remap_slack_ppm, ppm, "{text}");
        assert_eq!(text.parse::<Config>().unwrap().device_pool_config().remap_slack_ppm, ppm, "{text}");
    }
}

fn config_error(s: &str) -> String {
    match s.parse::<Config>() {
        Err(Error::Config(m)) => m,
        other => panic!("'{s}' should be a config error, got {other:?}"),
    }
}

#[test]
fn bad_strings_name_the_problem() {
    assert!(config_error("pinned_pool_size=lots").contains("pinned_pool_size: 'lots'"));
    assert!(config_error("mode=fastest").contains("mode: 'fastest'"));
    assert!(config_error("colour=blue").contains("unknown key 'colour'"));
    // The keys of per-thread shards, removed: an error that says so.
    for key in ["arenas=1", "shared_device_arenas=true", "fresh_thread_budget=true", "arenas_hand_over=true"] {
        assert!(config_error(key).contains("per-thread shards were removed"), "{key}: {}", config_error(key));
    }
    for key in ["idle_arenas_give=true", "idle_arenas_trim=false"] {
        assert!(config_error(key).contains("is no longer supported"), "{key}");
    }
    assert!(config_error("pinned_pool_size").contains("'pinned_pool_size' is not key=value"));
    assert!(config_error("device=-1").contains("device: '-1'"));
    assert!(config_error("expandable=maybe").contains("expandable: 'maybe'"));
    assert!(config_error("learn_placement=true").contains("learned placement was removed"));
    assert!(config_error("tail_last=true").contains("free tail last was removed"));
    assert!(config_error("backend=tpu").contains("backend: 'tpu'"));
    assert!(config_error("device_pool_size=99999999999TiB").contains("device_pool_size"));
    assert!(config_error("min_chunk=0").contains("min_chunk"));
    for bad in ["remap_slack=-1%", "remap_slack=lots", "remap_slack=11", "remap_slack=NaN"] {
        assert!(config_error(bad).contains("remap_slack: '"), "{bad}");
    }
}

#[test]
fn sizes() {
    assert_eq!(parse_size("4096"), Some(4096));
    assert_eq!(parse_size("64KiB"), Some(64 << 10));
    assert_eq!(parse_size("64k"), Some(64 << 10));
    assert_eq!(parse_size("2 MiB"), Some(2 << 20));
    assert_eq!(parse_size("1GB"), Some(1_000_000_000));
    assert_eq!(parse_size("0.5GiB"), Some(1 << 29));
    assert_eq!(parse_size("1TiB"), Some(1 << 40));
    for bad in ["", "MiB", "1.2.3", "12 parsecs", "-5", "1e9"] {
        assert_eq!(parse_size(bad), None, "{bad}");
    }
}

#[test]
fn builder_matches_parsing() {
    let built = Config::new()
        .pinned_pool_size(1 << 20)
        .device_pool_size(2 << 20)
        .mode(DeviceAllocatorMode::AsyncStreamOrdered)
        .min_chunk(4 << 20)
        .expandable(false);
    let parsed: Config =
        "pinned_pool_size=1MiB,device_pool_size=2MiB,mode=async_stream_ordered,min_chunk=4MiB,expandable=false"
            .parse()
            .unwrap();
    assert_eq!(built, parsed);
}
