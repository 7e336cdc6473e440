//! Spin briefly, then sleep; wake the peer only when it asked (Fido).
//!
//! Two kernels may share the memory but not a kernel object (C3), so a futex is only an
//! optimisation: every sleep is bounded by `max_sleep` and the waiter always re-checks. The
//! waiter/notifier handshake is a Dekker pattern with a `SeqCst` fence on each side:
//!
//! - waiter: `old = seq`; `waiting = 1`; fence; re-check condition; sleep while `seq == old`;
//! - notifier: publish index (release); fence; if `waiting` then swap it to 0, `seq += 1`, wake.
//!
//! Either the waiter's re-check sees the published index or the notifier sees `waiting == 1`
//! and bumps `seq`, which makes the futex wait return at once: no wake-up is lost.

use crate::presence::{self, Presence};
use crate::RingError;
use memloop_shm::futex;
use memloop_shm::sync::AtomicU32;
use memloop_shm::sync::{self, fence, Ordering::*};
use memloop_shm::ShmU32;
use std::time::Duration;

/// What a waiter knows when it decides whether spinning can pay: all hints, sampled once
/// per wait after the first few polls ([`Spinner::try_spin_with`]), judged by [`spin_plan`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpinInputs {
    /// What the peer last published about itself ([`crate::presence`]).
    pub peer: Presence,
    /// For a peer that says it is asleep: `Some(false)` if its waiting flags are still
    /// armed (nothing of ours woke it: it waits for us, or for something else), `Some(true)`
    /// if they were cleared (a publication woke it and it is on its way back), `None` if the
    /// waiter cannot tell (a single ring sees only one of the peer's flags).
    pub peer_woken: Option<bool>,
    /// The CPU we run on.
    pub our_cpu: Option<u32>,
    /// Runnable threads on the machine and its CPUs (`memloop_shm::sched::runnable_and_cpus`).
    pub load: Option<(u32, u32)>,
}

impl SpinInputs {
    /// Nothing known: spin as the history says.
    pub const UNKNOWN: SpinInputs = SpinInputs {
        peer: Presence::Unknown,
        peer_woken: None,
        our_cpu: None,
        load: None,
    };

    /// Samples our CPU and the machine's load for a peer in state `peer`.
    pub fn sample(peer: Presence, peer_woken: Option<bool>) -> Self {
        SpinInputs {
            peer,
            peer_woken,
            our_cpu: memloop_shm::sched::current_cpu(),
            load: memloop_shm::sched::runnable_and_cpus(),
        }
    }
}

/// What a waiter does once its first few polls found nothing ([`spin_plan`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpinPlan {
    /// Arm and sleep at once: spinning cannot pay.
    Sleep,
    /// The peer is runnable on our very CPU: no spinning, but hand the CPU over with a few
    /// `sched_yield`s (checking after each) before sleeping — it can then answer without
    /// anyone paying for a doorbell and a wake-up.
    Yield,
    /// Spin for this long (the adaptive window).
    Spin(Duration),
}

/// Yields of a [`SpinPlan::Yield`] before the waiter sleeps.
const YIELDS: u32 = 4;

/// What to do once the first few polls found nothing, given the adaptive `window` (the
/// history of this connection or set):
/// - the peer is asleep and nothing woke it: it produces nothing until something does →
///   [`SpinPlan::Sleep`];
/// - the peer runs, or was woken from a sleep, on the CPU we run on: it needs that very CPU →
///   no spinning, only [`SpinPlan::Yield`] (the CPU goes to the peer at once);
/// - the machine has more runnable threads than CPUs: whatever we wait for competes with us
///   → [`SpinPlan::Sleep`];
/// - otherwise spin for `window` ([`SpinPlan::Sleep`] if it is zero).
///
/// Unknown inputs (an old peer, garbage, a CPU we cannot tell) never forbid spinning.
pub fn spin_plan(i: &SpinInputs, window: Duration) -> SpinPlan {
    let peer_cpu = match i.peer {
        Presence::Asleep { .. } if i.peer_woken == Some(false) => return SpinPlan::Sleep,
        Presence::Asleep { cpu } => cpu,
        Presence::Running { cpu } => Some(cpu),
        Presence::Unknown => None,
    };
    if peer_cpu.is_some() && peer_cpu == i.our_cpu {
        return SpinPlan::Yield;
    }
    if i.load.is_some_and(|(runnable, cpus)| runnable > cpus) || window.is_zero() {
        return SpinPlan::Sleep;
    }
    SpinPlan::Spin(window)
}

/// How a waiter sleeps once its spin window is over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WakeMode {
    /// The peer runs on the same kernel: sleep on a futex, the peer wakes it.
    Futex,
    /// The peer is in another kernel (another VM): no shared kernel object, so sleep with an
    /// exponential back-off up to `max_sleep` and poll.
    SleepPoll,
}

