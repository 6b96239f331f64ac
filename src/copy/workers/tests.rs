use super::run_with_helpers;
use crate::error::Error;
use crate::sync::{AtomicUsize, Ordering};

#[test]
fn every_helper_runs_once_and_main_result_comes_back() {
    for helpers in [0usize, 1, 2, 5, 8] {
        let hits = AtomicUsize::new(0);
        let r = run_with_helpers(
            helpers,
            &|| {
                hits.fetch_add(1, Ordering::Relaxed);
            },
            |started| {
                assert_eq!(started, helpers);
                Ok(())
            },
        );
        r.unwrap();
        assert_eq!(hits.load(Ordering::Relaxed), helpers);
    }
    let r = run_with_helpers(3, &|| {}, |_| Err(Error::InvalidState("main".into())));
    assert!(matches!(r, Err(Error::InvalidState(m)) if m == "main"));
}

#[test]
fn a_panicking_helper_is_waited_for_and_re_raised() {
    let done = AtomicUsize::new(0);
    let turn = AtomicUsize::new(0);
    let r = std::panic::catch_unwind(|| {
        run_with_helpers(
            3,
            &|| {
                if turn.fetch_add(1, Ordering::Relaxed) == 0 {
                    panic!("helper");
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
                done.fetch_add(1, Ordering::Relaxed);
            },
            |_| Ok(()),
        )
    });
    assert!(r.is_err());
    assert_eq!(done.load(Ordering::Relaxed), 2, "the other helpers finished first");
}
