//! The relay's source and sink (hidden `pipe-peer`), and the byte pattern every figure sends:
//! 8-byte little-endian word i of a stream (or file) is `i ^ SEED`, so a receiver checks each
//! byte at its offset (a lost, repeated or reordered chunk shows) at memory speed.

use crate::error::{fail, CliResult, Context};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};

const SEED: u64 = 0x6d65_6d6c_6f6f_7021;
/// The buffer of every copy here (the copy loop's too).
pub const BUF: usize = 256 << 10;

/// Fills `buf` with the pattern from byte `offset` of the stream (both multiples of 8).
pub fn fill(buf: &mut [u8], offset: u64) {
    debug_assert!(offset.is_multiple_of(8) && buf.len().is_multiple_of(8));
    let first = offset / 8;
    for (i, w) in buf.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&((first + i as u64) ^ SEED).to_le_bytes());
    }
}

/// Checks a stream of the pattern as it arrives, in pieces of any size.
#[derive(Default)]
pub struct Checker {
    bytes: u64,
    word: u64,
    carry: [u8; 8],
    held: usize,
    bad: Option<u64>,
}

impl Checker {
    pub fn feed(&mut self, mut b: &[u8]) {
        self.bytes += b.len() as u64;
        if self.bad.is_some() {
            return;
        }
        if self.held > 0 {
            let take = (8 - self.held).min(b.len());
            self.carry[self.held..self.held + take].copy_from_slice(&b[..take]);
            self.held += take;
            b = &b[take..];
            if self.held < 8 {
                return;
            }
            self.held = 0;
            let w = u64::from_le_bytes(self.carry);
            if w != self.word ^ SEED {
                self.bad = Some(self.word * 8);
                return;
            }
            self.word += 1;
        }
        let whole = b.len() / 8 * 8;
        let first = self.word;
        let wrong = b[..whole]
            .chunks_exact(8)
            .zip(first..)
            .position(|(w, i)| u64::from_le_bytes(w.try_into().expect("8 bytes")) != i ^ SEED);
        if let Some(i) = wrong {
            self.bad = Some((first + i as u64) * 8);
            return;
        }
        self.word += (whole / 8) as u64;
        self.held = b.len() - whole;
        self.carry[..self.held].copy_from_slice(&b[whole..]);
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// The bytes seen, if all of them were the pattern and ended on a whole word.
    pub fn verdict(&self) -> Result<u64, String> {
        match (self.bad, self.held) {
            (Some(at), _) => Err(format!("wrong bytes in the 8 at offset {at}")),
            (None, 0) => Ok(self.bytes),
            (None, n) => Err(format!(
                "{} bytes, a partial word of {n} at the end",
                self.bytes
            )),
        }
    }
}

/// `source`: connects to --addr, waits for one byte, writes --bytes of the pattern (or, with
/// --file, sends that file over and over with sendfile: no copy of its own) and ends;
/// `sink`: listens on 127.0.0.1, prints `port N`, takes one connection, reads it to the end
/// and prints `done BYTES ok` (or `done BYTES bad: WHY`); with --drain it splices what arrives
/// to /dev/null unread (no copy) and prints `done BYTES drained`.
#[derive(clap::Args)]
pub struct PeerArgs {
    #[arg(long)]
    role: String,
    #[arg(long)]
    addr: Option<String>,
    #[arg(long, default_value_t = 0)]
    bytes: u64,
    #[arg(long)]
    file: Option<std::path::PathBuf>,
    #[arg(long)]
    drain: bool,
    #[arg(long)]
    cpu: Option<usize>,
}

pub fn run(a: &PeerArgs) -> CliResult<()> {
    crate::bench::pin_peer(a.cpu)?;
    match a.role.as_str() {
        "source" => source(a),
        "sink" if a.drain => drain(),
        "sink" => sink(),
        r => Err(fail(format!("pipe-peer: unknown role {r}"))),
    }
}

fn say(s: &str) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "{s}").and_then(|()| o.flush());
}

