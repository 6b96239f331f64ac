//! An event log of allocations and frees in RMM's CSV format
//! (`Thread,Time,Action,Pointer,Size,Stream`), written off the hot path.
//!
//! # Implementation details
//!
//! A call that allocates or frees puts one fixed-size [`Event`] into a
//! bounded channel (`crossbeam::channel`, an array queue: no allocation, no
//! system call, no lock held by the pools). A writer thread owned by the
//! log takes events off the channel and writes them through a buffered
//! file. When the channel is full (the writer can't keep up) the caller
//! waits for room rather than drop an event, so a log is always complete
//! enough to replay. [`EventLog::flush`] waits until everything recorded so
//! far is in the file; dropping the log flushes and stops the writer.
//!
//! The `cumem-replay` crate reads the same format back, so a program's own
//! log can be replayed with the `cumem-replay` tool.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{SystemTime, UNIX_EPOCH};

use crossbeam::channel::{self, Receiver, Sender};

use crate::error::{Error, Result};
use crate::sync::{lock, Arc, Mutex};

/// Events the channel holds before a recording call waits for the writer.
const CAPACITY: usize = 1 << 16;

/// What an event did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// An allocation that succeeded.
    Allocate,
    /// An allocation that failed.
    AllocateFailure,
    /// A free.
    Free,
}

impl Action {
    /// The word in the log's `Action` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Allocate => "allocate",
            Action::AllocateFailure => "allocate failure",
            Action::Free => "free",
        }
    }
}

/// One recorded call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    /// The calling thread (the kernel's thread id).
    pub thread: u64,
    /// Microseconds since the Unix epoch.
    pub time_us: u64,
    /// What happened.
    pub action: Action,
    /// The address (0 for a failure).
    pub pointer: u64,
    /// Bytes asked for.
    pub size: usize,
    /// The stream (`CUstream` value; 0 for none or the default stream).
    pub stream: u64,
}

enum Message {
    Event(Event),
    Flush(Sender<()>),
}

/// The first write error, kept for [`EventLog::flush`] to report.
type WriteError = Arc<Mutex<Option<(std::io::ErrorKind, String)>>>;

/// A log of allocation events, written to a file by a background thread.
///
/// # Examples
/// ```
/// use cumem::log::EventLog;
/// let path = std::env::temp_dir().join(format!("cumem-doc-{}.csv", std::process::id()));
/// let log = EventLog::create(&path)?;
/// log.allocated(0x1000, 256, 0);
/// log.freed(0x1000, 256, 0);
/// log.flush()?;
/// let text = std::fs::read_to_string(&path).unwrap();
/// assert!(text.starts_with("Thread,Time,Action,Pointer,Size,Stream\n"));
/// assert_eq!(text.lines().count(), 3);
/// # drop(log); std::fs::remove_file(&path).unwrap();
/// # Ok::<(), cumem::Error>(())
/// ```
pub struct EventLog {
    tx: Option<Sender<Message>>,
    writer: Option<JoinHandle<()>>,
    error: WriteError,
    path: PathBuf,
}

impl std::fmt::Debug for EventLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventLog").field("path", &self.path).finish()
    }
}

impl EventLog {
    /// Creates (or truncates) `path`, writes the header, starts the writer.
    ///
    /// # Errors
    /// [`Error::Os`] when the file can't be created or the thread started.
    pub fn create(path: impl AsRef<Path>) -> Result<EventLog> {
        let path = path.as_ref().to_path_buf();
        let file = File::create(&path).map_err(|source| Error::Os { call: "create (event log file)", source })?;
        let mut out = BufWriter::with_capacity(1 << 20, file);
        out.write_all(b"Thread,Time,Action,Pointer,Size,Stream\n")
            .map_err(|source| Error::Os { call: "write (event log file)", source })?;
        let (tx, rx) = channel::bounded(CAPACITY);
        let error: WriteError = Arc::new(Mutex::new(None));
        let writer_error = error.clone();
        let writer = std::thread::Builder::new()
            .name("cumem-event-log".into())
            .spawn(move || write_events(rx, out, writer_error))
            .map_err(|source| Error::Os { call: "spawn (event log writer)", source })?;
        Ok(EventLog { tx: Some(tx), writer: Some(writer), error, path })
    }

    /// The file the log writes.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Records an event (waits only when the writer is 65,536 behind).
    pub fn record(&self, action: Action, pointer: u64, size: usize, stream: u64) {
        let event = Event { thread: thread_id(), time_us: now_us(), action, pointer, size, stream };
        if let Some(tx) = &self.tx {
            // A send fails only after a write error, which `flush` reports.
            let _ = tx.send(Message::Event(event));
        }
    }