/// How long to spin and how long a single sleep may last.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WaitPolicy {
    pub mode: WakeMode,
    /// Maximum spin window before sleeping (adapted down when spinning keeps failing).
    pub spin: Duration,
    /// Longest single sleep: bounds the cost of a missed or impossible wake-up.
    pub max_sleep: Duration,
}

impl Default for WaitPolicy {
    fn default() -> Self {
        WaitPolicy {
            mode: WakeMode::Futex,
            spin: Duration::from_micros(50),
            max_sleep: Duration::from_millis(50),
        }
    }
}

impl WaitPolicy {
    /// Polling policy for peers in another kernel: 50 µs spin, sleeps of at most 10 ms.
    pub fn sleep_poll() -> Self {
        WaitPolicy {
            mode: WakeMode::SleepPoll,
            spin: Duration::from_micros(50),
            max_sleep: Duration::from_millis(10),
        }
    }
}

/// One side's "I am sleeping" flag and futex sequence word: a ring end's, or a listener's
/// doorbell in the registry.
#[derive(Clone)]
pub struct WaitCell {
    waiting: ShmU32,
    seq: ShmU32,
}

impl WaitCell {
    pub fn new(waiting: ShmU32, seq: ShmU32) -> Self {
        WaitCell { waiting, seq }
    }

    /// Notifier side, called after publishing: wake the waiter only if it armed its flag.
    /// Futex sleepers are woken here; returns what the caller must do for waiters asleep
    /// outside the ring: the cleared flag without its futex bit ([`WAIT_DOORBELL`] and/or a
    /// wake target, see [`flag_target`]), 0 for nothing.
    pub fn notify(&self) -> u32 {
        fence(SeqCst);
        if self.waiting.load(Relaxed) == 0 {
            return 0;
        }
        let old = self.waiting.swap(0, SeqCst);
        if old == 0 {
            return 0;
        }
        self.seq.fetch_add(1, SeqCst);
        if old & WAIT_FUTEX != 0 {
            futex::wake(&self.seq, u32::MAX);
        }
        old & !WAIT_FUTEX
    }

    /// The sequence value now: read by a futex sleeper *before* it sets its flag bit, and
    /// slept on after its re-check ([`WaitCell::sleep_untimed`]).
    pub fn seq_now(&self) -> u32 {
        self.seq.load(SeqCst)
    }

    /// Sets the flag to `bits` (the union of [`WAIT_FUTEX`] and [`WAIT_DOORBELL`] over the
    /// sleepers one owner keeps count of) and returns what it held: 0 after a notifier
    /// cleared it (a wake-up was sent, and a doorbell if the cleared value had that bit).
    pub fn set_flag(&self, bits: u32) -> u32 {
        let old = self.waiting.swap(bits, SeqCst);
        fence(SeqCst);
        old
    }

    /// Sleeps on the futex until the sequence word moves off `old`, with no time limit — so
    /// the kernel restarts it after a signal handler installed with `SA_RESTART` and ends it
    /// with `EINTR` otherwise, exactly as it does a blocking `recv`.
    pub fn sleep_untimed(&self, old: u32) -> futex::Woken {
        futex::wait_untimed(&self.seq, old)
    }

    /// Wakes every futex sleeper without a publication: they re-check and sleep again (a
    /// liveness look found something their peer will never publish, such as its death).
    pub fn wake_sleepers(&self) {
        self.seq.fetch_add(1, SeqCst);
        futex::wake(&self.seq, u32::MAX);
    }

    /// Arms the flag for a waiter that sleeps outside the ring (poll/epoll on a socket) and
    /// is woken by an external doorbell. The caller re-checks its condition afterwards.
    pub fn arm_doorbell(&self) {
        self.waiting.store(WAIT_DOORBELL, SeqCst);
        fence(SeqCst);
    }

    /// Waiter side: announce the sleep. The caller must re-check its condition afterwards and
    /// then sleep on the returned sequence value.
    pub fn arm(&self) -> u32 {
        let old = self.seq.load(SeqCst);
        self.waiting.store(WAIT_FUTEX, SeqCst);
        fence(SeqCst);
        old
    }

    pub fn disarm(&self) {
        self.waiting.store(0, Relaxed);
    }

    /// Arms the doorbell flag again for a waiter that armed it before; true if the notifier
    /// had cleared it meanwhile, i.e. a doorbell was rung (and is on its way).
    pub fn rearm_doorbell(&self) -> bool {
        let old = self.waiting.swap(WAIT_DOORBELL, SeqCst);
        fence(SeqCst);
        old == 0
    }

    /// Disarms a doorbell flag; true if the notifier had cleared it, i.e. a doorbell was rung.
    pub fn disarm_doorbell(&self) -> bool {
        self.waiting.swap(0, SeqCst) == 0
    }

    /// Current sequence value (loom models).
    #[cfg(all(test, loom))]
    pub fn seq(&self) -> u32 {
        self.seq.load(SeqCst)
    }

