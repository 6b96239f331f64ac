use super::{Direction, Engine, Job, Plan};
use crate::copy::workers::run_with_helpers;
use crate::error::{Error, Result};

#[test]
fn plans_cover_every_byte_once() {
    for bytes in [1usize, 255, 70_000, 2 << 20, (2 << 20) + 1, 8 << 20, 300 << 20, 12_345_678] {
        for lanes in [1, 3, 8, 16] {
            for max_chunk in [256 << 10, 2 << 20, 64 << 20] {
                let p = Plan::new(bytes, max_chunk, lanes);
                assert!(p.helpers <= lanes && p.slots >= 1 && p.slots <= p.chunks);
                assert!(p.chunk <= max_chunk && (p.chunk >= 256 << 10 || p.chunks == 1));
                assert!(p.ring_bytes() <= (16 << 20).max(2 * p.chunk));
                let mut covered = 0;
                for i in 0..p.pieces() {
                    let (c, off, stage, len) = p.piece_at(i, bytes);
                    assert_eq!(c, i / p.per_chunk);
                    if len > 0 {
                        assert_eq!(off, covered, "{p:?} piece {i}");
                    }
                    assert!(len <= p.piece && stage + len <= p.ring_bytes());
                    covered += len;
                }
                assert_eq!(covered, bytes);
            }
        }
    }
    // 8 MiB: eight chunks of 1 MiB in eight 128 KiB pieces each.
    let p = Plan::new(8 << 20, 2 << 20, 8);
    assert_eq!((p.chunk, p.chunks, p.piece, p.slots, p.helpers, p.streaming), (1 << 20, 8, 128 << 10, 8, 4, true));
    // Two rings still stream; longer copies don't.
    assert!(Plan::new(32 << 20, 2 << 20, 8).streaming);
    assert!(!Plan::new((32 << 20) + 1, 2 << 20, 8).streaming);
    // 256 MiB: the largest chunks through a 16 MiB ring.
    let p = Plan::new(256 << 20, 2 << 20, 8);
    assert_eq!((p.chunk, p.chunks, p.piece, p.slots, p.helpers, p.streaming), (2 << 20, 128, 256 << 10, 8, 8, false));
    // Tiny copies stay on the calling thread.
    assert_eq!(Plan::new(1000, 2 << 20, 8).helpers, 0);
}

/// A DMA engine on host memory: a queued copy completes after a few
/// polls; it checks that no slot is reused while in flight.
struct Fake {
    dir: Direction,
    dev: Vec<u8>,
    /// Per slot: polls left until its DMA is done, and its copy.
    pending: Vec<Option<(u32, usize, usize, usize)>>,
    fail_at: Option<usize>,
    queued: usize,
}

impl Fake {
    fn finish(&mut self, slot: usize) {
        if let Some((_, stage, off, len)) = self.pending[slot].take() {
            let stage = stage as *mut u8;
            // SAFETY: `stage` is a slot of the test's ring, `len` bytes
            // long, alive for the copy.
            unsafe {
                match self.dir {
                    Direction::ToDevice => std::ptr::copy_nonoverlapping(stage, self.dev[off..].as_mut_ptr(), len),
                    Direction::ToHost => std::ptr::copy_nonoverlapping(self.dev[off..].as_ptr(), stage, len),
                }
            }
        }
    }
}

impl Engine for Fake {
    fn queue(&mut self, slot: usize, stage: *mut u8, dev_off: usize, len: usize) -> Result<()> {
        if self.fail_at == Some(self.queued) {
            return Err(Error::InvalidState("injected".into()));
        }
        self.queued += 1;
        // Stream order: earlier DMAs finish first.
        for s in 0..self.pending.len() {
            if s != slot {
                self.finish(s);
            }
        }
        assert!(self.pending[slot].is_none(), "slot {slot} reused while its DMA is in flight");
        self.pending[slot] = Some((3, stage as usize, dev_off, len));
        Ok(())
    }

    fn done(&mut self, slot: usize) -> Result<bool> {
        match &mut self.pending[slot] {
            Some((0, ..)) => {
                self.finish(slot);
                Ok(true)
            }
            Some((n, ..)) => {
                *n -= 1;
                Ok(false)
            }
            None => Ok(true),
        }
    }
}

fn round_trip(bytes: usize, max_chunk: usize, lanes: usize, fail_at: Option<usize>) -> Result<(Vec<u8>, Vec<u8>)> {
    let src: Vec<u8> = (0..bytes).map(|i| (i * 7 + i / 251) as u8).collect();
    let mut out = vec![0u8; bytes];
    let mut dev = vec![0u8; bytes];
    for dir in [Direction::ToDevice, Direction::ToHost] {
        let plan = Plan::new(bytes, max_chunk, lanes);
        let mut ring = vec![0u8; plan.ring_bytes()];
        let host = if dir == Direction::ToDevice { src.as_ptr() as usize } else { out.as_mut_ptr() as usize };
        // SAFETY: both vectors outlive the job and hold the sizes it uses.
        let job = unsafe { Job::new(dir, host, ring.as_mut_ptr() as usize, bytes, plan) };
        let mut fake = Fake { dir, dev: std::mem::take(&mut dev), pending: vec![None; plan.slots], fail_at, queued: 0 };
        let r = run_with_helpers(plan.helpers, &|| job.help(), |_| job.drive(&mut fake));
        for s in 0..plan.slots {
            fake.finish(s);
        }
        dev = fake.dev;
        r?;
    }
    Ok((src, out))
}

#[test]
fn pipelines_round_trip_through_a_small_ring() {
    for (bytes, max_chunk, lanes) in [
        (1, 2 << 20, 8),
        (65_537, 2 << 20, 8),
        ((8 << 20) + 3, 2 << 20, 8),
        ((5 << 20) + 12_345, 256 << 10, 3),
        (40 << 20, 2 << 20, 2),
        ((3 << 20) + 1, 256 << 10, 1),
    ] {
        let (src, out) = round_trip(bytes, max_chunk, lanes, None).unwrap();
        assert!(src == out, "{bytes} B with chunks up to {max_chunk} on {lanes} lanes");
    }
}

#[test]
fn a_driver_error_stops_the_helpers() {
    for fail_at in [0, 1, 5, 30] {
        let r = round_trip(20 << 20, 256 << 10, 4, Some(fail_at));
        assert!(matches!(r, Err(Error::InvalidState(m)) if m == "injected"));
    }
}
