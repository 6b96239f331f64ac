use super::*;

fn last_error() -> String {
    // SAFETY: cumem_last_error returns a NUL-terminated string that
    // stays valid until this thread's next failing call.
    unsafe { std::ffi::CStr::from_ptr(cumem_last_error()) }.to_string_lossy().into_owned()
}

#[test]
fn a_panic_becomes_a_status_and_a_message() {
    let s = guard(|| panic!("boom {}", 7));
    assert_eq!(s, CumemStatus::Panic);
    assert!(last_error().contains("boom 7"), "{}", last_error());
    assert_eq!(guard(|| std::panic::panic_any(3_u8)), CumemStatus::Panic);
    assert!(last_error().contains("without a message"));
}

#[test]
fn success_keeps_the_last_error_and_failure_sets_it() {
    assert_eq!(guard(|| Err(Failure::new(CumemStatus::Other, "first\0hidden"))), CumemStatus::Other);
    assert_eq!(last_error(), "first");
    assert_eq!(guard(|| Ok(())), CumemStatus::Ok);
    assert_eq!(last_error(), "first");
}

fn status_name(v: i32) -> &'static str {
    // SAFETY: cumem_status_name returns a static NUL-terminated string.
    unsafe { std::ffi::CStr::from_ptr(cumem_status_name(v)) }.to_str().unwrap()
}

/// Every enumerator of the committed header, by value, gets its own
/// name; the values next to them get none. A status added to the enum
/// (and so to the header) but not to `NAMES` fails here.
#[test]
fn every_status_of_the_header_has_its_name() {
    let header = include_str!("../../include/cumem.h");
    let end = header.find("} CumemStatus;").expect("the header has the enum");
    let body = &header[header[..end].rfind("typedef enum {").unwrap()..end];
    let listed: Vec<(String, i32)> = body
        .lines()
        .filter_map(|l| {
            let (name, value) = l.trim().trim_end_matches(',').split_once(" = ")?;
            Some((name.to_string(), value.parse().ok()?))
        })
        .collect();
    assert_eq!(listed.len(), NAMES.len(), "the header's statuses: {listed:?}");
    for (name, value) in &listed {
        assert_eq!(status_name(*value), name, "status {value}");
    }
    let top = listed.iter().map(|l| l.1).max().unwrap();
    for v in [-1, top + 1, top + 2, i32::MAX, i32::MIN] {
        assert_eq!(status_name(v), "CUMEM_STATUS_UNKNOWN", "{v}");
    }
    for (i, (s, _)) in NAMES.iter().enumerate() {
        assert_eq!(*s as i32, i as i32, "NAMES is in value order");
    }
}
