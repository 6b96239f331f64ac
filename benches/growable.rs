//! Growing a buffer by doubling: cumem's GrowableBuffer (remaps, never
//! copies) against allocate-bigger-and-copy. Criterion times whole doubling
//! sequences (2 MiB up to each size); afterwards a plain table gives the
//! time of each single growth per size and the ratio.
//!
//! Runs on the GPU when there is one, else on the host fallback (sizes
//! capped at 1 GiB there, at 16 GiB or what fits on the GPU).

use std::time::Duration;

use criterion::{BenchmarkId, Criterion, SamplingMode};

#[path = "common/grow.rs"]
mod grow;

fn bench(c: &mut Criterion, env: &grow::Env) {
    let mut group = c.benchmark_group(format!("grow_by_doubling/{}", if env.ctx.is_some() { "gpu" } else { "host" }));
    group.sample_size(10).warm_up_time(Duration::from_millis(200)).measurement_time(Duration::from_secs(1));
    group.sampling_mode(SamplingMode::Flat);
    let limit = if env.ctx.is_some() { 2 << 30 } else { 256 * grow::MIB };
    let all = env.sizes(limit);
    for end in (1..all.len()).step_by(2) {
        let sizes = &all[..=end];
        let top = sizes[end];
        group.bench_with_input(BenchmarkId::new("cumem_growable", top / grow::MIB), sizes, |b, s| {
            b.iter(|| env.doubling_cumem(s))
        });
        group.bench_with_input(BenchmarkId::new("alloc_copy_free", top / grow::MIB), sizes, |b, s| {
            b.iter(|| env.doubling_copy(s))
        });
    }
    group.finish();
}

fn main() {
    let env = grow::Env::new();
    println!("cumem growable bench on {}", env.backend);
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c, &env);
    c.final_summary();
    env.print_table(3);
}