    /// Sleeps while the sequence word still holds `old` (what [`WaitCell::arm`] returned), for
    /// at most `dur` and the policy's `max_sleep`; `backoff` paces polling sleeps.
    pub fn sleep(&self, old: u32, policy: &WaitPolicy, dur: Duration, backoff: &mut Duration) {
        match policy.mode {
            WakeMode::Futex => futex::wait(&self.seq, old, dur.min(policy.max_sleep)),
            WakeMode::SleepPoll => {
                pause(dur.min(*backoff).min(policy.max_sleep));
                *backoff = backoff
                    .saturating_mul(2)
                    .min(policy.max_sleep.max(MIN_BACKOFF));
            }
        }
    }
}

/// Waiting-flag bit: a thread sleeps on the cell's futex (the notifier wakes it itself).
pub const WAIT_FUTEX: u32 = 1;
/// Waiting-flag bit: a waiter sleeps outside the ring and needs an external doorbell (the
/// notifier's caller rings it). Both bits may be set at once.
pub const WAIT_DOORBELL: u32 = 2;
/// Bits from here on name a wake target: an fd the sleepers of one wait set listen on,
/// which the notifier's caller knows how to reach (0: none).
pub const TARGET_SHIFT: u32 = 2;

/// The wake target in a flag value (0: none).
pub fn flag_target(v: u32) -> u32 {
    v >> TARGET_SHIFT
}

/// The flag value of wake target `t` (`t` must fit in 30 bits).
pub fn target_bits(t: u32) -> u32 {
    t << TARGET_SHIFT
}

/// Two wake requests found by one notifier's caller (the flag cleared twice before it acted),
/// as one: two different targets cannot be named at once, so they become the doorbell, which
/// reaches every sleeper (the connection's socket stays in every wait set).
pub fn merge_wakes(a: u32, b: u32) -> u32 {
    let (ta, tb) = (flag_target(a), flag_target(b));
    if ta != 0 && tb != 0 && ta != tb {
        return (a | b | WAIT_DOORBELL) & (WAIT_FUTEX | WAIT_DOORBELL);
    }
    a | b
}

/// First polling sleep towards another kernel.
pub const MIN_BACKOFF: Duration = Duration::from_micros(20);
/// Polls before the first clock reading (a few hundred ns).
#[cfg(not(loom))]
const FAST_POLLS: u32 = 16;
#[cfg(loom)]
const FAST_POLLS: u32 = 1;
/// Pure spinning (no yield) for up to this long: a peer on the other core usually answers
/// well within it, and yielding early hands the CPU to unrelated work for a whole time slice.
const PURE_SPIN: Duration = Duration::from_micros(10);
/// Spin hints between two `yield_now` calls once the spinner yields.
const SPINS_PER_YIELD: u32 = 32;

#[cfg(not(loom))]
fn pause(d: Duration) {
    std::thread::sleep(d);
}
#[cfg(loom)]
fn pause(_d: Duration) {
    sync::yield_now();
}

/// Elapsed time. Under loom it must be deterministic, so every reading advances a virtual
/// clock by 1 ms instead.
struct Clock {
    #[cfg(not(loom))]
    start: std::time::Instant,
    #[cfg(loom)]
    ticks: std::cell::Cell<u32>,
}

impl Clock {
    #[cfg(not(loom))]
    fn start() -> Self {
        Clock {
            start: std::time::Instant::now(),
        }
    }
    #[cfg(not(loom))]
    fn elapsed(&self) -> Duration {
        self.start.elapsed()
    }
    #[cfg(loom)]
    fn start() -> Self {
        Clock {
            ticks: std::cell::Cell::new(0),
        }
    }
    #[cfg(loom)]
    fn elapsed(&self) -> Duration {
        self.ticks.set(self.ticks.get() + 1);
        Duration::from_millis(self.ticks.get() as u64)
    }
}

/// Adaptive spin window, kept per ring end, connection or wait set: halves when spinning
/// fails (the peer is slow or shares our core, so sleeping is cheaper), doubles back towards
/// the maximum when it succeeds. Takes `&self` so threads sharing a connection share it; its
/// word is process-local (not shared memory), so relaxed updates that race only lose a hint.
#[derive(Debug)]
pub struct Spinner {
    window_ns: std::sync::atomic::AtomicU64,
    /// Spins in a row that ended in a sleep ([`MISS_STREAK`] or more: spin on one wait in
    /// [`PROBE_EVERY`] only).
    misses: std::sync::atomic::AtomicU32,
}

impl Default for Spinner {
    fn default() -> Self {
        Spinner {
            window_ns: std::sync::atomic::AtomicU64::new(u64::MAX),
            misses: std::sync::atomic::AtomicU32::new(0),
        }
    }
}

/// After this many spins in a row that found nothing, a waiter spins only on one wait in
/// [`PROBE_EVERY`] (to notice when spinning pays again): a peer that answers only after long
/// pauses (a client thinking between requests) otherwise costs a spin window per request.
const MISS_STREAK: u32 = 8;
const PROBE_EVERY: u32 = 8;

