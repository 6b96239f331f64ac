use super::super::{Pool, PoolConfig};
use super::Growth;
use crate::error::PoolKind;
use crate::tag::StreamTag;
use crate::upstream::{HostExpandable, Upstream};

/// Two threads of one pool plan to extend its last chunk at once; the
/// first extends it, so the second can't and takes a new chunk. With
/// page remapping that chunk must be whole pages: a chunk of 4 KiB
/// granules put a 2 MiB page across two chunks, and giving one of them
/// back failed ("not mapped by this upstream"), leaking it.
#[test]
fn a_remapping_pool_that_loses_an_extension_race_takes_whole_pages() {
    let pool = Pool::new(HostExpandable::new(1 << 30).unwrap(), PoolConfig::new(PoolKind::Standalone));
    assert!(pool.remaps());
    let page = pool.remap_page;
    let a = pool.allocate(3 << 20, 256).unwrap();
    let (chunk, _) = pool.inner.lock().fit.last_chunk().unwrap();
    // The other thread's extension: the upstream's end moves on.
    assert!(pool.upstream().try_extend_reserved(chunk, page).unwrap());
    {
        let mut inner = pool.inner.lock();
        assert!(inner.fit.extend_chunk(chunk, page));
        inner.pages.add_unmapped(chunk.end(), page);
    }
    // This thread's plan, made before: extending fails, a new chunk.
    let need = (3 << 20) + 4096;
    pool.inner.lock().pending_growth += 2 * page;
    pool.grow(Growth::Extend { chunk, extra: 2 * page, need }).unwrap();
    let chunks = pool.with_fit(|f| f.chunks());
    assert_eq!(chunks.len(), 2, "{chunks:?}");
    for c in &chunks {
        assert_eq!((c.addr % page, c.size % page), (0, 0), "a chunk of whole pages: {c:?}");
    }
    // Fill the new chunk's pages, then give everything back.
    let b = pool.allocate(need, 256).unwrap();
    pool.deallocate(a.addr, StreamTag::NONE).unwrap();
    pool.deallocate(b.addr, StreamTag::NONE).unwrap();
    pool.release_cached().unwrap();
    assert_eq!(pool.stats().reserved, 0);
}
