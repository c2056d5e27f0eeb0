//! Collectives over TCP, for processes on one host (loopback) or several.
//!
//! **Rendezvous.** Rank 0 listens at the address every rank is given; the others connect
//! to it and say who they are and where their own listener is. Rank 0 checks that the
//! ranks are distinct and agree on the world size, and answers each with every rank's
//! address. Each rank then connects to the next rank and accepts the previous one: a
//! ring.
//!
//! **All-reduce.** A ring all-reduce: the buffer is cut into `world` chunks; in `world - 1`
//! steps each rank passes a chunk to the next and adds the one it receives
//! (reduce-scatter), so that each chunk ends summed at one rank; in `world - 1` more
//! steps the summed chunks go round (all-gather). Each rank sends and receives
//! `2 (world - 1) / world` of the buffer, whatever the world size. Chunk `c` is summed in
//! ring order from rank `c` (`((x_c + x_{c+1}) + x_{c+2}) + …`, ranks modulo the world)
//! and then copied, so every rank ends with the same bits, and the same inputs give the
//! same sums on every run.
//!
//! **Checks.** Every collective starts with a header (the collective, its sequence
//! number, its length) that each rank checks against the previous rank's, and every
//! step's chunk carries its step number: ranks that call different collectives or pass
//! different lengths get an error naming both. Reads and writes time out after
//! [`TcpOptions::timeout`]; a peer that exits closes its sockets, which its neighbours
//! read as an error at once. After an error the communicator shuts its connections, so
//! that the error travels round the ring instead of leaving the others to time out.
//!
//! The wire carries f32 in the host's byte order: every rank must share it (every
//! platform Rust's std networking targets in practice is little-endian).

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::{Collective, Communicator, DistError, Result};

/// The first word of every header: a stray connection from another program, or from a
/// different version of this protocol, fails its check instead of being read as data.
const MAGIC: u32 = 0x7477_6431; // "twd1"

/// Rendezvous messages are short lines; anything longer is not one.
const MAX_MESSAGE_BYTES: usize = 1 << 16;

/// Chunks up to this size are written before the matching read, on the calling thread:
/// they fit in the socket buffers, so the write cannot wait on the peer's read. Larger
/// ones are written from a second thread while this one reads, or two ranks writing to
/// each other would both block.
const INLINE_BYTES: usize = 4 << 10;

/// How often a rank retries connecting, and rank 0 polls for connections, during the
/// rendezvous.
const POLL: Duration = Duration::from_millis(20);

/// How a rank joins a [`TcpCommunicator`].
#[derive(Clone, Debug)]
pub struct TcpOptions {
    pub rank: usize,
    pub world_size: usize,
    /// Rank 0's address, reachable by every rank (a loopback address on one host): rank
    /// 0 listens there, the others connect to it.
    pub rendezvous: SocketAddr,
    /// How long the rendezvous may take: the other ranks may start later than this one.
    pub connect_timeout: Duration,
    /// How long a collective waits for a peer's next bytes before it fails: longer than
    /// the longest gap between two collectives on any rank (a checkpoint written by rank
    /// 0, say).
    pub timeout: Duration,
}

impl TcpOptions {
    /// Rank `rank` of `world_size`, meeting at `rendezvous`; a minute to meet, five
    /// minutes for a peer to answer.
    pub fn new(rank: usize, world_size: usize, rendezvous: SocketAddr) -> Self {
        Self {
            rank,
            world_size,
            rendezvous,
            connect_timeout: Duration::from_secs(60),
            timeout: Duration::from_secs(300),
        }
    }

    pub fn with_connect_timeout(self, connect_timeout: Duration) -> Self {
        Self {
            connect_timeout,
            ..self
        }
    }

    pub fn with_timeout(self, timeout: Duration) -> Self {
        Self { timeout, ..self }
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(DistError::Options(m));
        if self.world_size == 0 {
            return bad("the world size must be at least 1".into());
        }
        if self.rank >= self.world_size {
            return bad(format!(
                "rank {} is not below the world size {}",
                self.rank, self.world_size
            ));
        }
        if self.rendezvous.ip().is_unspecified() {
            return bad(format!(
                "the rendezvous address {} names no host: give rank 0's own address",
                self.rendezvous
            ));
        }
        if self.timeout.is_zero() || self.connect_timeout.is_zero() {
            return bad("the timeouts must be positive".into());
        }
        Ok(())
    }
}

