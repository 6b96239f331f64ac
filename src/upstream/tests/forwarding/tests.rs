use super::*;
use crate::upstream::Geometric;

#[test]
fn boxes_and_geometric_wrappers_forward_every_method() {
    assert_eq!(methods_not_forwarded(|u| Box::new(u)), Vec::<&str>::new());
    assert_eq!(methods_not_forwarded(|u| Box::new(Geometric::new(u, None))), Vec::<&str>::new());
}

#[test]
fn a_wrapper_that_forwards_nothing_is_caught() {
    // The control: a wrapper that re-lists two methods by hand and
    // names no inner upstream loses all the others.
    struct Opaque(Box<dyn Upstream>);
    impl Upstream for Opaque {
        fn allocate_chunk(&self, size: usize) -> Result<Chunk> {
            self.0.allocate_chunk(size)
        }
        fn deallocate_chunk(&self, chunk: Chunk) -> Result<()> {
            self.0.deallocate_chunk(chunk)
        }
    }
    let missed = methods_not_forwarded(|u| Box::new(Opaque(u)));
    assert_eq!(missed.len(), ALL.len() - 2);
    assert!(missed.contains(&"can_remap") && missed.contains(&"map_runs"));
}
