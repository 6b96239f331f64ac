//! The planning arena: satisfy/commit/release semantics, all-or-nothing
//! failure, stale handles, lifetime packing, host slices and device copies.
//! Runs on the host fallback here and on the GPU on the device machine.

use std::ops::RangeInclusive;

use cumem::arena::{ArenaPlan, DeviceHandle};
use cumem::{Config, Error, MemoryManager, PoolKind};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;

fn stale(e: Error) -> bool {
    matches!(&e, Error::InvalidHandle(m) if m.contains("stale"))
}

#[test]
fn satisfy_assigns_aligned_offsets_and_commit_freezes() {
    let mut plan = ArenaPlan::new(64 * KIB, 64 * KIB).unwrap();
    let h = plan.want_host::<u8>(100).unwrap();
    let d = plan.want_device::<f32>(1000).unwrap();
    assert_eq!(plan.pending(), 2);
    match plan.host_slice(&h) {
        Err(Error::InvalidHandle(m)) => assert!(m.contains("not assigned"), "{m}"),
        other => panic!("an unsatisfied handle resolved: {other:?}"),
    }

    let report = plan.satisfy().unwrap();
    assert_eq!(plan.pending(), 0);
    assert_eq!((report.host.requests, report.device.requests), (1, 1));
    assert_eq!(report.host.requested_bytes, 100);
    assert_eq!(report.device.requested_bytes, 4000);
    assert_eq!(plan.host_ptr(&h).unwrap() as usize % 256, 0);
    assert_eq!(plan.device_ptr(&d).unwrap() % 256, 0);

    // More requests after a satisfy: earlier offsets stay put.
    let before = plan.device_offset(&d).unwrap();
    let d2 = plan.want_device::<u64>(10).unwrap();
    let report = plan.commit().unwrap();
    assert!(plan.is_committed());
    assert_eq!(plan.device_offset(&d).unwrap(), before);
    assert_eq!(plan.device_offset(&d2).unwrap() % 256, 0);
    assert_eq!(report.device.requests, 2);

    // Frozen: errors, not panics.
    assert!(matches!(plan.want_host::<u8>(1), Err(Error::ArenaCommitted(_))));
    assert!(matches!(plan.want_device_for::<u8>(1, 0..=1), Err(Error::ArenaCommitted(_))));
    assert!(matches!(plan.satisfy(), Err(Error::ArenaCommitted(_))));
    assert!(matches!(plan.commit(), Err(Error::ArenaCommitted(_))));
    // Handles keep working after commit.
    plan.host_slice_mut(&h).unwrap()[99] = 7;
    assert_eq!(plan.host_slice(&h).unwrap()[99], 7);

    // release_all reopens it, empty.
    plan.release_all().unwrap();
    assert!(!plan.is_committed());
    assert_eq!(plan.report().device.requests, 0);
    let d3 = plan.want_device::<f32>(1000).unwrap();
    plan.satisfy().unwrap();
    assert_eq!(plan.device_offset(&d3).unwrap(), 0);
}