/// One rank of a ring of TCP connections (see the module's documentation).
#[derive(Debug)]
pub struct TcpCommunicator {
    rank: usize,
    world: usize,
    /// The ring: to rank `rank + 1` and from rank `rank - 1` (modulo the world); none in a
    /// world of one.
    ring: Option<Ring>,
    timeout: Duration,
    /// Collectives started, the sequence number of the next one's header.
    seq: u64,
    /// Where received chunks land before they are added.
    scratch: Vec<f32>,
    broken: bool,
}

#[derive(Debug)]
struct Ring {
    next: TcpStream,
    prev: TcpStream,
}

/// A collective's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    op: Collective,
    seq: u64,
    len: u64,
}

impl Header {
    const BYTES: usize = 4 + 1 + 8 + 8;

    fn encode(self) -> [u8; Self::BYTES] {
        let mut b = [0u8; Self::BYTES];
        b[..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = match self.op {
            Collective::Rendezvous => 0,
            Collective::AllReduce => 1,
            Collective::Broadcast => 2,
            Collective::Barrier => 3,
        };
        b[5..13].copy_from_slice(&self.seq.to_le_bytes());
        b[13..].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    fn decode(b: &[u8; Self::BYTES]) -> Option<Self> {
        let word = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().unwrap());
        if u32::from_le_bytes(b[..4].try_into().unwrap()) != MAGIC {
            return None;
        }
        let op = match b[4] {
            0 => Collective::Rendezvous,
            1 => Collective::AllReduce,
            2 => Collective::Broadcast,
            3 => Collective::Barrier,
            _ => return None,
        };
        Some(Self {
            op,
            seq: word(5..13),
            len: word(13..21),
        })
    }
}

impl TcpCommunicator {
    /// Joins the run: meets the other ranks at the rendezvous and builds the ring.
    /// Blocks until every rank has joined, or fails after
    /// [`TcpOptions::connect_timeout`].
    pub fn connect(options: &TcpOptions) -> Result<Self> {
        options.validate()?;
        let (rank, world) = (options.rank, options.world_size);
        let mut comm = Self {
            rank,
            world,
            ring: None,
            timeout: options.timeout,
            seq: 0,
            scratch: Vec::new(),
            broken: false,
        };
        if world > 1 {
            let deadline = Instant::now() + options.connect_timeout;
            let (listener, table) = match rank {
                0 => comm.gather_addresses(options, deadline)?,
                _ => comm.report_address(options, deadline)?,
            };
            comm.ring = Some(comm.close_ring(&listener, &table, deadline)?);
        }
        Ok(comm)
    }

    fn rendezvous_error(&self, message: impl Into<String>) -> DistError {
        DistError::Rendezvous {
            rank: self.rank,
            message: message.into(),
        }
    }

    /// Rank 0: listens at the rendezvous, takes every other rank's ring address, and
    /// answers each with the whole table.
    fn gather_addresses(
        &self,
        options: &TcpOptions,
        deadline: Instant,
    ) -> Result<(TcpListener, Vec<SocketAddr>)> {
        let rendezvous = TcpListener::bind(options.rendezvous).map_err(|e| {
            self.rendezvous_error(format!(
                "listening at the rendezvous {}: {e}",
                options.rendezvous
            ))
        })?;
        let ring = self.listen(SocketAddr::new(options.rendezvous.ip(), 0))?;
        let mut table: Vec<Option<SocketAddr>> = vec![None; self.world];
        table[0] = Some(
            ring.local_addr()
                .map_err(|e| self.rendezvous_error(e.to_string()))?,
        );
        let mut peers = Vec::with_capacity(self.world - 1);
        while peers.len() < self.world - 1 {
            let mut stream = self.accept(&rendezvous, deadline, "the other ranks")?;
            let joined = self
                .read_message(&mut stream, None)
                .and_then(|hello| self.parse_hello(&hello))
                .and_then(|(rank, addr)| match table[rank] {
                    Some(_) => Err(self.rendezvous_error(format!(
                        "two processes joined as rank {rank}: give each its own rank"
                    ))),
                    None => Ok((rank, addr)),
                });
            peers.push(stream);
            match joined {
                Ok((rank, addr)) => table[rank] = Some(addr),
                Err(e) => {
                    // The ranks that joined learn why the run stops (best effort).
                    for mut stream in peers {
                        let _ = self.write_message(&mut stream, &format!("error {e}"), 0);
                    }
                    return Err(e);
                }
            }
        }
        let table: Vec<SocketAddr> = table.into_iter().map(Option::unwrap).collect();
        let answer = table
            .iter()
            .map(SocketAddr::to_string)
            .collect::<Vec<_>>()
            .join(" ");
        for mut stream in peers {
            self.write_message(&mut stream, &format!("ok {answer}"), 0)?;
        }
        Ok((ring, table))
    }

