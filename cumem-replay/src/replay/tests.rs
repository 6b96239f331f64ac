use super::*;

#[test]
fn target_names_round_trip() {
    for t in Target::KNOWN {
        assert_eq!(t.name().parse::<Target>().unwrap(), t);
    }
    assert_eq!(Target::parse_list("all").unwrap().len(), 6);
    assert_eq!(Target::parse_list("all,sim_device").unwrap().len(), 7);
    assert_eq!(Target::parse_list("host, raw_cumemalloc,host").unwrap(), vec![Target::Host, Target::RawCuMemAlloc]);
    let e = Target::parse_list("host,nope").unwrap_err().to_string();
    assert!(e.contains("'nope'"), "{e}");
    assert!(Target::parse_list(" ").is_err());
}

#[test]
fn median_of_odd_and_even() {
    assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
    assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    assert_eq!(median(&mut []), 0.0);
}
