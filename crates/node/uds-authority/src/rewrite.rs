//! The client-to-server byte stream of one HTTP/2 connection, re-framed so
//! that h2 accepts any `:authority`.
//!
//! h2 (under tonic) resets a stream whose `:authority` is not a URI
//! authority, and unix-socket clients send exactly that: grpc-go before
//! kubelet 1.26 and grpcio's C-core send the socket path. The server side
//! cannot be configured to accept it, so this sits below h2: every header
//! block is HPACK-decoded with the client's dynamic table, an invalid
//! `:authority` becomes `localhost`, and the block is re-encoded with
//! literals only ("without indexing"). Re-encoding *every* block keeps the
//! server's dynamic table empty, so it never disagrees with the client's.
//! All other frames pass through byte for byte; DATA payloads are streamed,
//! never buffered whole.

use loona_hpack::Decoder;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// Every HTTP/2 peer accepts frames of this size (the protocol's minimum
/// SETTINGS_MAX_FRAME_SIZE), so re-framed blocks never exceed it.
const MAX_FRAME: usize = 16_384;
/// What an unusable authority is replaced with (what kubelet ≥ 1.26 sends).
pub const REPLACEMENT: &[u8] = b"localhost";

enum Mode {
    Preface,
    Frames,
    /// Not HTTP/2 as expected (bad preface, malformed frame, undecodable
    /// block): forward verbatim and let h2 report the error to the client.
    Verbatim,
}

/// A HEADERS frame waiting for its CONTINUATIONs.
struct Pending {
    stream: u32,
    flags: u8,
    priority: Option<[u8; 5]>,
    block: Vec<u8>,
    /// The frames as received, forwarded instead if the block can't be
    /// decoded.
    raw: Vec<u8>,
}

/// Feed it what the client sent; it appends what the server should read.
pub struct Rewriter {
    mode: Mode,
    buf: Vec<u8>,
    /// Payload bytes of a pass-through frame still to forward.
    streaming: usize,
    decoder: Decoder<'static>,
    pending: Option<Pending>,
    rewritten: u64,
}

impl Default for Rewriter {
    fn default() -> Self {
        Rewriter {
            mode: Mode::Preface,
            buf: Vec::new(),
            streaming: 0,
            decoder: Decoder::new(),
            pending: None,
            rewritten: 0,
        }
    }
}

impl Rewriter {
    /// `:authority` values replaced so far on this connection.
    pub fn rewritten(&self) -> u64 {
        self.rewritten
    }

    /// Consumes `input`, appends the bytes for the server to `out`.
    pub fn feed(&mut self, mut input: &[u8], out: &mut Vec<u8>) {
        if self.streaming > 0 && self.buf.is_empty() {
            let n = self.streaming.min(input.len());
            out.extend_from_slice(&input[..n]);
            self.streaming -= n;
            input = &input[n..];
        }
        if matches!(self.mode, Mode::Verbatim) {
            out.append(&mut self.buf);
            out.extend_from_slice(input);
            return;
        }
        self.buf.extend_from_slice(input);
        let mut at = 0;
        while self.step(&mut at, out) {}
        self.buf.drain(..at);
    }

    /// One unit of progress from `self.buf[*at..]`; false when more input
    /// is needed.
    fn step(&mut self, at: &mut usize, out: &mut Vec<u8>) -> bool {
        let rest = &self.buf[*at..];
        if self.streaming > 0 {
            let n = self.streaming.min(rest.len());
            out.extend_from_slice(&rest[..n]);
            self.streaming -= n;
            *at += n;
            return n > 0;
        }
        match self.mode {
            Mode::Verbatim => {
                out.extend_from_slice(rest);
                *at = self.buf.len();
                false
            }
            Mode::Preface => {
                let n = rest.len().min(PREFACE.len());
                if rest[..n] != PREFACE[..n] {
                    self.mode = Mode::Verbatim;
                    return true;
                }
                if n < PREFACE.len() {
                    return false;
                }
                out.extend_from_slice(PREFACE);
                *at += PREFACE.len();
                self.mode = Mode::Frames;
                true
            }
            Mode::Frames => {
                if rest.len() < 9 {
                    return false;
                }
                let len =
                    usize::from(rest[0]) << 16 | usize::from(rest[1]) << 8 | usize::from(rest[2]);
                let (kind, flags) = (rest[3], rest[4]);
                let stream = u32::from_be_bytes([rest[5], rest[6], rest[7], rest[8]]) & 0x7fff_ffff;
                let header_frame = kind == HEADERS || kind == CONTINUATION;
                if self.pending.is_some() && kind != CONTINUATION {
                    // Interleaving inside a header block is a connection
                    // error; h2 says so once it sees the raw frames.
                    self.give_up(out);
                    return true;
                }
                if !header_frame {
                    out.extend_from_slice(&rest[..9]);
                    *at += 9;
                    self.streaming = len;
                    return true;
                }
                if rest.len() < 9 + len {
                    return false;
                }
                let frame = rest[..9 + len].to_vec();
                *at += 9 + len;
                if kind == HEADERS {
                    self.headers(stream, flags, frame, out);
                } else {
                    self.continuation(stream, flags, frame, out);
                }
                true
            }
        }
    }