    /// Records a successful allocation.
    pub fn allocated(&self, pointer: u64, size: usize, stream: u64) {
        self.record(Action::Allocate, pointer, size, stream);
    }

    /// Records a failed allocation.
    pub fn failed(&self, size: usize, stream: u64) {
        self.record(Action::AllocateFailure, 0, size, stream);
    }

    /// Records a free.
    pub fn freed(&self, pointer: u64, size: usize, stream: u64) {
        self.record(Action::Free, pointer, size, stream);
    }

    /// Records an allocation (`allocate` and the pointer, `allocate failure`).
    pub(crate) fn note_allocation<E>(
        log: &Option<EventLog>,
        r: &std::result::Result<u64, E>,
        size: usize,
        stream: u64,
    ) {
        match (log, r) {
            (Some(log), Ok(p)) => log.allocated(*p, size, stream),
            (Some(log), Err(_)) => log.failed(size, stream),
            (None, _) => {}
        }
    }

    /// Records a free that succeeded (`r` holds the freed size).
    pub(crate) fn note_free<E>(log: &Option<EventLog>, r: &std::result::Result<usize, E>, pointer: u64, stream: u64) {
        if let (Some(log), Ok(size)) = (log, r) {
            log.freed(pointer, *size, stream);
        }
    }

    /// Waits until every event recorded so far is in the file (flushed).
    ///
    /// # Errors
    /// [`Error::Os`]: the writer's first write error (later events are lost).
    pub fn flush(&self) -> Result<()> {
        let (ack_tx, ack_rx) = channel::bounded(1);
        let sent = self.tx.as_ref().is_some_and(|tx| tx.send(Message::Flush(ack_tx)).is_ok());
        if sent {
            // The writer answers every flush it receives; a closed channel
            // means it stopped, and the error below says why.
            let _ = ack_rx.recv();
        }
        match &*lock(&self.error) {
            Some((kind, msg)) => {
                Err(Error::Os { call: "write (event log file)", source: std::io::Error::new(*kind, msg.clone()) })
            }
            None if sent => Ok(()),
            None => Err(Error::InvalidState("the event log's writer thread has stopped".into())),
        }
    }
}

impl Drop for EventLog {
    fn drop(&mut self) {
        // A closed channel tells the writer to write what is left and stop.
        drop(self.tx.take());
        if let Some(w) = self.writer.take() {
            if w.join().is_err() {
                eprintln!("cumem: the event log writer for {} panicked", self.path.display());
            }
        }
        if let Some((_, msg)) = &*lock(&self.error) {
            eprintln!("cumem: writing the event log {} failed: {msg}", self.path.display());
        }
    }
}

fn write_events(rx: Receiver<Message>, mut out: BufWriter<File>, error: WriteError) {
    let mut failed = false;
    let fail = |e: std::io::Error, failed: &mut bool| {
        let mut slot = lock(&error);
        if slot.is_none() {
            *slot = Some((e.kind(), e.to_string()));
        }
        *failed = true;
    };
    for msg in rx.iter() {
        match msg {
            Message::Event(e) if !failed => {
                if let Err(err) = write_event(&mut out, &e) {
                    fail(err, &mut failed);
                }
            }
            Message::Event(_) => {}
            Message::Flush(ack) => {
                if !failed {
                    if let Err(err) = out.flush() {
                        fail(err, &mut failed);
                    }
                }
                let _ = ack.send(());
            }
        }
    }
    if !failed {
        if let Err(err) = out.flush() {
            fail(err, &mut failed);
        }
    }
}

/// Writes one line: pointers hex, a nonzero stream hex, the rest decimal.
fn write_event(out: &mut impl Write, e: &Event) -> std::io::Result<()> {
    write!(out, "{},{},{},{:#x},{},", e.thread, e.time_us, e.action.as_str(), e.pointer, e.size)?;
    if e.stream == 0 {
        out.write_all(b"0\n")
    } else {
        writeln!(out, "{:#x}", e.stream)
    }
}

fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

fn thread_id() -> u64 {
    thread_local! {
        // SAFETY: gettid has no preconditions and can't fail.
        static TID: u64 = unsafe { libc::gettid() } as u64;
    }
    // During the thread's teardown (a free from another thread-local's
    // destructor) the cached id may be gone already: ask again.
    // SAFETY: as above.
    TID.try_with(|t| *t).unwrap_or_else(|_| unsafe { libc::gettid() } as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_path_is_an_error() {
        let e = EventLog::create("/nonexistent-dir/x/log.csv").unwrap_err();
        assert!(matches!(e, Error::Os { .. }), "{e}");
    }
}
