//! What several modules of the GPU test crate share.

/// A kernel that writes its own value into its block, spins, then counts
/// the elements that no longer hold that value: a block handed to another
/// stream (or to the host) before the first kernel finished shows up as a
/// mismatch.
pub const CHECK: &str = r#"
extern "C" __global__ void fill_spin_check(unsigned int* p, unsigned int v, unsigned long long n,
                                           long long cycles, unsigned long long* errors) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) p[i] = v;
    long long start = clock64();
    while (clock64() - start < cycles) { }
    if (i < n && p[i] != v) atomicAdd(errors, 1ULL);
}
"#;

/// The name that libtest gives the test `name` of the module whose
/// `module_path!()` is `module` (the crate's name left out), for running
/// that one test again in a child process with `--exact`.
pub fn test_name(module: &str, name: &str) -> String {
    match module.split_once("::") {
        Some((_crate, path)) => format!("{path}::{name}"),
        None => name.to_string(),
    }
}
