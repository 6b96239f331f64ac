//! Builds and runs the C test of every entry point (tests/c/test_cumem.c,
//! against the shared library), the C++ wrapper's memory tags
//! (tests/c/test_tags.cpp, shared library) and the C++ seed example
//! (examples/seed_usage.cpp, against the static library), each in a
//! process of its own. Where no C or C++ compiler is present the test
//! prints why and passes without them; `CUMEM_REQUIRE_CC=1` makes that a
//! failure (CI sets it).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The crate's directory.
fn crate_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Where cargo put this build's libraries: the test runs from
/// `<target>/<profile>/deps/`, the libraries sit in `<target>/<profile>/`.
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test knows its path");
    exe.parent().and_then(Path::parent).expect("the test runs from <profile>/deps").to_path_buf()
}

/// The shared and static libraries of this profile. Cargo compiles every
/// crate type of the library (`cdylib`, `staticlib`, `rlib`) in one go
/// when the tests need the library, into `<target>/<profile>/deps/`; they
/// are used from there when they are as new as the `rlib` the tests link.
/// Otherwise (a test binary run from elsewhere) they are built here with
/// `cargo build -p cumem-c --lib`, once per test process: slow on a fresh
/// clone, as that build resolves features without the dev-dependencies
/// and compiles cumem and its derive macros a second time.
fn build_libraries() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT
        .get_or_init(|| {
            let libs = lib_dir();
            if let Some(deps) = fresh_libraries(&libs.join("deps")) {
                return deps;
            }
            let target = libs.parent().expect("<target>/<profile>");
            let mut cmd = Command::new(env!("CARGO"));
            cmd.args(["build", "--quiet", "-p", "cumem-c", "--lib"]).env("CARGO_TARGET_DIR", target);
            if libs.file_name().is_some_and(|p| p == "release") {
                cmd.arg("--release");
            }
            run(&mut cmd, "cargo build -p cumem-c --lib");
            libs
        })
        .clone()
}

/// `dir` when it holds `libcumem_c.so` and `libcumem_c.a` written with the
/// newest `libcumem_c*.rlib` there (the build the tests link).
fn fresh_libraries(dir: &Path) -> Option<PathBuf> {
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let newest_rlib = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name == "libcumem_c.rlib" || (name.starts_with("libcumem_c-") && name.ends_with(".rlib"))
        })
        .filter_map(|p| modified(&p))
        .max()?;
    // One rustc call writes all three, the rlib last (cargo lists the crate
    // types in their declared order): a minute's slack.
    let since = newest_rlib.checked_sub(std::time::Duration::from_secs(60))?;
    let so = modified(&dir.join("libcumem_c.so"))?;
    let a = modified(&dir.join("libcumem_c.a"))?;
    (so >= since && a >= since).then(|| dir.to_path_buf())
}

/// The compiler from `var` (CC, CXX) or the first of `names` that runs.
fn compiler(var: &str, names: &[&str]) -> Result<String, String> {
    let candidates: Vec<String> = match std::env::var(var) {
        Ok(c) if !c.is_empty() => vec![c],
        _ => names.iter().map(|s| s.to_string()).collect(),
    };
    for c in &candidates {
        if Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success()) {
            return Ok(c.clone());
        }
    }
    Err(format!("no compiler found (tried {}; set {var})", candidates.join(", ")))
}

/// Skips with a reason, or fails under `CUMEM_REQUIRE_CC=1`.
fn skip(what: &str, why: &str) {
    if std::env::var_os("CUMEM_REQUIRE_CC").is_some_and(|v| v == "1") {
        panic!("{what}: {why}, and CUMEM_REQUIRE_CC=1 asks for it");
    }
    println!("skipped {what}: {why}");
}

fn run(cmd: &mut Command, what: &str) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: can't start {cmd:?}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{what} failed ({}):\n{stdout}\n{stderr}", out.status);
    print!("{stdout}");
    stdout
}

fn out_dir() -> PathBuf {
    let dir = lib_dir().join("cumem-c-tests");
    std::fs::create_dir_all(&dir).expect("the target directory is writable");
    dir
}

/// Compiles `source` (under tests/c/) with `compiler` and `flags` against
/// the shared library, runs it in a process of its own and returns its
/// output.
fn run_against_shared_library(compiler: &str, flags: &[&str], source: &str) -> String {
    let libs = build_libraries();
    assert!(libs.join("libcumem_c.so").exists(), "libcumem_c.so is missing in {}", libs.display());
    let exe = out_dir().join(Path::new(source).file_stem().expect("a file name"));
    run(
        Command::new(compiler)
            .args(flags)
            .arg("-I")
            .arg(crate_dir().join("include"))
            .arg(crate_dir().join("tests/c").join(source))
            .arg("-L")
            .arg(&libs)
            .arg(format!("-Wl,-rpath,{}", libs.display()))
            .args(["-lcumem_c", "-o"])
            .arg(&exe),
        &format!("compiling tests/c/{source}"),
    );
    // LD_LIBRARY_PATH (which cargo sets to the target folders, where an
    // older build may sit) would win over the rpath: name these libraries.
    run(Command::new(&exe).env_remove("CUMEM_CONF").env("LD_LIBRARY_PATH", &libs), &format!("tests/c/{source}"))
}

#[test]
fn the_c_test_of_every_entry_point_passes() {
    let cc = match compiler("CC", &["cc", "gcc", "clang"]) {
        Ok(cc) => cc,
        Err(why) => return skip("the C test", &why),
    };
    let out = run_against_shared_library(
        &cc,
        &["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", "-O1"],
        "test_cumem.c",
    );
    assert!(out.contains("all") && out.contains("checks passed"), "the C test did not finish:\n{out}");
}

#[test]
fn the_cpp_tag_scope_sleeps_and_wakes() {
    let cxx = match compiler("CXX", &["c++", "g++", "clang++"]) {
        Ok(cxx) => cxx,
        Err(why) => return skip("the C++ tags test", &why),
    };
    let out = run_against_shared_library(&cxx, &["-std=c++17", "-Wall", "-Wextra", "-Werror", "-O1"], "test_tags.cpp");
    assert!(out.contains("cumem C++ tags test: ok"), "the C++ tags test did not finish:\n{out}");
}

#[test]
fn the_cpp_seed_example_runs() {
    let cxx = match compiler("CXX", &["c++", "g++", "clang++"]) {
        Ok(cxx) => cxx,
        Err(why) => return skip("the C++ seed example", &why),
    };
    let libs = build_libraries();
    assert!(libs.join("libcumem_c.a").exists(), "libcumem_c.a is missing in {}", libs.display());
    let exe = out_dir().join("seed_usage");
    run(
        Command::new(&cxx)
            .args(["-std=c++17", "-Wall", "-Wextra", "-Werror", "-O1"])
            .arg("-I")
            .arg(crate_dir().join("include"))
            .arg(crate_dir().join("examples/seed_usage.cpp"))
            .arg(libs.join("libcumem_c.a"))
            // What the static library needs (`cargo rustc -p cumem-c --lib
            // --crate-type staticlib -- --print native-static-libs`).
            .args(["-lgcc_s", "-lutil", "-lrt", "-lpthread", "-lm", "-ldl", "-o"])
            .arg(&exe),
        "compiling examples/seed_usage.cpp",
    );
    let out = run(Command::new(&exe).env_remove("CUMEM_CONF").env("LD_LIBRARY_PATH", &libs), "examples/seed_usage.cpp");
    assert!(out.contains("seed usage: ok"), "the C++ example did not finish:\n{out}");
}
