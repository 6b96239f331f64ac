//! Allocation traces in RMM's log format, read for replay.
//!
//! The format is the CSV that RMM's `logging_resource_adaptor` writes and
//! that [`EventLog`](cumem::log::EventLog) writes too:
//!
//! ```text
//! Thread,Time,Action,Pointer,Size,Stream
//! 0,1795314508025736,allocate,0x7f212d423e00,16384,0
//! 0,1795314508034646,free,0x7f212d423e00,16384,0
//! ```
//!
//! `Action` is `allocate`, `free` or `allocate failure`; pointers are hex
//! (`0x` optional), sizes decimal bytes, streams decimal or `0x` hex. `Time`
//! is an integer (microseconds) or `HH:MM:SS.ffffff`. Columns are found by
//! the header's names; without a header the order above is assumed.
//!
//! # Implementation details
//!
//! Reading resolves pointers into *slots* once, so a replay does no hashing:
//! every allocation gets the next slot number, and a free names the slot of
//! the live allocation at its address. A free of an address with no live
//! allocation (one made before recording began) is skipped and counted; an
//! allocation at an address that is still live (its free was not recorded)
//! is counted, and the older allocation stays live to the end.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, BufWriter, Read, Write};
use std::path::Path;

pub use cumem::log::Action;
use cumem::{Error, Result};

/// One line of a trace: the event log's [`Event`](cumem::log::Event).
pub type Record = cumem::log::Event;

/// One operation of a replay, with pointers resolved to slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Allocate `size` bytes and keep the pointer in `slot`.
    Allocate {
        /// Where the replay keeps the pointer (slots count allocations from 0).
        slot: u32,
        /// Bytes asked for.
        size: usize,
    },
    /// Free the allocation in `slot`.
    Free {
        /// The slot of a live allocation.
        slot: u32,
    },
}

/// A trace, read and resolved for replay.
///
/// # Examples
/// ```
/// let csv = "Thread,Time,Action,Pointer,Size,Stream\n0,1,allocate,0x1000,512,0x0\n0,2,free,0x1000,512,0x0\n";
/// let trace = cumem_replay::trace::parse_str(csv)?;
/// assert_eq!((trace.operations(), trace.peak_live), (2, 512));
/// # Ok::<(), cumem::Error>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trace {
    /// A name for reports (the file name without `.csv.gz`).
    pub name: String,
    /// Every line, in file order (failures and unmatched frees included).
    pub records: Vec<Record>,
    /// The operations a replay performs, in order.
    pub ops: Vec<Op>,
    /// Slots `ops` uses (the number of allocations).
    pub slots: usize,
    /// Frees of addresses with no live allocation, skipped.
    pub skipped_frees: usize,
    /// `allocate failure` lines (not replayed).
    pub failures: usize,
    /// Allocations at an address that was still live.
    pub duplicate_allocations: usize,
    /// Allocations of 0 bytes (not replayed).
    pub zero_sizes: usize,
    /// The largest sum of the sizes of live allocations over the trace.
    pub peak_live: usize,
    /// Allocations still live at the end.
    pub live_at_end: usize,
    /// The stream of each of `ops` (same length), as an index into
    /// `stream_ids`: streams are numbered in order of first appearance. A
    /// free's stream is the one its line names (where the program freed
    /// it), which need not be the allocation's.
    pub op_streams: Vec<u32>,
    /// The `Stream` values of the trace's operations, by index.
    pub stream_ids: Vec<u64>,
}

/// Column positions, from the header.
#[derive(Debug, Clone, Copy)]
struct Columns {
    thread: usize,
    time: usize,
    action: usize,
    pointer: usize,
    size: usize,
    stream: usize,
    count: usize,
}

const DEFAULT_COLUMNS: Columns = Columns { thread: 0, time: 1, action: 2, pointer: 3, size: 4, stream: 5, count: 6 };

impl Columns {
    fn from_header(fields: &[&str]) -> Option<Columns> {
        let find = |name: &str| fields.iter().position(|f| f.eq_ignore_ascii_case(name));
        Some(Columns {
            thread: find("thread")?,
            time: find("time")?,
            action: find("action")?,
            pointer: find("pointer")?,
            size: find("size")?,
            stream: find("stream")?,
            count: fields.len(),
        })
    }
}

fn parse_hex(s: &str) -> Option<u64> {
    let digits = s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")).unwrap_or(s);
    if s == "(nil)" || s.eq_ignore_ascii_case("nullptr") {
        return Some(0);
    }
    u64::from_str_radix(digits, 16).ok()
}

fn parse_number(s: &str) -> Option<u64> {
    match s.strip_prefix("0x").or_else(|| s.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => s.parse().ok(),
    }
}

