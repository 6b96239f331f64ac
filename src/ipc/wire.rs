//! What crosses the socket: a handle's bytes, its descriptors, "closed".
//!
//! ```text
//!  message  = len: u32 LE | body (len bytes)
//!  body     = "CUMEMIPC" | version: u32 | what: u8 (1 handle, 2 closed) | ...
//!  handle   = kind: u8 | id: u64 | pid: u32 | uuid: [u8; 16] | size: u64
//!             | offset: u64 | fds: u32 | kind's data
//!  mapped   = pieces: u32 | size: u64 per piece (one descriptor each)
//!  alloc    = cuIpcGetMemHandle's 64 bytes (no descriptor)
//!  pool     = cuMemPoolExportPointer's 64 bytes (the pool's descriptor)
//!  closed   = id: u64
//! ```
//! Descriptors follow the message in batches of at most [`FDS_PER_BATCH`],
//! each batch attached (`SCM_RIGHTS`) to one byte of its own, so a reader
//! that takes exactly the message's bytes never swallows a batch.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use super::{HandleKind, IpcHandle};
use crate::error::{Error, Result};

const MAGIC: &[u8; 8] = b"CUMEMIPC";
const VERSION: u32 = 1;
const WHAT_HANDLE: u8 = 1;
const WHAT_CLOSED: u8 = 2;
/// The most descriptors sent with one byte.
pub(super) const FDS_PER_BATCH: usize = 64;
/// No message is larger (a handle of 2 MiB pieces over 1 TiB is ~4 MiB).
const MAX_MESSAGE: usize = 16 << 20;
/// No handle carries more descriptors than this.
const MAX_FDS: usize = 1 << 16;

fn bad(why: impl Into<String>) -> Error {
    Error::Ipc(why.into())
}

fn os(call: &'static str) -> impl FnOnce(std::io::Error) -> Error {
    move |source| Error::Os { call, source }
}

/// A cursor over a message body that fails with a clear error when short.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.bytes.len() < n {
            return Err(bad("truncated message"));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("take returned N bytes"))
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.array::<1>()?[0])
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }
}

fn header(what: u8) -> Vec<u8> {
    let mut b = Vec::with_capacity(64);
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&VERSION.to_le_bytes());
    b.push(what);
    b
}

/// The body of `handle`'s message (its descriptors travel beside it).
pub(super) fn encode_handle(h: &IpcHandle) -> Vec<u8> {
    let mut b = header(WHAT_HANDLE);
    let kind = match &h.kind {
        HandleKind::Mapped { .. } => 1u8,
        HandleKind::Allocation { .. } => 2,
        HandleKind::NativePool { .. } => 3,
    };
    b.push(kind);
    b.extend_from_slice(&h.id.to_le_bytes());
    b.extend_from_slice(&h.pid.to_le_bytes());
    b.extend_from_slice(&h.uuid);
    b.extend_from_slice(&h.size.to_le_bytes());
    b.extend_from_slice(&h.offset.to_le_bytes());
    b.extend_from_slice(&(h.fds.len() as u32).to_le_bytes());
    match &h.kind {
        HandleKind::Mapped { pieces } => {
            b.extend_from_slice(&(pieces.len() as u32).to_le_bytes());
            for p in pieces {
                b.extend_from_slice(&p.to_le_bytes());
            }
        }
        HandleKind::Allocation { handle } => b.extend_from_slice(handle),
        HandleKind::NativePool { data } => b.extend_from_slice(data),
    }
    b
}

/// What a message says, before its descriptors are attached.
#[derive(Debug)]
pub(super) enum Message {
    Handle { handle: IpcHandle, fds: usize },
    Closed { id: u64 },
}

pub(super) fn decode(body: &[u8]) -> Result<Message> {
    let mut r = Reader { bytes: body };
    if &r.array::<8>()? != MAGIC {
        return Err(bad("not a cumem message (bad magic)"));
    }
    let version = r.u32()?;
    if version != VERSION {
        return Err(bad(format!("message version {version}; this cumem speaks version {VERSION}")));
    }
    let msg = match r.u8()? {
        WHAT_CLOSED => Message::Closed { id: r.u64()? },
        WHAT_HANDLE => {
            let kind = r.u8()?;
            let (id, pid, uuid) = (r.u64()?, r.u32()?, r.array::<16>()?);
            let (size, offset, fds) = (r.u64()?, r.u64()?, r.u32()? as usize);
            let kind = match kind {
                1 => {
                    let n = r.u32()? as usize;
                    if n == 0 || n > MAX_FDS || n != fds {
                        return Err(bad(format!("a mapped handle with {n} pieces and {fds} descriptors")));
                    }
                    let pieces = (0..n).map(|_| r.u64()).collect::<Result<Vec<_>>>()?;
                    let total = pieces.iter().try_fold(0u64, |t, &p| t.checked_add(p));
                    if pieces.contains(&0) || total.is_none_or(|t| offset.checked_add(size).is_none_or(|e| e > t)) {
                        return Err(bad("a mapped handle whose block lies outside its pieces"));
                    }
                    HandleKind::Mapped { pieces }
                }
                2 if fds == 0 => HandleKind::Allocation { handle: r.array()? },
                3 if fds == 1 => HandleKind::NativePool { data: r.array()? },
                k => return Err(bad(format!("unknown handle kind {k} with {fds} descriptors"))),
            };
            if size == 0 {
                return Err(bad("a handle of an empty block"));
            }
            Message::Handle { handle: IpcHandle { kind, id, pid, uuid, size, offset, fds: Vec::new() }, fds }
        }
        w => return Err(bad(format!("unknown message type {w}"))),
    };
    if !r.bytes.is_empty() {
        return Err(bad("trailing bytes after the message"));
    }
    Ok(msg)
}

