//! The committed header, `include/cumem.h`, is what cbindgen makes of the
//! code now. `CUMEM_BLESS=1 cargo test -p cumem-c --test header` rewrites
//! it.

use std::path::Path;

#[test]
fn the_committed_header_matches_the_code() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml reads");
    let bindings =
        cbindgen::Builder::new().with_crate(dir).with_config(config).generate().expect("cbindgen generates the header");
    let mut generated = Vec::new();
    bindings.write(&mut generated);
    let generated = String::from_utf8(generated).expect("the header is UTF-8");
    let path = dir.join("include/cumem.h");
    if std::env::var_os("CUMEM_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(&path, &generated).expect("include/cumem.h is writable");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != generated {
        let first = committed
            .lines()
            .zip(generated.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| committed.lines().count().min(generated.lines().count()));
        panic!(
            "include/cumem.h is not what cbindgen makes of the code (first difference at line {}: committed {:?}, \
             generated {:?}); run `CUMEM_BLESS=1 cargo test -p cumem-c --test header` and commit the header",
            first + 1,
            committed.lines().nth(first),
            generated.lines().nth(first)
        );
    }
}