    /// `twell-dist/1 hello RANK WORLD ADDR` from another rank: its rank and ring address.
    fn parse_hello(&self, hello: &str) -> Result<(usize, SocketAddr)> {
        let fields: Vec<&str> = hello.split(' ').collect();
        let parsed = match fields[..] {
            ["twell-dist/1", "hello", rank, world, addr] => {
                match (rank.parse::<usize>(), world.parse::<usize>(), addr.parse()) {
                    (Ok(r), Ok(w), Ok(a)) => Some((r, w, a)),
                    _ => None,
                }
            }
            _ => None,
        };
        let Some((rank, world, addr)) = parsed else {
            return Err(self.rendezvous_error(format!(
                "a connection to the rendezvous is not a rank of this run: {hello:?}"
            )));
        };
        if world != self.world {
            return Err(self.rendezvous_error(format!(
                "rank {rank} was started in a world of {world}, this one in a world of {}",
                self.world
            )));
        }
        if rank == 0 || rank >= self.world {
            return Err(self.rendezvous_error(format!(
                "a process joined as rank {rank}, outside 1..{}",
                self.world
            )));
        }
        Ok((rank, addr))
    }

    /// Any rank but 0: listens for the previous rank, tells rank 0 where, and reads
    /// back every rank's address.
    fn report_address(
        &self,
        options: &TcpOptions,
        deadline: Instant,
    ) -> Result<(TcpListener, Vec<SocketAddr>)> {
        let mut stream = self.connect_to(options.rendezvous, 0, deadline)?;
        // The address rank 0 was reached from is one it can reach back.
        let here = stream
            .local_addr()
            .map_err(|e| self.rendezvous_error(e.to_string()))?;
        let ring = self.listen(SocketAddr::new(here.ip(), 0))?;
        let addr = ring
            .local_addr()
            .map_err(|e| self.rendezvous_error(e.to_string()))?;
        let hello = format!("twell-dist/1 hello {} {} {addr}", self.rank, self.world);
        self.write_message(&mut stream, &hello, 0)?;
        let answer = self.read_message(&mut stream, Some(0))?;
        if let Some(why) = answer.strip_prefix("error ") {
            return Err(self.rendezvous_error(format!("rank 0 stopped the rendezvous: {why}")));
        }
        let table = answer
            .strip_prefix("ok ")
            .map(|t| t.split(' ').map(str::parse).collect::<Vec<_>>());
        match table {
            Some(t) if t.len() == self.world && t.iter().all(|a| a.is_ok()) => {
                Ok((ring, t.into_iter().map(|a| a.unwrap()).collect()))
            }
            _ => {
                Err(self
                    .rendezvous_error(format!("rank 0 answered the rendezvous with {answer:?}")))
            }
        }
    }

