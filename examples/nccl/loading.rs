//! Finding NCCL: loading it the way cudarc does, its version, and what to
//! run when cudarc can't find it under the names it looks for.

use std::ffi::CStr;
use std::panic::catch_unwind;

use crate::panic_text;

/// Where NCCL is often installed under its soname only (the hint for a
/// missing `libnccl.so` looks there).
const KNOWN_NCCL: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu/libnccl.so.2",
    "/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2",
    "/usr/local/cuda/lib64/libnccl.so.2",
];

/// NCCL's version code as major.minor.patch.
pub(crate) fn version_text(code: i32) -> String {
    if code >= 10000 {
        format!("{}.{}.{}", code / 10000, code % 10000 / 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, code % 1000 / 100, code % 100)
    }
}

/// Why NCCL can't be used here (the run is skipped, or fails under
/// `CUMEM_REQUIRE_NCCL=1`).
pub(crate) struct Missing(pub(crate) String);

/// Loads NCCL the way cudarc does, and returns its version code.
pub(crate) fn load_nccl() -> Result<i32, Missing> {
    // SAFETY: only `dlopen`s each of cudarc's names for the library and
    // closes it again.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(Missing(missing_nccl()));
    }
    // cudarc panics when a symbol is missing from the library it loaded.
    match catch_unwind(cudarc::nccl::result::get_nccl_version) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Missing(format!("ncclGetVersion failed: {:?}", e.0))),
        Err(p) => Err(Missing(format!("the NCCL library cudarc loaded is unusable: {}", panic_text(&*p)))),
    }
}

/// What cudarc looked for, where an NCCL under its soname is, and what to
/// run to point cudarc at it.
fn missing_nccl() -> String {
    let names: Vec<String> =
        cudarc::get_lib_name_candidates("nccl").into_iter().filter(|n| n.starts_with("libnccl.so")).collect();
    let mut why = format!(
        "no NCCL library: cudarc 0.19 looks for {} on the loader's path (LD_LIBRARY_PATH, then the system's), \
         not for libnccl.so.2.",
        names.join(", ")
    );
    let found = soname_on_loader_path()
        .or_else(|| KNOWN_NCCL.iter().find(|p| std::path::Path::new(p).exists()).map(|p| p.to_string()));
    match found {
        Some(path) => why.push_str(&format!(
            " NCCL is at {path}; give it the name cudarc asks for:\n    \
             mkdir -p /tmp/cumem-nccl && ln -sf {path} /tmp/cumem-nccl/libnccl.so && \
             export LD_LIBRARY_PATH=/tmp/cumem-nccl${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"
        )),
        None => why.push_str(" No libnccl.so.2 was found either (pip install nvidia-nccl-cu13, or libnccl2)."),
    }
    why
}

/// The path of the `libnccl.so.2` the loader finds, if any.
fn soname_on_loader_path() -> Option<String> {
    // SAFETY: loads the library by name (its initialisers set up NCCL's
    // own state only). It is left loaded: this path ends the process.
    let handle = unsafe { libc::dlopen(c"libnccl.so.2".as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
    if handle.is_null() {
        return None;
    }
    // SAFETY: `handle` is a live handle from `dlopen`; the name is a C string.
    let symbol = unsafe { libc::dlsym(handle, c"ncclGetVersion".as_ptr()) };
    // SAFETY: `Dl_info` is plain data; all zeros is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: `symbol` is an address in the loaded library (checked not
    // NULL) and `info` a valid place to write.
    if symbol.is_null() || unsafe { libc::dladdr(symbol, &mut info) } == 0 || info.dli_fname.is_null() {
        return Some("libnccl.so.2 (on the loader's path)".into());
    }
    // SAFETY: `dli_fname` is the loaded object's NUL-terminated path,
    // valid while the library stays loaded (it does).
    Some(unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy().into_owned())
}
