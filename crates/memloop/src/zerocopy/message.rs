//! A message to send: a scatter-gather list of our own loans and of bytes we received.

use super::pool::Loan;
use super::port::Received;
use crate::error::Error;
use memloop_ring::Descriptor;

/// What one [`super::ZcPort::send`] carries, in order: one descriptor per part.
#[derive(Default)]
pub struct Message<'a> {
    pub(super) parts: Vec<Part<'a>>,
    pub(super) user: u32,
}

pub(super) enum Part<'a> {
    /// A fresh loan: the rings' from publication on.
    Loan(Loan),
    /// Bytes of a received message, forwarded: the sender keeps its own hold, borrowed
    /// until the send has noted the forward (see `ZcPort::send`).
    Held { _from: &'a Received, d: Descriptor },
}

impl<'a> Message<'a> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a loaned buffer (its first `len` bytes, see [`Loan::truncate`]).
    pub fn loan(mut self, l: Loan) -> Self {
        self.parts.push(Part::Loan(l));
        self
    }

    /// Appends every segment of a received message (forwarding it whole, without copying).
    pub fn forward(mut self, r: &'a Received) -> Self {
        let parts = r.descriptors().map(|d| Part::Held { _from: r, d });
        self.parts.extend(parts);
        self
    }

    /// Appends `len` bytes from `off` of segment `seg` of a received message.
    pub fn forward_range(
        mut self,
        r: &'a Received,
        seg: usize,
        off: usize,
        len: usize,
    ) -> Result<Self, Error> {
        let d = r.sub_descriptor(seg, off, len)?;
        self.parts.push(Part::Held { _from: r, d });
        Ok(self)
    }

    /// The application's word, carried with the message ([`Received::user`]).
    pub fn user(mut self, word: u32) -> Self {
        self.user = word;
        self
    }

    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// The descriptors to publish, flagged as one message.
    pub(super) fn descriptors(&self) -> Vec<Descriptor> {
        let n = self.parts.len();
        self.parts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let mut d = match p {
                    Part::Loan(l) => l.descriptor(),
                    Part::Held { d, .. } => *d,
                };
                d.flags = if i + 1 < n { Descriptor::FLAG_MORE } else { 0 };
                d.user = self.user;
                d
            })
            .collect()
    }
}

impl From<Loan> for Message<'_> {
    fn from(l: Loan) -> Self {
        Message::new().loan(l)
    }
}

impl<'a> From<&'a Received> for Message<'a> {
    fn from(r: &'a Received) -> Self {
        Message::new().forward(r).user(r.user())
    }
}