    /// Connects to the next rank and accepts the previous one, each saying who it is.
    fn close_ring(
        &self,
        listener: &TcpListener,
        table: &[SocketAddr],
        deadline: Instant,
    ) -> Result<Ring> {
        let (next_rank, prev_rank) = self.neighbours();
        let mut next = self.connect_to(table[next_rank], next_rank, deadline)?;
        self.write_message(
            &mut next,
            &format!("twell-dist/1 ring {}", self.rank),
            next_rank,
        )?;
        let mut prev = self.accept(listener, deadline, &format!("rank {prev_rank}"))?;
        let hello = self.read_message(&mut prev, Some(prev_rank))?;
        if hello != format!("twell-dist/1 ring {prev_rank}") {
            return Err(self.rendezvous_error(format!(
                "expected rank {prev_rank} on the ring, got {hello:?}"
            )));
        }
        for s in [&next, &prev] {
            s.set_read_timeout(Some(self.timeout))
                .and_then(|_| s.set_write_timeout(Some(self.timeout)))
                .map_err(|e| self.rendezvous_error(e.to_string()))?;
        }
        Ok(Ring { next, prev })
    }

    fn neighbours(&self) -> (usize, usize) {
        (
            (self.rank + 1) % self.world,
            (self.rank + self.world - 1) % self.world,
        )
    }

    fn listen(&self, addr: SocketAddr) -> Result<TcpListener> {
        TcpListener::bind(addr)
            .map_err(|e| self.rendezvous_error(format!("listening on {addr}: {e}")))
    }

