use std::os::fd::AsFd;

use super::*;

fn handle(kind: HandleKind, fds: Vec<OwnedFd>) -> IpcHandle {
    IpcHandle { kind, id: 7, pid: 42, uuid: [3; 16], size: 1 << 20, offset: 4096, fds }
}

fn null_fds(n: usize) -> Vec<OwnedFd> {
    let f = std::fs::File::open("/dev/null").unwrap();
    (0..n).map(|_| f.as_fd().try_clone_to_owned().unwrap()).collect()
}

#[test]
fn a_handle_with_more_descriptors_than_one_batch_crosses_a_socket_whole() {
    let n = FDS_PER_BATCH * 2 + 3;
    let pieces = vec![2u64 << 20; n];
    let sent = handle(HandleKind::Mapped { pieces: pieces.clone() }, null_fds(n));
    let (a, b) = UnixStream::pair().unwrap();
    // The "closed" message right behind the handle must not be merged
    // into it, nor its descriptors lost.
    let writer = std::thread::spawn(move || {
        send_handle(&a, &sent).unwrap();
        send_closed(&a, 9).unwrap();
        sent
    });
    let Message::Handle { handle: got, fds } = recv(&b).unwrap() else { panic!("a handle") };
    let sent = writer.join().unwrap();
    assert_eq!(fds, n);
    assert_eq!((got.kind, got.id, got.pid, got.uuid), (sent.kind.clone(), 7, 42, [3; 16]));
    assert_eq!((got.size, got.offset), (1 << 20, 4096));
    assert_eq!(got.fds.len(), n);
    for fd in &got.fds {
        // Each received descriptor is a live, new descriptor of /dev/null.
        let meta = std::fs::File::from(fd.try_clone().unwrap()).metadata().unwrap();
        assert!(!meta.is_file() && !meta.is_dir());
        assert!(!sent.fds.iter().any(|s| s.as_raw_fd() == fd.as_raw_fd()));
    }
    assert!(matches!(recv(&b).unwrap(), Message::Closed { id: 9 }));
}

#[test]
fn every_kind_survives_bytes_and_back() {
    let kinds = [
        (HandleKind::Mapped { pieces: vec![2 << 20, 4 << 20] }, 2),
        (HandleKind::Allocation { handle: [0xab; 64] }, 0),
        (HandleKind::NativePool { data: [0xcd; 64] }, 1),
    ];
    for (kind, n) in kinds {
        let h = handle(kind.clone(), null_fds(n));
        let back = IpcHandle::from_parts(&h.to_bytes(), null_fds(n)).unwrap();
        assert_eq!((back.kind, back.size, back.offset, back.fds.len()), (kind, h.size, h.offset, n));
        if n > 0 {
            assert!(matches!(IpcHandle::from_parts(&h.to_bytes(), null_fds(n - 1)), Err(Error::Ipc(_))));
        }
    }
}

#[test]
fn malformed_messages_are_refused_with_a_reason() {
    let good = encode_handle(&handle(HandleKind::Mapped { pieces: vec![2 << 20] }, null_fds(1)));
    // Every truncation, and bytes after the end.
    for cut in 0..good.len() {
        assert!(matches!(decode(&good[..cut]), Err(Error::Ipc(_))), "cut at {cut}");
    }
    let mut long = good.clone();
    long.push(0);
    assert!(matches!(decode(&long), Err(Error::Ipc(_))));
    // A bad magic, a version from the future, an unknown kind.
    for (at, value) in [(0, b'X'), (8, 9), (13, 9)] {
        let mut bad = good.clone();
        bad[at] = value;
        assert!(matches!(decode(&bad), Err(Error::Ipc(_))), "byte {at}");
    }
    // A block that lies outside its pieces.
    let outside = encode_handle(&IpcHandle {
        offset: 2 << 20,
        ..handle(HandleKind::Mapped { pieces: vec![2 << 20] }, null_fds(1))
    });
    assert!(matches!(decode(&outside), Err(Error::Ipc(_))));
    // A peer that hangs up mid-message.
    let (a, b) = UnixStream::pair().unwrap();
    (&a).write_all(&(good.len() as u32).to_le_bytes()).unwrap();
    (&a).write_all(&good[..10]).unwrap();
    drop(a);
    assert!(matches!(recv(&b), Err(Error::Os { .. })));
}
