//! What several GPU test binaries share.

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