impl Spinner {
    fn current(&self, max: Duration) -> Duration {
        let w = self.window_ns.load(std::sync::atomic::Ordering::Relaxed);
        Duration::from_nanos(w).min(max)
    }

    fn store(&self, d: Duration) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.window_ns
            .store(ns, std::sync::atomic::Ordering::Relaxed);
    }

    fn hit(&self, max: Duration) {
        let next = self.current(max).saturating_mul(2);
        self.store(next.max(Duration::from_micros(1)).min(max));
        self.misses.store(0, std::sync::atomic::Ordering::Relaxed);
    }

    fn miss(&self, max: Duration) {
        // Never below a quarter of the maximum: a futex sleep costs ~35 µs here, so a waiter
        // that gives up after a few µs turns every medium-sized exchange into a sleep.
        self.store((self.current(max) / 2).max(max / 4));
        self.misses
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// A wait ended at once: the peer is busy, so any streak of misses is over (a load, and
    /// a store only when there was one).
    fn no_streak(&self) {
        if self.misses.load(std::sync::atomic::Ordering::Relaxed) != 0 {
            self.misses.store(0, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Whether this wait skips spinning: the last [`MISS_STREAK`] spins all missed, and this
    /// is not the one in [`PROBE_EVERY`] that tries again.
    fn resting(&self) -> bool {
        let m = self.misses.load(std::sync::atomic::Ordering::Relaxed);
        if m < MISS_STREAK {
            return false;
        }
        // (Counts the waits skipped too, so the probe comes round.)
        self.misses
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        (m - MISS_STREAK) % PROBE_EVERY != PROBE_EVERY - 1
    }

    #[cfg(all(test, not(loom)))]
    pub(crate) fn window(&self) -> Duration {
        Duration::from_nanos(self.window_ns.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// A spinner whose window starts at `max`.
    pub fn new(max: Duration) -> Self {
        let s = Spinner::default();
        s.store(max);
        s
    }

    /// Polls `ready` for up to the adaptive window (at most `max`); true if it became ready.
    /// After the first [`PURE_SPIN`] it yields now and then: on two cores the peer may need
    /// our CPU.
    pub fn try_spin<E>(
        &self,
        max: Duration,
        ready: impl FnMut() -> Result<bool, E>,
    ) -> Result<bool, E> {
        self.try_spin_with(max, || SpinInputs::UNKNOWN, ready)
    }

    /// [`Spinner::try_spin`] that, once the first few polls found nothing, asks `inputs` what
    /// is known about the peer and the machine and spins only as long as [`spin_plan`]
    /// allows ([`spin_plan`]). A wait cut short so does not count as a miss: the window keeps its history.
    pub fn try_spin_with<E>(
        &self,
        max: Duration,
        inputs: impl FnOnce() -> SpinInputs,
        mut ready: impl FnMut() -> Result<bool, E>,
    ) -> Result<bool, E> {
        // Most waits on a busy pair end within a few polls: do those before paying for a clock
        // (only a couple on an oversubscribed machine, where the plan below is to sleep).
        let fast = match memloop_shm::sched::oversubscribed_hint() {
            true => FAST_POLLS.min(2),
            false => FAST_POLLS,
        };
        for _ in 0..fast {
            if ready()? {
                self.no_streak();
                return Ok(true);
            }
            sync::spin_hint();
        }
        let history = self.current(max);
        if history.is_zero() {
            return Ok(false);
        }
        let window = match spin_plan(&inputs(), history) {
            SpinPlan::Sleep => return Ok(false),
            SpinPlan::Spin(_) if self.resting() => return Ok(false),
            SpinPlan::Yield => {
                for _ in 0..YIELDS {
                    sync::yield_now();
                    if ready()? {
                        return Ok(true);
                    }
                }
                return Ok(false);
            }
            SpinPlan::Spin(w) => w,
        };
        let clock = Clock::start();
        let mut i = 0u32;
        let mut yielding = false;
        loop {
            if ready()? {
                self.hit(max);
                return Ok(true);
            }
            i = i.wrapping_add(1);
            // Reading the clock costs as much as a few spins: only every 8th round.
            if i % 8 == 0 {
                let t = clock.elapsed();
                if t >= window {
                    self.miss(max);
                    return Ok(false);
                }
                yielding = t >= PURE_SPIN;
            }
            if yielding && i % SPINS_PER_YIELD == 0 {
                sync::yield_now();
            } else {
                sync::spin_hint();
            }
        }
    }

    /// [`Spinner::try_spin`] for a condition that cannot fail.
    pub fn spin(&self, max: Duration, ready: impl FnMut() -> bool) -> bool {
        self.spin_with(max, || SpinInputs::UNKNOWN, ready)
    }

    /// [`Spinner::try_spin_with`] for a condition that cannot fail.
    pub fn spin_with(
        &self,
        max: Duration,
        inputs: impl FnOnce() -> SpinInputs,
        mut ready: impl FnMut() -> bool,
    ) -> bool {
        match self.try_spin_with::<std::convert::Infallible>(max, inputs, || Ok(ready())) {
            Ok(hit) => hit,
        }
    }
}

/// How a waiter sleeps once spinning has failed. The protocol (see the module docs) is the
/// same whatever the sleep is — a futex on the ring, a bounded poll towards another kernel,
/// or a kernel socket that receives a doorbell byte: announce the sleep, re-check, sleep,
/// withdraw the announcement.
pub trait Park {
    type Error;
    /// Announces the sleep so that the peer's next publication wakes us.
    fn arm(&mut self);
    /// Sleeps for at most `left` (`None`: until woken), or not at all if a wake-up already
    /// came since [`Park::arm`].
    fn park(&mut self, left: Option<Duration>) -> Result<(), Self::Error>;
    /// Withdraws the announcement.
    fn disarm(&mut self);
    /// Runs after a sleep that did not make the condition true, before the next round (e.g.
    /// a look at the peer's liveness, which may itself make the condition true).
    fn after_sleep(&mut self) -> Result<(), Self::Error> {
        Ok(())
    }
}

/// The sleeping phase of a wait: until `ready()` (→ `Ok(true)`) or `timeout` passes
/// (→ `Ok(false)`; `None` waits for ever). Spin first ([`Spinner::try_spin`]).
pub fn park_until<P: Park>(
    park: &mut P,
    timeout: Option<Duration>,
    mut ready: impl FnMut() -> Result<bool, P::Error>,
) -> Result<bool, P::Error> {
    let clock = Clock::start();
    loop {
        park.arm();
        let outcome = ready();
        if !matches!(outcome, Ok(false)) {
            park.disarm();
            return outcome;
        }
        let left = timeout.map(|t| t.saturating_sub(clock.elapsed()));
        if left.is_some_and(|l| l.is_zero()) {
            park.disarm();
            return Ok(false);
        }
        let slept = park.park(left);
        park.disarm();
        slept?;
        if ready()? {
            return Ok(true);
        }
        park.after_sleep()?;
    }
}

/// A ring end's presence word and its peer's, for a waiter on one ring.
#[derive(Clone, Copy)]
pub(crate) struct Presences<'a> {
    pub ours: &'a AtomicU32,
    pub peer: &'a AtomicU32,
}

/// A ring's own sleep: a futex on its sequence word (same kernel), or a bounded sleep with
/// exponential back-off (towards another kernel, where no kernel object is shared).
struct RingPark<'a> {
    cell: &'a WaitCell,
    policy: &'a WaitPolicy,
    old: u32,
    backoff: Duration,
    /// Our presence word, said asleep while we sleep.
    ours: Option<&'a AtomicU32>,
    cpu: Option<u32>,
}

impl Park for RingPark<'_> {
    type Error = RingError;
    fn arm(&mut self) {
        if let Some(w) = self.ours {
            presence::publish_in(w, Presence::Asleep { cpu: self.cpu });
        }
        self.old = self.cell.arm();
    }
    fn park(&mut self, left: Option<Duration>) -> Result<(), RingError> {
        let dur = left.unwrap_or(self.policy.max_sleep);
        self.cell
            .sleep(self.old, self.policy, dur, &mut self.backoff);
        Ok(())
    }
    fn disarm(&mut self) {
        self.cell.disarm();
        if let Some(w) = self.ours {
            self.cpu = memloop_shm::sched::current_cpu();
            presence::publish_in(w, Presence::running(self.cpu));
        }
    }
}

/// Waits until `ready()` is true (→ `Ok(true)`) or `timeout` passes (→ `Ok(false)`). With
/// `who`, publishes our presence and spins only as [`spin_plan`] allows.
pub(crate) fn block_until(
    cell: &WaitCell,
    spinner: &Spinner,
    policy: &WaitPolicy,
    who: Option<Presences<'_>>,
    timeout: Duration,
    mut ready: impl FnMut() -> Result<bool, RingError>,
) -> Result<bool, RingError> {
    let mut cpu = None;
    let inputs = || {
        let Some(who) = who else {
            return SpinInputs::UNKNOWN;
        };
        // One ring shows only one of the peer's waiting flags: whether it was woken is unknown.
        let i = SpinInputs::sample(presence::read_in(who.peer), None);
        presence::publish_in(who.ours, Presence::running(i.our_cpu));
        cpu = i.our_cpu;
        i
    };
    if !policy.spin.is_zero()
        && spinner.try_spin_with(policy.spin.min(timeout), inputs, &mut ready)?
    {
        return Ok(true);
    }
    let mut park = RingPark {
        cell,
        policy,
        old: 0,
        backoff: MIN_BACKOFF,
        ours: who.map(|w| w.ours),
        cpu,
    };
    park_until(&mut park, Some(timeout), ready)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const W: Duration = Duration::from_micros(40);

    fn inputs(peer: Presence, woken: Option<bool>, ours: Option<u32>) -> SpinInputs {
        SpinInputs {
            peer,
            peer_woken: woken,
            our_cpu: ours,
            load: Some((2, 2)),
        }
    }

    #[test]
    fn spins_for_a_peer_running_elsewhere() {
        let i = inputs(Presence::Running { cpu: 1 }, None, Some(0));
        assert_eq!(spin_plan(&i, W), SpinPlan::Spin(W), "the history decides");
        assert_eq!(spin_plan(&i, Duration::ZERO), SpinPlan::Sleep);
    }

    #[test]
    fn no_spin_for_a_peer_on_our_cpu() {
        let i = inputs(Presence::Running { cpu: 3 }, None, Some(3));
        assert_eq!(spin_plan(&i, W), SpinPlan::Yield);
        // Woken from a sleep on our CPU: it will want this CPU.
        let i = inputs(Presence::Asleep { cpu: Some(3) }, Some(true), Some(3));
        assert_eq!(spin_plan(&i, W), SpinPlan::Yield);
        // Asleep on our CPU and nothing woke it: nothing to yield to.
        let i = inputs(Presence::Asleep { cpu: Some(3) }, Some(false), Some(3));
        assert_eq!(spin_plan(&i, W), SpinPlan::Sleep);
    }

    #[test]
    fn no_spin_for_a_sleeping_peer_nobody_woke() {
        for ours in [None, Some(0)] {
            for cpu in [None, Some(1)] {
                let i = inputs(Presence::Asleep { cpu }, Some(false), ours);
                assert_eq!(spin_plan(&i, W), SpinPlan::Sleep);
            }
        }
    }

    #[test]
    fn spins_for_a_woken_peer_elsewhere_or_when_unsure() {
        for woken in [Some(true), None] {
            let i = inputs(Presence::Asleep { cpu: Some(1) }, woken, Some(0));
            assert_eq!(spin_plan(&i, W), SpinPlan::Spin(W));
            let i = inputs(Presence::Asleep { cpu: None }, woken, Some(0));
            assert_eq!(spin_plan(&i, W), SpinPlan::Spin(W));
        }
    }

    #[test]
    fn a_waiter_that_keeps_missing_spins_on_one_wait_in_eight_until_a_hit() {
        let s = Spinner::new(Duration::from_micros(2));
        let max = Duration::from_micros(2);
        let spun = |s: &Spinner| {
            let mut polls = 0u32;
            s.spin(max, || {
                polls += 1;
                false
            });
            polls > FAST_POLLS
        };
        for _ in 0..MISS_STREAK {
            assert!(spun(&s), "spins while the streak is short");
        }
        let tries: Vec<bool> = (0..2 * PROBE_EVERY).map(|_| spun(&s)).collect();
        assert_eq!(tries.iter().filter(|t| **t).count(), 2, "{tries:?}");
        assert!(s.spin(max, || true), "a hit");
        assert!(spun(&s), "spins again after a hit");
    }

    #[test]
    fn no_spin_on_an_oversubscribed_machine() {
        let mut i = inputs(Presence::Running { cpu: 1 }, None, Some(0));
        i.load = Some((3, 2));
        assert_eq!(spin_plan(&i, W), SpinPlan::Sleep);
        i.load = Some((2, 2));
        assert_eq!(
            spin_plan(&i, W),
            SpinPlan::Spin(W),
            "both ends running on two CPUs is fine"
        );
        i.load = None;
        assert_eq!(spin_plan(&i, W), SpinPlan::Spin(W));
    }

    #[test]
    fn unknown_never_forbids_spinning() {
        assert_eq!(spin_plan(&SpinInputs::UNKNOWN, W), SpinPlan::Spin(W));
        let i = inputs(Presence::Unknown, Some(false), Some(0));
        assert_eq!(spin_plan(&i, W), SpinPlan::Spin(W));
        // Our CPU unknown: a peer's CPU is no reason to stop.
        let i = inputs(Presence::Running { cpu: 0 }, None, None);
        assert_eq!(spin_plan(&i, W), SpinPlan::Spin(W));
    }

    #[test]
    fn garbage_presence_is_harmless() {
        for w in [u32::MAX, 0xdead_beef, 1 << 31 | 0xffff, 3 << 30] {
            let i = inputs(Presence::decode(w), Some(false), Some(0));
            let p = spin_plan(&i, W);
            assert!(matches!(p, SpinPlan::Spin(w) if w == W) || p != SpinPlan::Yield);
        }
    }

    #[test]
    fn a_cut_short_spin_keeps_the_history() {
        let s = Spinner::new(W);
        let stop = SpinInputs {
            peer: Presence::Running { cpu: 0 },
            peer_woken: None,
            our_cpu: Some(0),
            load: None,
        };
        assert!(!s.spin_with(W, || stop, || false));
        assert_eq!(s.window(), W, "yielding is not a miss");
        let asleep = SpinInputs {
            peer: Presence::Asleep { cpu: Some(1) },
            peer_woken: Some(false),
            ..stop
        };
        assert!(!s.spin_with(W, || asleep, || false));
        assert_eq!(s.window(), W, "not spinning is not a miss");
        assert!(!s.spin_with(W, || SpinInputs::UNKNOWN, || false));
        assert_eq!(s.window(), W / 2, "a real miss halves it");
    }

    #[test]
    fn spin_window_adapts() {
        let pol = WaitPolicy {
            spin: Duration::from_micros(64),
            ..WaitPolicy::default()
        };
        let s = Spinner::default();
        s.miss(pol.spin);
        assert_eq!(s.window(), Duration::from_micros(32));
        for _ in 0..10 {
            s.miss(pol.spin);
        }
        assert_eq!(s.window(), Duration::from_micros(16), "floor at spin/4");
        s.hit(pol.spin);
        assert_eq!(s.window(), Duration::from_micros(32));
        for _ in 0..10 {
            s.hit(pol.spin);
        }
        assert_eq!(
            s.window(),
            Duration::from_micros(64),
            "capped at the policy"
        );
        let huge = WaitPolicy {
            spin: Duration::MAX,
            ..pol
        };
        s.hit(huge.spin); // must not overflow
    }
}

#[cfg(all(test, not(loom)))]
mod flag_tests {
    use super::*;

    #[test]
    fn two_targets_merge_into_the_doorbell_and_one_target_stays() {
        let (a, b) = (target_bits(3), target_bits(4));
        assert_eq!(merge_wakes(a, a), a);
        assert_eq!(merge_wakes(0, a), a);
        assert_eq!(merge_wakes(a, WAIT_DOORBELL), a | WAIT_DOORBELL);
        let m = merge_wakes(a, b);
        assert_eq!((flag_target(m), m & WAIT_DOORBELL), (0, WAIT_DOORBELL));
    }

    #[test]
    fn notify_returns_what_sleeps_outside_and_clears_the_flag() {
        let v = memloop_shm::ShmSlice::new_heap(64);
        let c = WaitCell::new(v.u32_at(8).unwrap(), v.u32_at(12).unwrap());
        assert_eq!(c.notify(), 0, "nobody armed");
        let seq = c.seq_now();
        c.set_flag(WAIT_FUTEX | target_bits(9));
        assert_eq!(c.notify(), target_bits(9), "the target, not the futex bit");
        assert_ne!(c.seq_now(), seq, "the futex sleeper's word moved");
        assert_eq!(c.set_flag(0), 0, "cleared");
    }
}

/// Loom models of the sleep/wake handshake (run with `RUSTFLAGS="--cfg loom"`).
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::thread;
    use memloop_shm::ShmSlice;

    fn cell(v: &ShmSlice) -> WaitCell {
        WaitCell::new(v.u32_at(8).unwrap(), v.u32_at(12).unwrap())
    }

    /// A waiter that arms, re-checks and finds nothing must have been (or be about to be)
    /// woken: once the notifier finished, `seq` differs from what the waiter sleeps on.
    #[test]
    fn no_lost_wakeup() {
        loom::model(|| {
            let v = ShmSlice::new_model(64);
            let (vp, c) = (v.clone(), cell(&v));
            let notifier = thread::spawn(move || {
                vp.u64_at(0).unwrap().store(1, Release);
                cell(&vp).notify();
            });
            let old = c.arm();
            let ready = v.u64_at(0).unwrap().load(Acquire) == 1;
            notifier.join().unwrap();
            if !ready {
                assert_ne!(c.seq(), old, "lost wake-up: the waiter would sleep forever");
            }
            c.disarm();
        });
    }

    /// Doorbell waiters: either the re-check after arming sees the data, or the notifier
    /// reports that it must ring the external doorbell.
    #[test]
    fn doorbell_requested_or_seen() {
        loom::model(|| {
            let v = ShmSlice::new_model(64);
            let vp = v.clone();
            let notifier = thread::spawn(move || {
                vp.u64_at(0).unwrap().store(1, Release);
                cell(&vp).notify() != 0
            });
            let c = cell(&v);
            c.arm_doorbell();
            let ready = v.u64_at(0).unwrap().load(Acquire) == 1;
            let rang = notifier.join().unwrap();
            assert!(ready || rang, "doorbell waiter would sleep forever");
            c.disarm();
        });
    }

    /// A second waiter re-arms a flag the notifier may have cleared: either its re-check
    /// sees the data, or a doorbell is rung after the re-arm (the notifier found the flag set).
    /// And a doorbell the notifier rang is always noticed by the waiter — by the re-arm or by
    /// the disarm — so its byte is known to be owed and gets read.
    #[test]
    fn rearm_requested_or_seen_and_rings_are_counted() {
        loom::model(|| {
            let v = ShmSlice::new_model(64);
            let vp = v.clone();
            let c = cell(&v);
            c.arm_doorbell();
            let notifier = thread::spawn(move || {
                vp.u64_at(0).unwrap().store(1, Release);
                cell(&vp).notify() != 0
            });
            let seen_at_rearm = c.rearm_doorbell();
            let ready = v.u64_at(0).unwrap().load(Acquire) == 1;
            let rang = notifier.join().unwrap();
            let seen_at_disarm = c.disarm_doorbell();
            assert!(ready || rang, "re-armed waiter would sleep forever");
            assert_eq!(
                rang,
                seen_at_rearm || seen_at_disarm,
                "a doorbell rang unnoticed (its byte would never be read), or one was counted \
                 that never rang"
            );
        });
    }

    /// The same handshake without the fences (a plausible bug) is caught by the model: this
    /// shows the test above can fail.
    #[test]
    #[should_panic(expected = "lost wake-up")]
    fn handshake_without_fences_loses_wakeups() {
        loom::model(|| {
            let v = ShmSlice::new_model(64);
            let vp = v.clone();
            let notifier = thread::spawn(move || {
                vp.u64_at(0).unwrap().store(1, Release);
                let w = vp.u32_at(8).unwrap();
                if w.load(Relaxed) != 0 {
                    w.store(0, Relaxed);
                    vp.u32_at(12).unwrap().fetch_add(1, Relaxed);
                }
            });
            let old = v.u32_at(12).unwrap().load(Relaxed);
            v.u32_at(8).unwrap().store(1, Release);
            let ready = v.u64_at(0).unwrap().load(Acquire) == 1;
            notifier.join().unwrap();
            if !ready {
                assert_ne!(v.u32_at(12).unwrap().load(Relaxed), old, "lost wake-up");
            }
        });
    }

    /// One process's sleepers on one ring end as the transparent layer keeps them: counts
    /// under a lock, the flag set to the union of their bits. A futex sleeper reads the
    /// sequence word *before* its bit goes up (`late_seq`: after its re-check, the control).
    fn mixed_sleepers(late_seq: bool) {
        const T: u32 = 5; // a wake target
        loom::model(move || {
            let v = ShmSlice::new_model(64);
            let counts = std::sync::Arc::new(loom::sync::Mutex::new((0u32, 0u32)));
            let bits = |c: &(u32, u32)| {
                (if c.0 > 0 { WAIT_FUTEX } else { 0 }) | (if c.1 > 0 { target_bits(T) } else { 0 })
            };
            let (vt, ct) = (v.clone(), counts.clone());
            let targeted = thread::spawn(move || {
                let c = cell(&vt);
                {
                    let mut n = ct.lock().unwrap();
                    n.1 += 1;
                    c.set_flag(bits(&n));
                }
                vt.u64_at(0).unwrap().load(Acquire) == 1
            });
            let vn = v.clone();
            let notifier = thread::spawn(move || {
                vn.u64_at(0).unwrap().store(1, Release);
                cell(&vn).notify()
            });
            let c = cell(&v);
            let mut seq = c.seq_now();
            {
                let mut n = counts.lock().unwrap();
                n.0 += 1;
                c.set_flag(bits(&n));
            }
            let ready = v.u64_at(0).unwrap().load(Acquire) == 1;
            if late_seq {
                seq = c.seq_now();
            }
            let t_ready = targeted.join().unwrap();
            let wake = notifier.join().unwrap();
            assert!(
                t_ready || flag_target(wake) == T || wake & WAIT_DOORBELL != 0,
                "lost wake-up: the targeted sleeper is never sent one"
            );
            if !ready {
                assert_ne!(
                    c.seq(),
                    seq,
                    "lost wake-up: the futex sleeper sleeps for ever"
                );
            }
        });
    }

    /// A futex sleeper and a wake-target sleeper of one process share a ring end's flag: the
    /// notifier wakes both (the futex itself, the target through its caller).
    #[test]
    fn futex_and_target_sleepers_share_a_flag() {
        mixed_sleepers(false);
    }

    /// The control: a futex sleeper that reads the sequence word after its re-check sleeps
    /// on a value the notifier already moved past.
    #[test]
    #[should_panic(expected = "lost wake-up")]
    fn futex_sleeper_reading_seq_late_loses_wakeups() {
        mixed_sleepers(true);
    }

    /// The full blocking path: a bounded waiter (virtual clock) sees the published value.
    #[test]
    fn block_until_sees_publication() {
        loom::model(|| {
            let v = ShmSlice::new_model(64);
            let vp = v.clone();
            let notifier = thread::spawn(move || {
                vp.u64_at(0).unwrap().store(1, Release);
                cell(&vp).notify();
            });
            let c = cell(&v);
            let flag = v.u64_at(0).unwrap();
            let sp = Spinner::default();
            let policy = WaitPolicy::default();
            let got = block_until(&c, &sp, &policy, None, Duration::from_millis(4), || {
                Ok(flag.load(Acquire) == 1)
            });
            notifier.join().unwrap();
            let got = got.unwrap() || flag.load(Acquire) == 1;
            assert!(got);
            assert_eq!(
                v.u32_at(8).unwrap().load(Relaxed),
                0,
                "waiting flag cleared"
            );
        });
    }
}
