//! The preload's debug log as `memloop bench switch` reads it: the switch and promotion events
//! of one repetition, each as µs after its trigger (wall clock; tracing stamps lines in µs).

/// The preload's log: the milestones of demotes and promotions only (the server's). The
/// preload logs each after the wake-ups of that step, so the peer does not wait for it.
pub const LOG_FILTER: &str = "memloop_preload::switch=debug";
/// The client's: the end of its promotions only. Its demote is timed by its own clock (the
/// `sendmsg` returns once it is on TCP), and a log line inside it would be timed too: one
/// costs a few µs here, the first after a pause ~35 µs (a cold file write).
pub const LOG_FILTER_CLIENT: &str = "memloop_preload::switch::promote=debug";
/// What the lines kept apart contain (both targets).
pub const LOG_TARGET: &str = "memloop_preload::switch::";

pub const SWITCHED: &str = "switched to TCP";
pub const LEFT: &str = "left the ring";
pub const PROMOTED: &str = "promoted: back on the ring";

/// One repetition's events, µs after their trigger (`None`: not in the log).
#[derive(Debug, Default, PartialEq)]
pub struct Events {
    /// The client logged its switch (the connection was on a ring).
    pub switched: bool,
    /// Demote: the client left the ring; the server left it (noticed); the server on TCP.
    pub left: Option<f64>,
    pub peer_noticed: Option<f64>,
    pub peer_done: Option<f64>,
    /// Promote: the client back on the ring; the server back on it.
    pub back: Option<f64>,
    pub peer_back: Option<f64>,
}

impl Events {
    /// From the lines of both ends, for a demote at `demote` and a promotion at `promote`
    /// (wall ns).
    pub fn from_lines(lines: &[String], demote: u64, promote: Option<u64>) -> Events {
        let since = |from: u64| move |t: u64| t.saturating_sub(from) as f64 / 1e3;
        let after = |what, side| logged(lines, what, side, demote).map(since(demote));
        let p =
            |side| promote.and_then(|from| logged(lines, PROMOTED, side, from).map(since(from)));
        Events {
            // (Either end's line: the client does not log its demote.)
            switched: logged(lines, SWITCHED, "Client", demote)
                .or_else(|| logged(lines, SWITCHED, "Server", demote))
                .is_some(),
            left: after(LEFT, "Client"),
            peer_noticed: after(LEFT, "Server"),
            peer_done: after(SWITCHED, "Server"),
            back: p("Client"),
            peer_back: p("Server"),
        }
    }

    /// Whether the server's last awaited line is in (its stderr may lag its answer).
    pub fn peer_complete(&self, promote: bool) -> bool {
        self.peer_done.is_some() && (!promote || self.peer_back.is_some())
    }
}

/// A log line's time: the RFC 3339 UTC stamp tracing starts it with, as ns since the epoch.
pub fn log_time(line: &str) -> Option<u64> {
    let t = line.split_whitespace().next()?.strip_suffix('Z')?;
    let (date, time) = t.split_once('T')?;
    let mut d = date.splitn(3, '-').map(|x| x.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, frac) = time.split_once('.').unwrap_or((time, "0"));
    let mut h = hms.splitn(3, ':').map(|x| x.parse::<i64>().ok());
    let (hh, mm, ss) = (h.next()??, h.next()??, h.next()??);
    let digits = frac.len().min(9);
    let ns = frac[..digits].parse::<i64>().ok()? * 10i64.pow(9 - digits as u32);
    // Days from 1970-01-01 of a proleptic Gregorian date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + hh * 3600 + mm * 60 + ss;
    u64::try_from(secs * 1_000_000_000 + ns).ok()
}

/// The first log line of `side` with `what` at or after `from` (wall ns), as its time.
pub fn logged(lines: &[String], what: &str, side: &str, from: u64) -> Option<u64> {
    lines
        .iter()
        .filter(|l| l.contains(what) && l.contains(&format!("side={side}")))
        .filter_map(|l| log_time(l))
        // The log has µs: a line of the trigger's own µs counts.
        .filter(|&t| t + 1_000 >= from)
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_times_parse_as_tracing_prints_them() {
        let l = "2024-03-01T00:00:01.000002Z DEBUG memloop_preload::switch::demote: switched to TCP side=Server";
        // 2024-03-01 is day 19783 since the epoch.
        assert_eq!(
            log_time(l),
            Some(19_783 * 86_400_000_000_000 + 1_000_002_000)
        );
        assert_eq!(log_time("garbage"), None);
        let lines = vec![l.to_string()];
        assert!(logged(&lines, "switched to TCP", "Server", 0).is_some());
        assert!(logged(&lines, "switched to TCP", "Client", 0).is_none());
        assert!(logged(&lines, "switched to TCP", "Server", u64::MAX / 2).is_none());
    }

    /// A demote at 1.000000 s and a promotion at 2.000000 s (of 2024-03-01), as the two ends
    /// log them (fields as tracing prints them, lines of both ends interleaved).
    #[test]
    fn a_repetition_reads_as_its_events() {
        let day = 19_783 * 86_400_000_000_000u64;
        let pre = "2024-03-01T00:00:";
        let lines: Vec<String> = [
            "00.500000Z DEBUG memloop_preload::switch::promote: promoted: back on the ring ch=Some(ChannelId { idx: 3, gen: 1 }) side=Server",
            "01.000020Z DEBUG memloop_preload::switch::demote: left the ring ch=ChannelId { idx: 4, gen: 1 } side=Client",
            "01.000050Z DEBUG memloop_preload::switch::demote: left the ring ch=ChannelId { idx: 4, gen: 1 } side=Server",
            "01.000040Z DEBUG memloop_preload::switch::demote: switched to TCP ch=ChannelId { idx: 4, gen: 1 } side=Client reason=FdPassed",
            "01.000090Z DEBUG memloop_preload::switch::demote: switched to TCP ch=ChannelId { idx: 4, gen: 1 } side=Server reason=Peer",
            "02.000010Z DEBUG memloop_preload::conn::promote: promotion: ready ch=Some(ChannelId { idx: 4, gen: 1 }) side=Client",
            "02.000300Z DEBUG memloop_preload::switch::promote: promoted: back on the ring ch=Some(ChannelId { idx: 4, gen: 1 }) side=Server",
            "02.000250Z DEBUG memloop_preload::switch::promote: promoted: back on the ring ch=Some(ChannelId { idx: 4, gen: 1 }) side=Client",
        ]
        .iter()
        .map(|l| format!("{pre}{l}"))
        .collect();
        let e = Events::from_lines(&lines, day + 1_000_000_000, Some(day + 2_000_000_000));
        let want = Events {
            switched: true,
            left: Some(20.0),
            peer_noticed: Some(50.0),
            peer_done: Some(90.0),
            back: Some(250.0),
            peer_back: Some(300.0),
        };
        assert_eq!(e, want);
        assert!(e.peer_complete(true));
        // Without a promotion (or before its lines are in) nothing of it is read.
        let e = Events::from_lines(&lines[..5], day + 1_000_000_000, Some(day + 2_000_000_000));
        assert_eq!((e.back, e.peer_back), (None, None));
        assert!(e.peer_complete(false) && !e.peer_complete(true));
        let e = Events::from_lines(&lines, day + 1_000_000_000, None);
        assert_eq!((e.back, e.peer_back), (None, None));
    }
}