#[test]
fn capacity_exceeded_assigns_nothing() {
    let mut plan = ArenaPlan::new(4 * KIB, 4 * KIB).unwrap();
    let a = plan.want_device::<u8>(1000).unwrap();
    plan.satisfy().unwrap();
    let a_offset = plan.device_offset(&a).unwrap();

    let h = plan.want_host::<u8>(100).unwrap(); // would fit on its own
    let b = plan.want_device::<u8>(2000).unwrap();
    let c = plan.want_device::<u8>(2000).unwrap();
    let err = plan.satisfy().unwrap_err();
    let msg = err.to_string();
    match err {
        Error::ArenaTooSmall { memory: PoolKind::Device, desired, available } => {
            assert_eq!(available, 4096);
            // a at 0 (1000 B, to 1024), b at 1024 (to 3072), c at 3072: ends at 5072.
            assert_eq!(desired, 5072);
            assert!(msg.contains("5072") && msg.contains("4096"), "{msg}");
        }
        other => panic!("expected ArenaTooSmall, got {other:?}"),
    }
    // Nothing of that satisfy was assigned, in either block.
    assert_eq!(plan.pending(), 3);
    for e in
        [plan.device_offset(&b).unwrap_err(), plan.device_offset(&c).unwrap_err(), plan.host_offset(&h).unwrap_err()]
    {
        assert!(matches!(&e, Error::InvalidHandle(m) if m.contains("not assigned")), "{e}");
    }
    // The earlier assignment stands.
    assert_eq!(plan.device_offset(&a).unwrap(), a_offset);
    assert_eq!(plan.report().device.requests, 1);
    // The plan is still open; a failed commit does not freeze it.
    assert!(plan.commit().is_err());
    assert!(!plan.is_committed());

    // A request larger than the block is refused at once.
    assert!(matches!(
        plan.want_device::<u8>(4097),
        Err(Error::ArenaTooSmall { memory: PoolKind::Device, desired: 4097, available: 4096 })
    ));
    // A device-only plan has no host block.
    let mut dev_only = ArenaPlan::new(0, 4 * KIB).unwrap();
    assert!(matches!(dev_only.want_host::<u8>(1), Err(Error::ArenaTooSmall { memory: PoolKind::Pinned, .. })));
}

#[test]
fn stale_and_foreign_handles_are_rejected() {
    let mut plan = ArenaPlan::new(64 * KIB, 64 * KIB).unwrap();
    let h = plan.want_host::<u32>(16).unwrap();
    let d = plan.want_device::<u32>(16).unwrap();
    plan.commit().unwrap();
    plan.host_slice_mut(&h).unwrap().fill(5);

    plan.release_all().unwrap();
    // New requests take the same indices and offsets: the old handles still
    // must not reach them.
    let h2 = plan.want_host::<u32>(16).unwrap();
    let d2 = plan.want_device::<u32>(16).unwrap();
    plan.satisfy().unwrap();
    assert!(stale(plan.host_slice(&h).unwrap_err()));
    assert!(stale(plan.host_slice_mut(&h).unwrap_err()));
    assert!(stale(plan.host_ptr(&h).unwrap_err()));
    assert!(stale(plan.device_ptr(&d).unwrap_err()));
    assert!(stale(plan.copy_to_device(&d, &[0; 16]).unwrap_err()));
    assert!(stale(plan.copy_from_device(&d, &mut [0; 16]).unwrap_err()));
    assert!(stale(plan.upload(&h, &d2).unwrap_err()));
    assert!(stale(plan.download(&d, &h2).unwrap_err()));
    let msg = plan.host_offset(&h).unwrap_err().to_string();
    assert!(msg.contains("release_all"), "{msg}");
    // The new handles work, and see the memory as it was left.
    assert_eq!(plan.host_slice(&h2).unwrap(), &[5; 16]);

    // Another plan's handles are refused too.
    let mut other = ArenaPlan::new(64 * KIB, 64 * KIB).unwrap();
    other.want_host::<u32>(16).unwrap();
    other.satisfy().unwrap();
    match other.host_slice(&h2) {
        Err(Error::InvalidHandle(m)) => assert!(m.contains("another arena plan"), "{m}"),
        r => panic!("a foreign handle resolved: {r:?}"),
    }
}

#[test]
fn bad_requests_are_errors() {
    #[derive(Clone, Copy)]
    #[repr(C, align(512))]
    struct Wide([u8; 512]);
    // SAFETY: a byte array with no padding (512 bytes at alignment 512).
    unsafe impl bytemuck::Zeroable for Wide {}
    // SAFETY: as above; any bytes are valid.
    unsafe impl bytemuck::Pod for Wide {}

    let mut plan = ArenaPlan::new(64 * KIB, 64 * KIB).unwrap();
    assert!(matches!(plan.want_device::<f32>(0), Err(Error::InvalidSize { .. })));
    assert!(matches!(plan.want_device::<u64>(usize::MAX / 4), Err(Error::InvalidSize { .. })));
    assert!(matches!(plan.want_host::<Wide>(1), Err(Error::InvalidAlignment { align: 512, max: 256 })));
    #[allow(clippy::reversed_empty_ranges)]
    let empty = plan.want_device_for::<u8>(1, 5..=4);
    assert!(matches!(empty, Err(Error::InvalidState(_))));
    assert_eq!(plan.pending(), 0);
}