/// `1234` (microseconds) or `HH:MM:SS.ffffff`.
fn parse_time(s: &str) -> Option<u64> {
    if let Ok(us) = s.parse() {
        return Some(us);
    }
    let mut parts = s.split(':');
    let (h, m, sec) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let (whole, frac) = sec.split_once('.').unwrap_or((sec, "0"));
    let frac_us: u64 = format!("{frac:0<6}").get(..6)?.parse().ok()?;
    let secs = h.parse::<u64>().ok()? * 3600 + m.parse::<u64>().ok()? * 60 + whole.parse::<u64>().ok()?;
    Some(secs * 1_000_000 + frac_us)
}

fn parse_action(s: &str) -> Option<Action> {
    match s.to_ascii_lowercase().as_str() {
        "allocate" => Some(Action::Allocate),
        "free" => Some(Action::Free),
        "allocate failure" | "allocate_failure" => Some(Action::AllocateFailure),
        _ => None,
    }
}

/// Resolves records into slots and tracks live bytes, one record at a time.
#[derive(Default)]
struct Resolver {
    live: HashMap<u64, (u32, usize)>,
    live_bytes: usize,
    /// Stream values seen so far → their index.
    streams: HashMap<u64, u32>,
}

impl Trace {
    /// Reads a trace file, gzip-compressed (by its magic bytes) or plain.
    ///
    /// # Errors
    /// [`Error::Os`] when the file can't be opened or read;
    /// [`Error::Trace`] naming the line that is malformed.
    pub fn read(path: impl AsRef<Path>) -> Result<Trace> {
        let path = path.as_ref();
        let file = std::fs::File::open(path).map_err(|source| Error::Os { call: "open (trace file)", source })?;
        let mut trace = parse_reader(file, &path.display().to_string())?;
        trace.name = trace_name(path);
        Ok(trace)
    }

    /// Parses a trace from CSV text; `source` names it in errors.
    ///
    /// # Errors
    /// [`Error::Trace`] naming the malformed line; [`Error::Os`] when the
    /// reader fails (a corrupt gzip stream, for instance).
    pub fn parse(reader: impl BufRead, source: &str) -> Result<Trace> {
        let mut trace = Trace { name: source.to_string(), ..Trace::default() };
        let mut columns: Option<Columns> = None;
        let mut resolver = Resolver::default();
        for (i, line) in reader.lines().enumerate() {
            let line_no = i + 1;
            let line = line.map_err(|source| Error::Os { call: "read (trace)", source })?;
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let fields: Vec<&str> = line.split(',').map(str::trim).collect();
            // First line: the header, or (digit first) a record in default order.
            let cols = match columns {
                Some(c) => c,
                None => {
                    let header = Columns::from_header(&fields);
                    let c = *columns.insert(header.unwrap_or(DEFAULT_COLUMNS));
                    if header.is_some() {
                        continue;
                    }
                    if !fields[0].starts_with(|c: char| c.is_ascii_digit()) {
                        let why = "expected the header Thread,Time,Action,Pointer,Size,Stream";
                        return Err(trace_error(source, line_no, why));
                    }
                    c
                }
            };
            let record = parse_record(&fields, &cols).map_err(|why| trace_error(source, line_no, &why))?;
            trace.push(record, &mut resolver);
        }
        trace.live_at_end = resolver.live.len() + trace.duplicate_allocations;
        Ok(trace)
    }

    /// Resolves `records` (in order) into a trace named `name`, as
    /// [`Trace::parse`] resolves the lines of a file: a generated trace and
    /// its file read back are equal but for the name.
    pub fn from_records(name: &str, records: impl IntoIterator<Item = Record>) -> Trace {
        let mut trace = Trace { name: name.to_string(), ..Trace::default() };
        let mut resolver = Resolver::default();
        for record in records {
            trace.push(record, &mut resolver);
        }
        trace.live_at_end = resolver.live.len() + trace.duplicate_allocations;
        trace
    }

    /// Writes the trace's records in RMM's log format, header first:
    /// `Time` in decimal microseconds, `Pointer` in `0x` hex, `Stream` in
    /// decimal. [`Trace::parse`] reads it back to an equal trace.
    ///
    /// # Errors
    /// The writer's.
    pub fn write_csv(&self, writer: impl Write) -> std::io::Result<()> {
        let mut w = BufWriter::new(writer);
        writeln!(w, "Thread,Time,Action,Pointer,Size,Stream")?;
        for r in &self.records {
            let action = match r.action {
                Action::Allocate => "allocate",
                Action::Free => "free",
                Action::AllocateFailure => "allocate failure",
            };
            writeln!(w, "{},{},{},{:#x},{},{}", r.thread, r.time_us, action, r.pointer, r.size, r.stream)?;
        }
        w.flush()
    }

