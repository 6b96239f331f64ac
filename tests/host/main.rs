//! The host tests: the pools, the models and the threads on the host
//! fallback (or the GPU where there is one), each test on a pool or manager
//! of its own, so that they can share one process. One module per former
//! test binary; run one of them with `cargo test --test host -- pool_model::`.
//! The process-wide manager's tests are in `tests/gpu/`.

mod arena;
mod bad_input;
mod config;
mod expandable;
mod figures;
mod fuzz_pool;
mod graphs;
mod growable;
mod hot_block;
mod pool_model;
mod remap_model;
mod sleep;
mod stress;
mod thread_cache;
mod threads;
mod training_threads;
mod unmapped_pages;