/// A network of `layers` layers: weights for the whole plan, each layer's
/// output activation used by that layer and the next.
struct Net {
    weights: Vec<DeviceHandle<f32>>,
    activations: Vec<DeviceHandle<f32>>,
}

fn plan_net(plan: &mut ArenaPlan, layers: usize) -> Net {
    let mut weights = Vec::new();
    let mut activations = Vec::new();
    for i in 0..layers {
        weights.push(plan.want_device::<f32>(1000 + 10 * i).unwrap());
        // Activations of varied sizes, as real layers have.
        let len = 16 * KIB + (i % 7) * 4 * KIB;
        activations.push(plan.want_device_for::<f32>(len, i..=i + 1).unwrap());
    }
    Net { weights, activations }
}

#[test]
fn layer_by_layer_network_shares_activation_memory() {
    let mut plan = ArenaPlan::new(0, 16 * MIB).unwrap();
    let net = plan_net(&mut plan, 50);
    let report = plan.commit().unwrap();
    println!("{report}");
    let sum: usize = net.weights.iter().chain(&net.activations).map(|h| h.num_bytes()).sum();
    assert_eq!(report.device.requested_bytes, sum);
    assert_eq!(report.device.requests, 100);
    // Weights can't share; activations need at most two live at a time.
    let weights: usize = net.weights.iter().map(|h| h.num_bytes().next_multiple_of(256)).sum();
    let largest_two = 2 * (16 * KIB + 6 * 4 * KIB) * 4;
    assert!(report.device.planned_bytes < sum, "packing saved nothing: {report}");
    assert!(report.device.planned_bytes <= weights + 2 * largest_two, "{report}");
    assert!(report.device.saved_bytes() > sum / 2, "{report}");
    // Neighbours never share; activations two layers apart may.
    for i in 0..49 {
        let (a, b) = (&net.activations[i], &net.activations[i + 1]);
        let (oa, ob) = (plan.device_offset(a).unwrap(), plan.device_offset(b).unwrap());
        assert!(oa + a.num_bytes() <= ob || ob + b.num_bytes() <= oa, "layers {i} and {} overlap", i + 1);
    }
}

/// One request of a random plan, as the test made it.
#[derive(Debug)]
struct Made {
    handle: DeviceHandle<u8>,
    steps: RangeInclusive<usize>,
}

fn overlap(a: &RangeInclusive<usize>, b: &RangeInclusive<usize>) -> bool {
    a.start() <= b.end() && b.start() <= a.end()
}