    /// Connects to `addr`, retrying until `deadline` (the peer may not listen yet).
    fn connect_to(&self, addr: SocketAddr, peer: usize, deadline: Instant) -> Result<TcpStream> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match TcpStream::connect_timeout(&addr, left.max(POLL)) {
                Ok(stream) => {
                    return self.prepare(stream, deadline);
                }
                Err(e) if Instant::now() >= deadline => {
                    return Err(self.rendezvous_error(format!(
                        "no rank {peer} at {addr} within the connect timeout: {e}"
                    )));
                }
                Err(_) => std::thread::sleep(POLL),
            }
        }
    }

    /// The next connection to `listener`, or an error at `deadline`.
    fn accept(&self, listener: &TcpListener, deadline: Instant, whom: &str) -> Result<TcpStream> {
        let fail = |e: std::io::Error| self.rendezvous_error(format!("accepting {whom}: {e}"));
        listener.set_nonblocking(true).map_err(fail)?;
        loop {
            match listener.accept() {
                Ok((stream, _)) => {
                    stream.set_nonblocking(false).map_err(fail)?;
                    return self.prepare(stream, deadline);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(self.rendezvous_error(format!(
                            "{whom} did not join within the connect timeout"
                        )));
                    }
                    std::thread::sleep(POLL);
                }
                Err(e) => return Err(fail(e)),
            }
        }
    }

    /// No Nagle delay (the ring's frames are small and waited for), and rendezvous reads
    /// bounded by what is left of the connect timeout.
    fn prepare(&self, stream: TcpStream, deadline: Instant) -> Result<TcpStream> {
        let left = deadline.saturating_duration_since(Instant::now()).max(POLL);
        stream
            .set_nodelay(true)
            .and_then(|_| stream.set_read_timeout(Some(left)))
            .and_then(|_| stream.set_write_timeout(Some(left)))
            .map_err(|e| self.rendezvous_error(e.to_string()))?;
        Ok(stream)
    }

    fn write_message(&self, stream: &mut TcpStream, text: &str, peer: usize) -> Result<()> {
        let len = (text.len() as u32).to_le_bytes();
        stream
            .write_all(&len)
            .and_then(|_| stream.write_all(text.as_bytes()))
            .map_err(|e| self.io_error(e, peer, Collective::Rendezvous))
    }

    /// A length-prefixed line from `peer` (`None`: a rank not known yet).
    fn read_message(&self, stream: &mut TcpStream, peer: Option<usize>) -> Result<String> {
        let fail = |e: std::io::Error| match peer {
            Some(p) => self.io_error(e, p, Collective::Rendezvous),
            None => self.rendezvous_error(format!("reading a rank's greeting: {e}")),
        };
        let mut len = [0u8; 4];
        stream.read_exact(&mut len).map_err(fail)?;
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_MESSAGE_BYTES {
            return Err(self.rendezvous_error(format!(
                "a rendezvous message of {len} bytes: not a rank of this run"
            )));
        }
        let mut text = vec![0u8; len];
        stream.read_exact(&mut text).map_err(fail)?;
        String::from_utf8(text)
            .map_err(|_| self.rendezvous_error("a rendezvous message that is not UTF-8"))
    }

    /// An I/O error with `peer` during `during`, named for what it most likely means.
    fn io_error(&self, e: std::io::Error, peer: usize, during: Collective) -> DistError {
        let rank = self.rank;
        match e.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => DistError::Timeout {
                rank,
                peer,
                after: self.timeout,
                during,
            },
            ErrorKind::UnexpectedEof
            | ErrorKind::ConnectionReset
            | ErrorKind::ConnectionAborted
            | ErrorKind::BrokenPipe => DistError::PeerClosed { rank, peer, during },
            _ => DistError::Io {
                rank,
                peer,
                during,
                source: e,
            },
        }
    }

    /// Runs a collective; after an error, shuts the ring so that the neighbours fail at
    /// once, and refuses every later call.
    fn guarded<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if self.broken {
            return Err(DistError::Broken { rank: self.rank });
        }
        let out = f(self);
        if out.is_err() {
            self.broken = true;
            if let Some(ring) = &self.ring {
                let _ = ring.next.shutdown(Shutdown::Both);
                let _ = ring.prev.shutdown(Shutdown::Both);
            }
        }
        out
    }

    /// Sends this collective's header to the next rank and checks the previous one's.
    fn exchange_headers(&mut self, op: Collective, len: usize) -> Result<()> {
        let ours = Header {
            op,
            seq: self.seq,
            len: len as u64,
        };
        self.seq += 1;
        let (next_rank, prev_rank) = self.neighbours();
        let ring = self.ring.as_ref().expect("a ring in a world above one");
        (&ring.next)
            .write_all(&ours.encode())
            .map_err(|e| self.io_error(e, next_rank, op))?;
        self.check_header(ours, prev_rank)
    }

    /// Reads the previous rank's header and checks it against `ours`.
    fn check_header(&self, ours: Header, prev_rank: usize) -> Result<()> {
        let ring = self.ring.as_ref().expect("a ring in a world above one");
        let mut bytes = [0u8; Header::BYTES];
        (&ring.prev)
            .read_exact(&mut bytes)
            .map_err(|e| self.io_error(e, prev_rank, ours.op))?;
        let Some(theirs) = Header::decode(&bytes) else {
            return Err(DistError::Io {
                rank: self.rank,
                peer: prev_rank,
                during: ours.op,
                source: std::io::Error::new(ErrorKind::InvalidData, "not a twell-dist header"),
            });
        };
        if (theirs.op, theirs.seq) != (ours.op, ours.seq) {
            return Err(DistError::OutOfStep {
                rank: self.rank,
                peer: prev_rank,
                ours: ours.op,
                our_seq: ours.seq,
                theirs: theirs.op,
                their_seq: theirs.seq,
            });
        }
        if theirs.len != ours.len {
            return Err(DistError::LengthMismatch {
                rank: self.rank,
                peer: prev_rank,
                during: ours.op,
                ours: ours.len as usize,
                theirs: theirs.len as usize,
            });
        }
        Ok(())
    }

    /// One ring step: `send` (tagged with `step`) to the next rank while `want` floats
    /// (tagged with `step`) are read from the previous one into the scratch buffer.
    fn step(&mut self, op: Collective, step: u32, send: &[f32], want: usize) -> Result<()> {
        let (next_rank, prev_rank) = self.neighbours();
        if self.scratch.len() < want {
            self.scratch.resize(want, 0.0);
        }
        let ring = self.ring.as_ref().expect("a ring in a world above one");
        let payload: &[u8] = bytemuck::cast_slice(send);
        let recv: &mut [u8] = bytemuck::cast_slice_mut(&mut self.scratch[..want]);
        let write = || -> std::io::Result<()> {
            let mut w = &ring.next;
            w.write_all(&step.to_le_bytes())?;
            w.write_all(payload)
        };
        let read = |recv: &mut [u8]| -> std::io::Result<u32> {
            let mut r = &ring.prev;
            let mut tag = [0u8; 4];
            r.read_exact(&mut tag)?;
            r.read_exact(recv)?;
            Ok(u32::from_le_bytes(tag))
        };
        let (sent, got) = if payload.len() <= INLINE_BYTES {
            let sent = write();
            let got = match sent {
                Ok(()) => read(recv),
                Err(_) => Ok(step),
            };
            (sent, got)
        } else {
            std::thread::scope(|s| {
                let writer = s.spawn(write);
                let got = read(recv);
                if got.is_err() {
                    // Unblocks the writer if the next rank has stopped reading too.
                    let _ = ring.next.shutdown(Shutdown::Both);
                }
                (writer.join().expect("the ring's writer thread"), got)
            })
        };
        // The read's error first: a failed read shuts the write side down itself.
        let tag = got.map_err(|e| self.io_error(e, prev_rank, op))?;
        sent.map_err(|e| self.io_error(e, next_rank, op))?;
        if tag != step {
            return Err(DistError::Io {
                rank: self.rank,
                peer: prev_rank,
                during: op,
                source: std::io::Error::new(
                    ErrorKind::InvalidData,
                    format!("ring step {tag} where step {step} was due"),
                ),
            });
        }
        Ok(())
    }

    /// The ring all-reduce of the module's documentation (a barrier when `buf` is empty:
    /// every step still passes its tag round the ring).
    fn ring_all_reduce(&mut self, op: Collective, buf: &mut [f32]) -> Result<()> {
        let (n, r, len) = (self.world, self.rank, buf.len());
        self.exchange_headers(op, len)?;
        let chunk = |c: usize| c * len / n..(c + 1) * len / n;
        // Reduce-scatter: after step s, rank r holds the sum of chunk r - s - 1 over
        // ranks r - s - 1 ..= r.
        for s in 0..n - 1 {
            let (send, recv) = (chunk((r + n - s) % n), chunk((r + 2 * n - s - 1) % n));
            self.step(op, s as u32, &buf[send], recv.len())?;
            for (x, y) in buf[recv].iter_mut().zip(&self.scratch) {
                *x += *y;
            }
        }
        // All-gather: rank r starts with the whole sum of chunk r + 1.
        for s in 0..n - 1 {
            let (send, recv) = (chunk((r + 1 + n - s) % n), chunk((r + n - s) % n));
            let want = recv.len();
            self.step(op, (n - 1 + s) as u32, &buf[send], want)?;
            buf[recv].copy_from_slice(&self.scratch[..want]);
        }
        Ok(())
    }

    /// Rank 0's bytes passed along the ring: each rank reads them from the previous one
    /// and, but for the last, writes them on.
    fn ring_broadcast(&mut self, buf: &mut [u8]) -> Result<()> {
        let op = Collective::Broadcast;
        let (next_rank, prev_rank) = self.neighbours();
        let ours = Header {
            op,
            seq: self.seq,
            len: buf.len() as u64,
        };
        self.seq += 1;
        if self.rank != 0 {
            self.check_header(ours, prev_rank)?;
            let ring = self.ring.as_ref().expect("a ring in a world above one");
            (&ring.prev)
                .read_exact(buf)
                .map_err(|e| self.io_error(e, prev_rank, op))?;
        }
        if self.rank != self.world - 1 {
            let ring = self.ring.as_ref().expect("a ring in a world above one");
            let mut w = &ring.next;
            w.write_all(&ours.encode())
                .and_then(|_| w.write_all(buf))
                .map_err(|e| self.io_error(e, next_rank, op))?;
        }
        Ok(())
    }
}

impl Communicator for TcpCommunicator {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<()> {
        if self.world == 1 {
            return Ok(());
        }
        self.guarded(|c| c.ring_all_reduce(Collective::AllReduce, buf))
    }

    fn broadcast(&mut self, buf: &mut [u8]) -> Result<()> {
        if self.world == 1 {
            return Ok(());
        }
        self.guarded(|c| c.ring_broadcast(buf))
    }

    fn barrier(&mut self) -> Result<()> {
        if self.world == 1 {
            return Ok(());
        }
        self.guarded(|c| c.ring_all_reduce(Collective::Barrier, &mut []))
    }
}
