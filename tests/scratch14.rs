use cumem::pool::{Pool, StreamTag, BLOCK_ALIGN};
use cumem::replay::AddressRange;
use cumem::trace::{Op, Trace};
use cumem::Config;
#[test]
fn floor() {
    let files = std::env::var("TRACES").unwrap();
    for f in files.split(',') {
        let trace = Trace::read(std::path::Path::new(f)).unwrap();
        let pool = Pool::new(AddressRange::new(), Config::new().device_pool_config());
        let mut addrs = vec![0usize; trace.slots];
        let page = 2usize << 20;
        let mut floor = 0usize;
        let mut live: std::collections::BTreeMap<usize, usize> = Default::default();
        for pass in 0..2 {
            for op in &trace.ops {
                match *op {
                    Op::Allocate { slot, size } => {
                        let a = pool.allocate(size, BLOCK_ALIGN).unwrap();
                        addrs[slot as usize] = a.addr;
                        live.insert(a.addr, a.size);
                    }
                    Op::Free { slot } => {
                        let a = std::mem::take(&mut addrs[slot as usize]);
                        if a != 0 {
                            live.remove(&a);
                            pool.deallocate(a, StreamTag::NONE).unwrap();
                        }
                    }
                }
                let mut pages = std::collections::BTreeSet::new();
                for (&a, &s) in &live {
                    for p in (a / page)..=((a + s - 1) / page) {
                        pages.insert(p);
                    }
                }
                floor = floor.max(pages.len());
            }
            if pass == 0 {
                for a in addrs.iter_mut().filter(|a| **a != 0) {
                    live.remove(a);
                    pool.deallocate(std::mem::take(a), StreamTag::NONE).unwrap();
                }
            }
        }
        let s = pool.stats();
        println!(
            "{}: floor {:.3} physical {:.3} virtual {:.3}",
            trace.name,
            (floor * page) as f64 / trace.peak_live as f64,
            s.peak_mapped as f64 / trace.peak_live as f64,
            s.peak_reserved as f64 / trace.peak_live as f64
        );
    }
}