    /// Writes the trace to `path` as [`write_csv`](Self::write_csv) does,
    /// gzip-compressed when the name ends in `.gz`.
    ///
    /// # Errors
    /// [`Error::Os`] when the file can't be created or written.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let os = |call| move |source| Error::Os { call, source };
        let file = std::fs::File::create(path).map_err(os("create (trace file)"))?;
        if path.extension().is_some_and(|e| e == "gz") {
            let mut gz = flate2::write::GzEncoder::new(file, flate2::Compression::default());
            self.write_csv(&mut gz).map_err(os("write (trace file)"))?;
            gz.finish().map_err(os("write (trace file)"))?;
        } else {
            self.write_csv(file).map_err(os("write (trace file)"))?;
        }
        Ok(())
    }

    fn stream_index(&mut self, stream: u64, r: &mut Resolver) -> u32 {
        let next = self.stream_ids.len() as u32;
        let i = *r.streams.entry(stream).or_insert(next);
        if i == next {
            self.stream_ids.push(stream);
        }
        i
    }

    /// How many streams the trace's operations use (at least 1).
    pub fn streams(&self) -> usize {
        self.stream_ids.len().max(1)
    }

    fn push(&mut self, record: Record, r: &mut Resolver) {
        self.records.push(record);
        match record.action {
            Action::AllocateFailure => self.failures += 1,
            Action::Allocate if record.size == 0 => self.zero_sizes += 1,
            Action::Allocate => {
                let slot = self.slots as u32;
                self.slots += 1;
                if r.live.insert(record.pointer, (slot, record.size)).is_some() {
                    // The free of the older allocation was not recorded: it
                    // stays live to the end (its bytes still count).
                    self.duplicate_allocations += 1;
                }
                r.live_bytes += record.size;
                self.peak_live = self.peak_live.max(r.live_bytes);
                self.ops.push(Op::Allocate { slot, size: record.size });
                let stream = self.stream_index(record.stream, r);
                self.op_streams.push(stream);
            }
            Action::Free => match r.live.remove(&record.pointer) {
                Some((slot, size)) => {
                    r.live_bytes -= size;
                    self.ops.push(Op::Free { slot });
                    let stream = self.stream_index(record.stream, r);
                    self.op_streams.push(stream);
                }
                None => self.skipped_frees += 1,
            },
        }
    }

    /// Allocations and frees a replay performs.
    pub fn operations(&self) -> usize {
        self.ops.len()
    }

    /// The live bytes (sum of requested sizes) after each operation, in
    /// order: the curve the trace's peak live is the maximum of.
    pub fn live_bytes(&self) -> impl Iterator<Item = usize> + '_ {
        let mut sizes = vec![0usize; self.slots];
        let mut live = 0usize;
        self.ops.iter().map(move |op| {
            match *op {
                Op::Allocate { slot, size } => {
                    sizes[slot as usize] = size;
                    live += size;
                }
                Op::Free { slot } => live -= std::mem::take(&mut sizes[slot as usize]),
            }
            live
        })
    }
}

fn parse_record(fields: &[&str], c: &Columns) -> std::result::Result<Record, String> {
    if fields.len() < c.count {
        return Err(format!("expected {} fields, found {}", c.count, fields.len()));
    }
    let action = parse_action(fields[c.action])
        .ok_or_else(|| format!("action '{}' is not allocate, free or allocate failure", fields[c.action]))?;
    let pointer = parse_hex(fields[c.pointer]).ok_or_else(|| format!("pointer '{}' is not hex", fields[c.pointer]))?;
    let size = fields[c.size].parse::<usize>().map_err(|_| format!("size '{}' is not a byte count", fields[c.size]))?;
    let thread =
        parse_number(fields[c.thread]).ok_or_else(|| format!("thread '{}' is not a number", fields[c.thread]))?;
    let time = parse_time(fields[c.time]).ok_or_else(|| format!("time '{}' is not a time", fields[c.time]))?;
    let stream =
        parse_number(fields[c.stream]).ok_or_else(|| format!("stream '{}' is not a number", fields[c.stream]))?;
    Ok(Record { thread, time_us: time, action, pointer, size, stream })
}

fn trace_error(source: &str, line: usize, reason: &str) -> Error {
    Error::Trace { source_name: source.to_string(), line, reason: reason.to_string() }
}

/// `resnet50_train` for `.../resnet50_train.csv.gz`.
fn trace_name(path: &Path) -> String {
    let file = path.file_name().map_or_else(|| path.display().to_string(), |f| f.to_string_lossy().into_owned());
    let stem = file.strip_suffix(".gz").unwrap_or(&file);
    stem.strip_suffix(".csv").unwrap_or(stem).to_string()
}

/// Parses `text` as a trace (for tests and small inline traces).
///
/// # Errors
/// As [`Trace::parse`].
pub fn parse_str(text: &str) -> Result<Trace> {
    Trace::parse(text.as_bytes(), "<string>")
}

/// Parses a trace from a reader, gzip-compressed (magic bytes) or plain.
///
/// # Errors
/// As [`Trace::parse`].
pub fn parse_reader(reader: impl Read, source: &str) -> Result<Trace> {
    let mut reader = BufReader::with_capacity(1 << 16, reader);
    let head = reader.fill_buf().map_err(|source| Error::Os { call: "read (trace)", source })?;
    if head.starts_with(&[0x1f, 0x8b]) {
        Trace::parse(BufReader::new(flate2::read::MultiGzDecoder::new(reader)), source)
    } else {
        Trace::parse(reader, source)
    }
}

#[cfg(test)]
mod tests;
