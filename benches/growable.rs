//! Growing a buffer by doubling: cumem's GrowableBuffer (remaps, never
//! copies) against allocate-bigger-and-copy: the time of each single
//! growth per size (median of five runs) and the ratio.
//!
//! Runs on the GPU when there is one, else on the host fallback (sizes
//! capped at 1 GiB there, at 16 GiB or what fits on the GPU).

#[path = "common/grow.rs"]
mod grow;

fn main() {
    grow::Env::new().print_table(5);
}