fn write_message(socket: &UnixStream, body: &[u8]) -> Result<()> {
    let mut s = socket;
    let len = u32::try_from(body.len()).map_err(|_| bad("message too large"))?;
    s.write_all(&len.to_le_bytes()).map_err(os("write"))?;
    s.write_all(body).map_err(os("write"))
}

fn read_message(socket: &UnixStream) -> Result<Vec<u8>> {
    let mut s = socket;
    let mut len = [0u8; 4];
    s.read_exact(&mut len).map_err(os("read"))?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_MESSAGE {
        return Err(bad(format!("a {len} B message (at most {MAX_MESSAGE} B)")));
    }
    let mut body = vec![0u8; len];
    s.read_exact(&mut body).map_err(os("read"))?;
    Ok(body)
}

/// Runs `f` with a message of one byte whose control buffer has room for
/// `payload` bytes of `SCM_RIGHTS` data (what `sendmsg` and `recvmsg`
/// both take); every buffer the message points at lives across `f`.
fn with_one_byte_msg<R>(payload: usize, f: impl FnOnce(&mut libc::msghdr) -> R) -> R {
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(payload as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
    // SAFETY: msghdr is plain data; zero is a valid start.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    f(&mut msg)
}

/// Retries `call` while it is interrupted by a signal.
fn retry(mut call: impl FnMut() -> isize) -> isize {
    loop {
        let n = call();
        if n != -1 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return n;
        }
    }
}

/// Sends `fds` with one byte (`sendmsg` with `SCM_RIGHTS`).
fn send_fds(socket: &UnixStream, fds: &[OwnedFd]) -> Result<()> {
    let raw: Vec<libc::c_int> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let payload = std::mem::size_of_val(raw.as_slice());
    let n = with_one_byte_msg(payload, |msg| {
        // SAFETY: `msg` has a control buffer of CMSG_SPACE(payload) bytes
        // (8-aligned), so the first header exists and its data holds
        // `payload` bytes; `raw` has exactly `payload` bytes.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(payload as u32) as _;
            std::ptr::copy_nonoverlapping(raw.as_ptr().cast::<u8>(), libc::CMSG_DATA(cmsg), payload);
        }
        // SAFETY: `msg` and everything it points at live across the call.
        retry(|| unsafe { libc::sendmsg(socket.as_raw_fd(), &*msg, libc::MSG_NOSIGNAL) })
    });
    match n {
        1 => Ok(()),
        -1 => Err(os("sendmsg")(std::io::Error::last_os_error())),
        _ => Err(bad("sendmsg sent nothing")),
    }
}

/// Receives one batch of at most `want` descriptors (`recvmsg`).
fn recv_fds(socket: &UnixStream, want: usize) -> Result<Vec<OwnedFd>> {
    let payload = want * std::mem::size_of::<libc::c_int>();
    with_one_byte_msg(payload, |msg| {
        // SAFETY: `msg` and all it points at live across the call; cloexec fds.
        let n = retry(|| unsafe { libc::recvmsg(socket.as_raw_fd(), &mut *msg, libc::MSG_CMSG_CLOEXEC) });
        if n == -1 {
            return Err(os("recvmsg")(std::io::Error::last_os_error()));
        }
        let mut fds = Vec::new();
        // SAFETY: the kernel filled `msg_controllen` bytes of the control
        // buffer with well-formed headers; each SCM_RIGHTS header's data
        // holds `(cmsg_len - CMSG_LEN(0)) / sizeof(int)` descriptors now
        // owned by this process, each taken into an `OwnedFd` once.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                    let len = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                    let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                    for i in 0..len / std::mem::size_of::<libc::c_int>() {
                        fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                    }
                }
                cmsg = libc::CMSG_NXTHDR(msg, cmsg);
            }
        }
        if n == 0 {
            return Err(bad("the peer closed the connection"));
        }
        if msg.msg_flags & libc::MSG_CTRUNC != 0 {
            return Err(bad("descriptors were cut off (more than announced)"));
        }
        Ok(fds)
    })
}

/// Sends `handle` and its descriptors.
pub(super) fn send_handle(socket: &UnixStream, handle: &IpcHandle) -> Result<()> {
    write_message(socket, &encode_handle(handle))?;
    for batch in handle.fds.chunks(FDS_PER_BATCH) {
        send_fds(socket, batch)?;
    }
    Ok(())
}

/// Sends "export `id` is closed here".
pub(super) fn send_closed(socket: &UnixStream, id: u64) -> Result<()> {
    let mut b = header(WHAT_CLOSED);
    b.extend_from_slice(&id.to_le_bytes());
    write_message(socket, &b)
}

/// Receives the next message, with a handle's descriptors attached.
pub(super) fn recv(socket: &UnixStream) -> Result<Message> {
    match decode(&read_message(socket)?)? {
        Message::Handle { mut handle, fds } => {
            while handle.fds.len() < fds {
                let batch = recv_fds(socket, (fds - handle.fds.len()).min(FDS_PER_BATCH))?;
                if batch.is_empty() {
                    return Err(bad("a descriptor batch arrived without descriptors"));
                }
                handle.fds.extend(batch);
            }
            if handle.fds.len() != fds {
                return Err(bad(format!("{} descriptors arrived for {fds} announced", handle.fds.len())));
            }
            Ok(Message::Handle { handle, fds })
        }
        m => Ok(m),
    }
}

#[cfg(test)]
mod tests;
