//! Sleep racing a free and an allocation (`device/tags.rs`,
//! `pool/sleep.rs`): one thread puts a tag's pool to sleep (every page
//! unmapped) and wakes it (pages mapped under the blocks still live);
//! another thread frees one of the tag's blocks and then tries to
//! allocate in the tag. In every interleaving the allocation either is
//! refused or lands on mapped pages that sleep waits for before it unmaps
//! anything; after the wake every live block lies on mapped pages, the
//! freed block is not mapped back for nothing, and the pool's count of
//! mapped memory is the device's.

#![cfg(loom)]

use cumem::device::TagPool;
use cumem::pool::{Pool, PoolConfig, StreamTag};
use cumem::upstream::Upstream;
use cumem::PoolKind;
use cumem_loom_tests::model;
use cumem_loom_tests::pages::{Device, PageUpstream, PAGE};
use loom::sync::Arc;
use loom::thread;

fn on_mapped_pages(d: &Device, addr: usize, size: usize) -> bool {
    (addr / PAGE * PAGE..addr + size).step_by(PAGE).all(|page| d.mapped(page))
}

fn mapped_bytes(d: &Device) -> usize {
    d.pieces.values().sum()
}

#[test]
fn sleep_races_a_free_and_an_allocation() {
    model(|| {
        let dev = PageUpstream::default();
        let mut c = PoolConfig::new(PoolKind::Device);
        c.thread_cache = false;
        c.min_chunk = PAGE;
        c.remap_slack_ppm = 0;
        // The block freed while the tag sleeps waits hot, with no pages.
        c.hot_block = true;
        let tp = Arc::new(TagPool::new("t", Pool::new(Box::new(dev.clone()) as Box<dyn Upstream>, c)));
        let kept = tp.pool.allocate(PAGE, 256).unwrap();
        let freed = tp.pool.allocate(PAGE, 256).unwrap();

        assert!(
            on_mapped_pages(&dev.dev(), kept.addr, PAGE) && on_mapped_pages(&dev.dev(), freed.addr, PAGE),
            "setup: pieces {:x?} kept {:#x} freed {:#x} mapped {}",
            dev.dev().pieces,
            kept.addr,
            freed.addr,
            tp.pool.stats().mapped
        );
        let (a, d) = (tp.clone(), dev.clone());
        let kept_addr = kept.addr;
        let other = thread::spawn(move || {
            a.pool.deallocate(freed.addr, StreamTag::NONE).unwrap();
            let entered = a.enter().ok()?;
            let b = a.pool.allocate(PAGE, 256).unwrap();
            {
                let dv = d.dev();
                assert!(
                    on_mapped_pages(&dv, b.addr, b.size),
                    "an allocation lands on mapped pages: {:#x}+{} pieces {:x?} kept {:#x} freed {:#x} state {:?} mapped {}",
                    b.addr,
                    b.size,
                    dv.pieces,
                    kept_addr,
                    freed.addr,
                    a.state(),
                    a.pool.stats().mapped
                );
            }
            drop(entered);
            Some(b)
        });

        tp.begin_sleep().unwrap();
        tp.pool.unmap_all().unwrap();
        assert_eq!(mapped_bytes(&dev.dev()), 0, "sleep leaves nothing mapped");
        tp.end_sleep(true);
        tp.begin_wake().unwrap();
        let live: Vec<(usize, usize)> = tp.pool.live_blocks().into_iter().map(|(a, s, _)| (a, s)).collect();
        tp.pool.map_ranges(&live).unwrap();
        tp.end_wake(true);

        let got = other.join().unwrap();
        let d = dev.dev();
        assert!(d.violations.is_empty(), "{:?}", d.violations);
        let live = tp.pool.live_blocks();
        for &(addr, size, _) in &live {
            assert!(on_mapped_pages(&d, addr, size), "live block {addr:#x}+{size} on unmapped pages after wake");
        }
        let mut want = vec![kept.addr];
        want.extend(got.map(|b| b.addr));
        want.sort_unstable();
        assert_eq!(live.iter().map(|b| b.0).collect::<Vec<_>>(), want, "exactly the blocks held are live");
        assert_eq!(tp.pool.stats().mapped, mapped_bytes(&d), "the pool counts what the device maps");
    });
}
