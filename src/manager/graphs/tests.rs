use crate::cuda::Stream;
use crate::error::Error;
use crate::manager::{BackendChoice, Config, MemoryManager};

/// Blocks of `size` allocated on `t` until one of them is `p` (at most
/// 4); all freed again.
fn reaches(mm: &MemoryManager, size: usize, t: &Stream, p: u64) -> bool {
    let got: Vec<u64> = (0..4).map(|_| mm.allocate_device_on(size, t).unwrap()).collect();
    let found = got.contains(&p);
    for q in got {
        mm.free_device_on(q, t).unwrap();
    }
    found
}

/// A pinned block freed during a capture follows the rule of every
/// block captured work freed: the graph keeps it after its last export
/// is released, until the graph is gone, whichever of the two goes
/// first. Control: before the fix the release freed it eagerly (the
/// first case failed with the block handed out while the graph lived).
#[test]
fn a_pinned_block_freed_during_a_capture_stays_the_graphs() {
    for graph_first in [false, true] {
        let mm = MemoryManager::new(Config::new().backend(BackendChoice::Host)).unwrap();
        let d = mm.device(0).unwrap();
        let size = 8 << 20;
        let (s, t) = (Stream::host(), Stream::host());
        let p = mm.allocate_device_on(size, &s).unwrap();
        d.pin_for_tests(p, size).unwrap();
        let pool = mm.graph_pool().unwrap();
        let capture = mm.begin_capture(&s, &pool).unwrap();
        mm.free_device_on(p, &s).unwrap(); // captured work used it
        assert!(matches!(mm.free_device_on(p, &s), Err(Error::DoubleFree { .. })));
        let graph = capture.end().unwrap();
        assert!(matches!(mm.free_device(p), Err(Error::DoubleFree { .. })));
        if graph_first {
            drop((graph, pool));
            assert_eq!(d.stats().graphs.held, 0);
            assert!(!reaches(&mm, size, &t, p), "an exported block was handed out after its graph went");
            d.release_export(p).unwrap();
        } else {
            d.release_export(p).unwrap();
            assert_eq!(d.exported_blocks(), 0);
            assert!(!reaches(&mm, size, &t, p), "the release freed a block the graph still holds");
            assert!(matches!(mm.free_device(p), Err(Error::DoubleFree { .. })));
            drop((graph, pool));
        }
        assert_eq!((d.stats().graphs.held, d.exported_blocks()), (0, 0), "graph first: {graph_first}");
        assert!(reaches(&mm, size, &t, p), "the block came back once the graph and the export were gone");
        assert_eq!(d.stats().pool.live_blocks, 0);
    }
}