fn source(a: &PeerArgs) -> CliResult<()> {
    let addr = a.addr.as_deref().ok_or_else(|| fail("source: no --addr"))?;
    let mut s = TcpStream::connect(addr).context(format!("source: connecting to {addr}"))?;
    let mut go = [0u8; 1];
    s.read_exact(&mut go).context("source: waiting for go")?;
    match &a.file {
        Some(f) => send_file(&s, f, a.bytes)?,
        None => {
            let mut buf = vec![0u8; BUF];
            let mut off = 0u64;
            while off < a.bytes {
                let n = (a.bytes - off).min(BUF as u64) as usize;
                fill(&mut buf[..n], off);
                s.write_all(&buf[..n]).context("source: writing")?;
                off += n as u64;
            }
        }
    }
    s.shutdown(Shutdown::Write).context("source: shutdown")?;
    Ok(())
}

/// `bytes` from `file` (from its start again at its end) with sendfile.
fn send_file(s: &TcpStream, file: &std::path::Path, bytes: u64) -> CliResult<()> {
    let f = std::fs::File::open(file).context(format!("source: opening {}", file.display()))?;
    let len = f.metadata()?.len();
    if len == 0 {
        return Err(fail("source: an empty file"));
    }
    let mut sent = 0u64;
    while sent < bytes {
        let mut off = sent % len;
        let n = (bytes - sent).min(len - off) as usize;
        match rustix::fs::sendfile(s, &f, Some(&mut off), n) {
            Ok(0) => return Err(fail("source: sendfile sent nothing")),
            Ok(k) => sent += k as u64,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(fail(format!("source: sendfile: {e}"))),
        }
    }
    Ok(())
}

/// The sink that does not read: socket → pipe → /dev/null, counting.
fn drain() -> CliResult<()> {
    use rustix::pipe::{splice, SpliceFlags};
    let l = TcpListener::bind("127.0.0.1:0").context("sink: binding")?;
    say(&format!("port {}", l.local_addr()?.port()));
    let (s, _) = l.accept().context("sink: accepting")?;
    let null = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/null")
        .context("sink: opening /dev/null")?;
    let (r, w) = rustix::pipe::pipe().context("sink: a pipe")?;
    let _ = rustix::pipe::fcntl_setpipe_size(&w, 1 << 20);
    let mut total = 0u64;
    loop {
        let n = match splice(&s, None, &w, None, 1 << 20, SpliceFlags::MOVE) {
            Ok(0) => break,
            Ok(n) => n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(fail(format!("sink: splice from the socket: {e}"))),
        };
        let mut left = n;
        while left > 0 {
            match splice(&r, None, &null, None, left, SpliceFlags::MOVE) {
                Ok(0) => return Err(fail("sink: /dev/null took nothing")),
                Ok(k) => left -= k,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(fail(format!("sink: splice to /dev/null: {e}"))),
            }
        }
        total += n as u64;
    }
    say(&format!("done {total} drained"));
    Ok(())
}

fn sink() -> CliResult<()> {
    let l = TcpListener::bind("127.0.0.1:0").context("sink: binding")?;
    say(&format!("port {}", l.local_addr()?.port()));
    let (mut s, _) = l.accept().context("sink: accepting")?;
    let mut buf = vec![0u8; BUF];
    let mut c = Checker::default();
    loop {
        match s.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => c.feed(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(fail(format!("sink: reading: {e}"))),
        }
    }
    match c.verdict() {
        Ok(n) => say(&format!("done {n} ok")),
        Err(why) => say(&format!("done {} bad: {why}", c.bytes())),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checker_takes_the_pattern_in_any_pieces_and_finds_a_wrong_byte() {
        let mut b = vec![0u8; 4096];
        fill(&mut b, 800);
        let mut whole = vec![0u8; 800];
        fill(&mut whole, 0);
        whole.extend_from_slice(&b);
        for step in [1, 3, 7, 8, 13, 1000] {
            let mut c = Checker::default();
            whole.chunks(step).for_each(|p| c.feed(p));
            assert_eq!(c.verdict(), Ok(whole.len() as u64), "pieces of {step}");
        }
        let mut bad = whole.clone();
        bad[2001] ^= 1;
        let mut c = Checker::default();
        bad.chunks(5).for_each(|p| c.feed(p));
        assert_eq!(
            c.verdict(),
            Err("wrong bytes in the 8 at offset 2000".into())
        );
        let mut c = Checker::default();
        c.feed(&whole[..11]);
        assert!(c.verdict().is_err(), "a partial word");
    }
}
