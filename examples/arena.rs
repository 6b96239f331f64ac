//! Plans the memory of a small network with the two-phase arena: weights
//! live for the whole run, each activation from the layer that writes it to
//! the layer that reads it, so activations share memory. Prints the plan,
//! then runs the network's data through the arena (copies on the host
//! fallback; the same copies through the driver on a GPU).
//!
//! ```text
//! cargo run --example arena
//! ```

use cumem::arena::{ArenaPlan, DeviceHandle, HostHandle};
use cumem::MemoryManager;

/// (inputs, outputs) of each dense layer.
const LAYERS: [(usize, usize); 6] = [(784, 1024), (1024, 1024), (1024, 512), (512, 512), (512, 256), (256, 10)];
const BATCH: usize = 64;

fn main() -> cumem::Result<()> {
    let mm = MemoryManager::global()?;
    println!("backend: {}", mm.backend());

    let mut plan = ArenaPlan::new(4 << 20, 64 << 20)?;

    // Phase one: say what is needed. Step i is layer i; the input is step 0's.
    let weights: Vec<DeviceHandle<f32>> =
        LAYERS.iter().map(|&(i, o)| plan.want_device::<f32>(i * o + o)).collect::<cumem::Result<_>>()?;
    let mut activations = vec![plan.want_device_for::<f32>(BATCH * LAYERS[0].0, 0..=0)?];
    for (step, &(_, outputs)) in LAYERS.iter().enumerate() {
        // Written by layer `step`, read by layer `step + 1` (or the host).
        activations.push(plan.want_device_for::<f32>(BATCH * outputs, step..=step + 1)?);
    }
    let input: HostHandle<f32> = plan.want_host::<f32>(BATCH * LAYERS[0].0)?;
    let logits: HostHandle<f32> = plan.want_host::<f32>(BATCH * LAYERS[LAYERS.len() - 1].1)?;

    // Phase two: assign everything at once, then freeze.
    let report = plan.commit()?;
    println!("{report}");
    println!(
        "device: sharing by lifetime saves {} of {} bytes ({:.1}%)",
        report.device.saved_bytes(),
        report.device.requested_bytes,
        100.0 * report.device.saved_bytes() as f64 / report.device.requested_bytes as f64
    );
    for (i, a) in activations.iter().enumerate() {
        println!("  activation {i}: {:>8} B at device offset {:>8}", a.num_bytes(), plan.device_offset(a)?);
    }

    // Use it: fill the pinned input, upload, "run" (a copy stands in for a
    // kernel here), download the result into pinned memory.
    for (i, x) in plan.host_slice_mut(&input)?.iter_mut().enumerate() {
        *x = (i % 255) as f32 / 255.0;
    }
    plan.upload(&input, &activations[0])?;
    let last = activations.last().expect("one per layer");
    let out: Vec<f32> = (0..last.len()).map(|i| i as f32).collect();
    plan.copy_to_device(last, &out)?;
    plan.download(last, &logits)?;
    assert_eq!(plan.host_slice(&logits)?, &out[..]);
    println!("weights: {} tensors; logits back in pinned memory: {} values", weights.len(), logits.len());

    // Reset for the next plan: the old handles stop working.
    plan.release_all()?;
    match plan.host_slice(&logits) {
        Err(e) => println!("after release_all: {e}"),
        Ok(_) => unreachable!("stale handles are refused"),
    }
    Ok(())
}