#[test]
fn random_plans_never_overlap_live_requests() {
    let mut rng = SmallRng::seed_from_u64(0x5eed_a4e4a);
    let mut plan = ArenaPlan::new(0, 512 * KIB).unwrap();
    let mut failures = 0;
    for round in 0..200 {
        plan.release_all().unwrap();
        let mut assigned: Vec<Made> = Vec::new();
        // A few satisfy calls per plan, so later requests fill gaps.
        for _ in 0..rng.gen_range(1..4) {
            let mut pending = Vec::new();
            for _ in 0..rng.gen_range(1..40) {
                let bytes = rng.gen_range(1..64 * KIB);
                let steps = if rng.gen_bool(0.15) {
                    0..=usize::MAX
                } else {
                    let first = rng.gen_range(0..30);
                    first..=first + rng.gen_range(0..6)
                };
                let handle = plan.want_device_for::<u8>(bytes, steps.clone()).unwrap();
                pending.push(Made { handle, steps });
            }
            match plan.satisfy() {
                Ok(_) => assigned.append(&mut pending),
                Err(Error::ArenaTooSmall { desired, available, .. }) => {
                    assert!(desired > available);
                    failures += 1;
                    for m in &pending {
                        assert!(plan.device_offset(&m.handle).is_err(), "round {round}: half-assigned");
                    }
                    break;
                }
                Err(e) => panic!("{e}"),
            }
        }
        let mut end = 0;
        for (i, a) in assigned.iter().enumerate() {
            let oa = plan.device_offset(&a.handle).unwrap();
            assert_eq!(oa % 256, 0);
            assert_eq!(plan.device_ptr(&a.handle).unwrap() % 256, 0);
            assert!(oa + a.handle.len() <= plan.device_capacity());
            end = end.max(oa + a.handle.len());
            for b in &assigned[i + 1..] {
                if overlap(&a.steps, &b.steps) {
                    let ob = plan.device_offset(&b.handle).unwrap();
                    assert!(
                        oa + a.handle.len() <= ob || ob + b.handle.len() <= oa,
                        "round {round}: {a:?} at {oa} and {b:?} at {ob} are live together and overlap"
                    );
                }
            }
        }
        let report = plan.report();
        assert_eq!(report.device.planned_bytes, end);
        assert_eq!(report.device.requested_bytes, assigned.iter().map(|m| m.handle.len()).sum::<usize>());
    }
    println!("{failures} of 200 random plans overflowed the block on some satisfy");
    assert!(failures > 10 && failures < 190, "both outcomes must be exercised: {failures} failures");
}

#[test]
fn host_slices_hold_written_data() {
    let mut plan = ArenaPlan::new(MIB, 0).unwrap();
    let a = plan.want_host::<f32>(1000).unwrap();
    let b = plan.want_host::<u64>(333).unwrap();
    let c = plan.want_host::<[u8; 3]>(77).unwrap();
    plan.commit().unwrap();
    // Fresh memory reads as zeroes.
    assert!(plan.host_slice(&a).unwrap().iter().all(|&x| x == 0.0));
    assert!(plan.host_slice(&b).unwrap().iter().all(|&x| x == 0));
    for (i, x) in plan.host_slice_mut(&a).unwrap().iter_mut().enumerate() {
        *x = i as f32 * 0.5;
    }
    for (i, x) in plan.host_slice_mut(&b).unwrap().iter_mut().enumerate() {
        *x = u64::MAX - i as u64;
    }
    for (i, x) in plan.host_slice_mut(&c).unwrap().iter_mut().enumerate() {
        *x = [i as u8, 1, 2];
    }
    let a_s = plan.host_slice(&a).unwrap();
    let b_s = plan.host_slice(&b).unwrap(); // shared slices coexist
    assert!(a_s.iter().enumerate().all(|(i, &x)| x == i as f32 * 0.5));
    assert!(b_s.iter().enumerate().all(|(i, &x)| x == u64::MAX - i as u64));
    assert!(plan.host_slice(&c).unwrap().iter().enumerate().all(|(i, x)| *x == [i as u8, 1, 2]));
}

#[test]
fn device_copies_round_trip() {
    let mut plan = ArenaPlan::new(MIB, MIB).unwrap();
    println!("arena on {}", plan.backend());
    let d = plan.want_device::<u32>(4096).unwrap();
    let e = plan.want_device::<u32>(4096).unwrap();
    let h = plan.want_host::<u32>(4096).unwrap();
    plan.commit().unwrap();

    // Fresh device memory reads as zeroes.
    let mut out = vec![1u32; 4096];
    plan.copy_from_device(&d, &mut out).unwrap();
    assert!(out.iter().all(|&x| x == 0));

    let data: Vec<u32> = (0..4096).map(|i| i * 3 + 1).collect();
    plan.copy_to_device(&d, &data).unwrap();
    plan.copy_from_device(&d, &mut out).unwrap();
    assert_eq!(out, data);

    // Through the pinned block: device -> host request -> device.
    plan.download(&d, &h).unwrap();
    assert_eq!(plan.host_slice(&h).unwrap(), &data[..]);
    plan.host_slice_mut(&h).unwrap().iter_mut().for_each(|x| *x += 1);
    plan.upload(&h, &e).unwrap();
    plan.copy_from_device(&e, &mut out).unwrap();
    assert!(out.iter().zip(&data).all(|(o, d)| *o == d + 1));

    // Length mismatches are errors.
    assert!(matches!(plan.copy_to_device(&d, &data[..10]), Err(Error::InvalidState(_))));
    assert!(matches!(plan.copy_from_device(&d, &mut out[..10]), Err(Error::InvalidState(_))));
}

