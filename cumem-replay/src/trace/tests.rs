use super::*;

const SMALL: &str = "Thread,Time,Action,Pointer,Size,Stream\n\
    0,10,allocate,0x1000,100,0\n\
    0,11,allocate,0x2000,50,0\n\
    0,12,free,0x1000,100,0\n\
    0,13,free,0x9999,7,0\n\
    0,14,allocate failure,0x0,1000000,0\n\
    0,15,allocate,0x1000,30,0\n\
    0,16,free,0x2000,50,0\n";

#[test]
fn resolves_slots_and_peaks() {
    let t = parse_str(SMALL).unwrap();
    assert_eq!(t.records.len(), 7);
    assert_eq!(t.skipped_frees, 1);
    assert_eq!(t.failures, 1);
    assert_eq!(t.peak_live, 150);
    assert_eq!(t.live_bytes().max(), Some(t.peak_live), "the live curve peaks at peak_live");
    assert_eq!(t.live_bytes().count(), t.operations());
    assert_eq!(t.live_at_end, 1);
    assert_eq!(
        t.ops,
        vec![
            Op::Allocate { slot: 0, size: 100 },
            Op::Allocate { slot: 1, size: 50 },
            Op::Free { slot: 0 },
            Op::Allocate { slot: 2, size: 30 },
            Op::Free { slot: 1 },
        ]
    );
}

#[test]
fn malformed_lines_name_the_line() {
    let bad = "Thread,Time,Action,Pointer,Size,Stream\n0,1,allocate,0x10,12,0\n0,2,allocate,zz,12,0\n";
    let e = parse_str(bad).unwrap_err().to_string();
    assert!(e.contains("line 3") && e.contains("'zz'"), "{e}");
    let e = parse_str("0,1,alloc,0x10,12,0\n").unwrap_err().to_string();
    assert!(e.contains("line 1") && e.contains("alloc"), "{e}");
    let e = parse_str("Thread,Time,Action,Pointer,Size,Stream\n0,1,free,0x10\n").unwrap_err().to_string();
    assert!(e.contains("line 2") && e.contains("expected 6 fields"), "{e}");
    assert!(parse_str("hello\n").is_err());
}

#[test]
fn duplicate_allocations_stay_live() {
    let t = parse_str("0,1,allocate,0x10,8,0\n0,2,allocate,0x10,4,0\n0,3,free,0x10,4,0\n").unwrap();
    assert_eq!(t.duplicate_allocations, 1);
    assert_eq!(t.peak_live, 12);
    assert_eq!(t.live_at_end, 1);
}

#[test]
fn times_and_gzip() {
    assert_eq!(parse_time("01:00:02.5"), Some(3_602_500_000));
    assert_eq!(parse_time("17"), Some(17));
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    std::io::Write::write_all(&mut gz, SMALL.as_bytes()).unwrap();
    let bytes = gz.finish().unwrap();
    let t = parse_reader(&bytes[..], "gz").unwrap();
    assert_eq!(t.peak_live, 150);
    assert_eq!(trace_name(Path::new("/a/bert_train.csv.gz")), "bert_train");
}

#[test]
fn written_traces_read_back_equal() {
    let t = parse_str(SMALL).unwrap();
    let mut text = Vec::new();
    t.write_csv(&mut text).unwrap();
    let mut back = parse_reader(&text[..], "back").unwrap();
    back.name = t.name.clone();
    assert_eq!(back, t, "failures and unmatched frees included");
    let built = Trace::from_records("<string>", t.records.iter().copied());
    assert_eq!(built, t);
    let path = std::env::temp_dir().join(format!("cumem-trace-write-{}.csv.gz", std::process::id()));
    t.write(&path).unwrap();
    let mut file = Trace::read(&path).unwrap();
    assert_eq!(file.name, format!("cumem-trace-write-{}", std::process::id()));
    file.name = t.name.clone();
    assert_eq!(file, t);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn streams_are_numbered_in_order_of_first_use() {
    let text = "Thread,Time,Action,Pointer,Size,Stream\n\
                0,1,allocate,0x100,10,0x7\n\
                0,2,allocate,0x200,10,0x9\n\
                0,3,free,0x100,10,0x9\n\
                0,4,free,0x999,10,0x5\n\
                0,5,free,0x200,10,0x7\n";
    let t = parse_str(text).unwrap();
    assert_eq!(t.stream_ids, vec![7, 9]);
    assert_eq!(t.op_streams, vec![0, 1, 1, 0], "the skipped free takes no stream");
    assert_eq!(t.streams(), 2);
    assert_eq!(parse_str("Thread,Time,Action,Pointer,Size,Stream\n").unwrap().streams(), 1);
}
