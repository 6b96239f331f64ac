//! Placeholder: the pair-latency bench lands with the replay work.

fn main() {}