#[test]
fn blocks_return_to_their_manager_on_drop() {
    let mm: &'static MemoryManager = Box::leak(Box::new(MemoryManager::new(Config::new()).unwrap()));
    {
        let mut plan = ArenaPlan::with_manager(mm, 256 * KIB, 512 * KIB).unwrap();
        assert_eq!(mm.pinned_stats().in_use, 256 * KIB);
        assert_eq!(mm.device_stats(0).unwrap().pool.in_use, 512 * KIB);
        let d = plan.want_device::<u8>(10).unwrap();
        plan.commit().unwrap();
        plan.copy_to_device(&d, &[9; 10]).unwrap();
    }
    assert_eq!(mm.pinned_stats().in_use, 0);
    assert_eq!(mm.device_stats(0).unwrap().pool.in_use, 0);
}

/// On the GPU: a kernel reads and writes arena memory through
/// `device_ptr`, and activations sharing bytes hand data on as planned.
#[test]
fn gpu_kernel_uses_arena_memory() {
    use cudarc::driver::{LaunchConfig, PushKernelArg};
    let Some(ctx) = cumem::device::gpu_for_test("gpu_kernel_uses_arena_memory") else { return };
    let ptx = cudarc::nvrtc::compile_ptx(
        r#"extern "C" __global__ void axpb(const float* x, float* y, float a, float b, unsigned n) {
            unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
            if (i < n) y[i] = a * x[i] + b;
        }"#,
    )
    .expect("NVRTC compiles the kernel");
    let f = ctx.load_module(ptx).unwrap().load_function("axpb").unwrap();
    let stream = ctx.default_stream();

    let n = 10_000usize;
    let mut plan = ArenaPlan::new(0, 4 * MIB).unwrap();
    // Three layers: x0 -> x1 -> x2 -> x3, each activation live for two steps.
    let acts: Vec<_> = (0..4).map(|i| plan.want_device_for::<f32>(n, i..=i + 1).unwrap()).collect();
    let report = plan.commit().unwrap();
    assert_eq!(plan.device_offset(&acts[0]).unwrap(), plan.device_offset(&acts[2]).unwrap(), "{report}");
    let input: Vec<f32> = (0..n).map(|i| i as f32).collect();
    plan.copy_to_device(&acts[0], &input).unwrap();
    for layer in 0..3 {
        let (x, y) = (plan.device_ptr(&acts[layer]).unwrap(), plan.device_ptr(&acts[layer + 1]).unwrap());
        let (a, b, len) = (2.0f32, 1.0f32, n as u32);
        let mut launch = stream.launch_builder(&f);
        launch.arg(&x).arg(&y).arg(&a).arg(&b).arg(&len);
        // SAFETY: x and y are arena requests of n floats each, live in this
        // step and disjoint (their lifetimes overlap); the signature matches.
        unsafe { launch.launch(LaunchConfig::for_num_elems(len)) }.unwrap();
    }
    stream.synchronize().unwrap();
    let mut out = vec![0.0f32; n];
    plan.copy_from_device(&acts[3], &mut out).unwrap();
    // y = 2x + 1 three times: 8x + 7.
    assert!(out.iter().enumerate().all(|(i, &v)| v == 8.0 * i as f32 + 7.0));
}
