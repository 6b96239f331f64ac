//! Gives `libcumem_c.so` the soname `libcumem_c.so` on Linux. A library
//! linked against it (cumem_torch's native backend) names it as a needed
//! library by that soname, so the dynamic linker takes the copy already in
//! the process (Python's, loaded by full path) instead of loading a second
//! one found through the runpath: two copies are two cumem managers.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var("CARGO_CFG_TARGET_OS").is_ok_and(|os| os == "linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcumem_c.so");
    }
}
