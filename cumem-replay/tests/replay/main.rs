//! The replay and synthesis tools' tests: replays through every host
//! target, the pictures, the two programs' command lines. One module per
//! former test binary (`cargo test -p cumem-replay --test replay --
//! pictures::` runs one).

mod pictures;
mod replay;
mod synth_cli;