    fn headers(&mut self, stream: u32, flags: u8, frame: Vec<u8>, out: &mut Vec<u8>) {
        let payload = &frame[9..];
        let mut start = 0;
        let mut end = payload.len();
        if flags & PADDED != 0 {
            let Some(&pad) = payload.first() else {
                return self.verbatim(frame, out);
            };
            start = 1;
            end = match end.checked_sub(usize::from(pad)) {
                Some(e) => e,
                None => return self.verbatim(frame, out),
            };
        }
        let mut priority = None;
        if flags & PRIORITY != 0 {
            if start + 5 > end {
                return self.verbatim(frame, out);
            }
            let mut p = [0; 5];
            p.copy_from_slice(&payload[start..start + 5]);
            priority = Some(p);
            start += 5;
        }
        if start > end {
            return self.verbatim(frame, out);
        }
        self.pending = Some(Pending {
            stream,
            flags,
            priority,
            block: payload[start..end].to_vec(),
            raw: frame,
        });
        if flags & END_HEADERS != 0 {
            self.finish(out);
        }
    }

    fn continuation(&mut self, stream: u32, flags: u8, frame: Vec<u8>, out: &mut Vec<u8>) {
        match &mut self.pending {
            Some(p) if p.stream == stream => {
                p.block.extend_from_slice(&frame[9..]);
                p.raw.extend_from_slice(&frame);
            }
            _ => return self.verbatim(frame, out),
        }
        if flags & END_HEADERS != 0 {
            self.finish(out);
        }
    }

    /// A whole header block: decode, fix, re-encode, re-frame.
    fn finish(&mut self, out: &mut Vec<u8>) {
        let p = self
            .pending
            .take()
            .expect("finish only with a pending block");
        let Ok(mut fields) = self.decoder.decode(&p.block) else {
            return self.verbatim(p.raw, out);
        };
        for (name, value) in &mut fields {
            if name == b":authority" && !valid_authority(value) {
                *value = REPLACEMENT.to_vec();
                self.rewritten += 1;
            }
        }
        let block = encode(&fields);
        frame_block(p.stream, p.flags & END_STREAM, p.priority, &block, out);
    }

    fn give_up(&mut self, out: &mut Vec<u8>) {
        if let Some(p) = self.pending.take() {
            out.extend_from_slice(&p.raw);
        }
        self.mode = Mode::Verbatim;
    }

    fn verbatim(&mut self, frame: Vec<u8>, out: &mut Vec<u8>) {
        self.give_up(out);
        out.extend_from_slice(&frame);
    }
}

fn valid_authority(v: &[u8]) -> bool {
    !v.is_empty() && http::uri::Authority::try_from(v).is_ok()
}

/// HPACK: every field a "literal header field without indexing — new name"
/// (RFC 7541 §6.2.2), strings raw (no Huffman).
pub(crate) fn encode(fields: &[(Vec<u8>, Vec<u8>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (name, value) in fields {
        out.push(0);
        for s in [name, value] {
            integer(s.len(), 7, 0, &mut out);
            out.extend_from_slice(s);
        }
    }
    out
}

/// RFC 7541 §5.1 integer with an `n`-bit prefix.
fn integer(mut v: usize, n: u32, first: u8, out: &mut Vec<u8>) {
    let max = (1usize << n) - 1;
    if v < max {
        out.push(first | v as u8);
        return;
    }
    out.push(first | max as u8);
    v -= max;
    while v >= 128 {
        out.push((v % 128) as u8 | 0x80);
        v /= 128;
    }
    out.push(v as u8);
}

/// HEADERS (+ CONTINUATIONs) carrying `block`, no padding.
fn frame_block(
    stream: u32,
    end_stream: u8,
    priority: Option<[u8; 5]>,
    block: &[u8],
    out: &mut Vec<u8>,
) {
    let prio = priority.map_or(0, |_| 5);
    let first = block.len().min(MAX_FRAME - prio);
    let mut flags = end_stream | if priority.is_some() { PRIORITY } else { 0 };
    if first == block.len() {
        flags |= END_HEADERS;
    }
    frame_head(first + prio, HEADERS, flags, stream, out);
    if let Some(p) = priority {
        out.extend_from_slice(&p);
    }
    out.extend_from_slice(&block[..first]);
    let mut chunks = block[first..].chunks(MAX_FRAME).peekable();
    while let Some(c) = chunks.next() {
        let f = if chunks.peek().is_none() {
            END_HEADERS
        } else {
            0
        };
        frame_head(c.len(), CONTINUATION, f, stream, out);
        out.extend_from_slice(c);
    }
}

fn frame_head(len: usize, kind: u8, flags: u8, stream: u32, out: &mut Vec<u8>) {
    out.extend_from_slice(&(len as u32).to_be_bytes()[1..]);
    out.push(kind);
    out.push(flags);
    out.extend_from_slice(&stream.to_be_bytes());
}

#[cfg(test)]
mod tests;
