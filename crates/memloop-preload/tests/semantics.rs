//! Socket semantics under the preload library (issue 3 §4): each test runs one scenario of
//! `tests/semantics/*.py` — a server and a client script — first on plain kernel TCP (the
//! reference: the scenario's own checks must pass there), then with both programs under
//! `libmemloop_preload.so` in a fresh region, where the same checks must pass AND the server's
//! debug log must show that its connections were accepted on rings. `xdom_*` tests put the
//! server and the client in two network-namespace domains (`memloop domains`, needs root and
//! `ip`; without them the runner reports them ignored with the reason, failed under `CI`).
//!
//! Run (`cargo test` builds the library next to this test binary; the `xdom_*` tests also need
//! the `memloop` binary, from the same profile or `target/release`):
//!
//! ```sh
//! cargo build --release -p memloop-cli -p memloop-evtest
//! cargo test --release -p memloop-preload --test semantics            # fast set, ~50 s
//! cargo test --release -p memloop-preload --test semantics -- --ignored --skip bug_  # slow ones
//! cargo test --release -p memloop-preload --test semantics bug_ -- --ignored  # known bugs (fail)
//! ```
//!
//! Tests named `bug_*` are ignored because the preload deviates from the kernel there (the
//! reason says how, and where in the source); they pass on kernel TCP and will pass once the
//! bug is fixed. The other ignored tests are merely slow.
//!
//! Two slow ones drive `memloop-pump` (crate `memloop-evtest`: one connection, a checksummed
//! stream each way at memory speed) instead of a script, with the `storm.py` flipper demoting
//! and promoting the connection:
//! - `switch_flip_sigkill_at_random_moments`: one end SIGKILLed at a random moment, the
//!   survivor gets a correct prefix then EOF/ECONNRESET, the region returns to its baseline
//!   (`MEMLOOP_FLIP_KILL_TRIALS`, 20; `MEMLOOP_FLIP_KILL_SEED`);
//! - `switch_ten_gigabytes_through_one_flipping_connection`: 10^10 bytes each way through one
//!   flipping connection (`MEMLOOP_SWITCH_BYTES`, `MEMLOOP_SWITCH_BYTES_BACK`).
//!
//! The handoff tests (`tests/semantics/handoff.py`: inetd chains, SCM_RIGHTS, re-exec, MSG_OOB
//! mid-stream) expect live path switching (`Scenario::switches`): until it lands they fail
//! under the preload (on kernel TCP they pass).
//!
//! `MEMLOOP_PRELOAD_LIB` and `MEMLOOP_BIN` override where the library and the CLI are taken
//! from (default: next to this test binary's profile directory, then `target/release`).
//! Every process runs under `timeout`, every script has its own watchdog, and regions, domains
//! and scratch directories are removed by guards even when a test fails.
//!
//! The servers wait up to 100 ms at accept for the client's ring offer
//! (`MEMLOOP_SERVER_WAIT_US`), so that a loaded machine does not turn a test's connection into
//! a (correct, but for this suite useless) plain-TCP one.

mod support;

use std::fs;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use support::{
    env_prefix, gcc, killed, memloop_bin, not_started, spawn, wait_bounded, wait_for_port,
    workspace, Outcome, RegionGuard, Scratch,
};

fn main() -> std::process::ExitCode {
    use memloop_testkit::test;
    memloop_testkit::run(vec![
        test!(memloop_disable_keeps_everything_on_tcp),
        test!(doorbell_count_check_catches_a_miscount),
        test!(echo_10mb_sha256_both_ways),
        test!(windows_resized_at_every_send_lose_nothing),
        test!(many_small_messages),
        test!(msg_peek_then_read),
        test!(msg_waitall_gathers_pieces),
        test!(msg_dontwait_eagain_on_empty_and_full),
        test!(msg_nosignal_write_to_closed_peer_is_epipe),
        test!(write_to_closed_peer_raises_sigpipe),
        test!(echo_256mb_sha256_both_ways).ignore("slow: 256 MB echoed with sha256 both ways"),
        test!(msg_peek_with_waitall_waits_for_all),
        test!(shutdown_rd_still_reads_queued_data),
        test!(msg_oob_urgent_byte_leaves_the_ring),
        test!(siocoutq_counts_unsent_bytes),
        test!(nonblocking_connect_pollout_so_error),
        test!(nonblocking_read_eagain),
        test!(accept4_flags_visible_via_fcntl),
        test!(readv_writev_recvmsg_sendmsg_recvfrom_sendto),
        test!(udp_echo_sizes_and_sources),
        test!(udp_connected_send_recv_read_write_and_unspec),
        test!(udp_peek_trunc_fionread),
        test!(udp_dontwait_nonblock_and_rcvtimeo),
        test!(udp_first_datagram_wakes_a_receiver_asleep_in_the_kernel),
        test!(udp_sendmmsg_recvmmsg_waitforone),
        test!(udp_socket_shared_by_fork_leaves_its_ring),
        test!(udp_datagrams_queued_at_a_fork_reach_the_child_that_reads),
        test!(udp_receive_buffer_sizes_the_queue),
        test!(udp_a_closing_senders_datagrams_are_never_missed),
        test!(udp_sleepers_in_poll_select_recvfrom_are_woken),
        test!(udp_sendmsg_recvmsg_scatter_gather),
        test!(udp_eight_peers_on_one_socket),
        test!(udp_members_and_a_kernel_only_peer_at_once),
        test!(udp_flood_never_blocks_and_keeps_order),
        test!(udp_socket_in_epoll_sets),
        test!(udp_echo_over_ipv6_loopback_and_dual_stack),
        test!(xdom_udp_echo_and_epoll_across_domains),
        test!(fionread_counts_unread_bytes),
        test!(shutdown_wr_eof_after_data_and_peer_still_sends),
        test!(close_delivers_queued_data_then_eof),
        test!(a_server_speaking_first_wakes_a_client_waiting_for_the_accept),
        test!(the_side_closing_second_on_the_ring_sends_the_second_fin),
        test!(abortive_close_linger0_is_a_reset),
        test!(close_with_unread_data_is_a_reset),
        test!(poll_select_epoll_readable_and_writable),
        test!(sleepers_in_every_kind_of_wait_are_woken_without_tcp),
        test!(a_timed_blocking_recv_is_woken_by_doorbells),
        test!(writers_asleep_on_a_full_ring_are_woken_without_tcp),
        test!(signals_interrupt_a_futex_sleep_as_they_do_a_recv),
        test!(a_program_that_closes_the_wake_socket_and_reuses_its_number),
        test!(shutdown_rd_ends_a_recv_blocked_in_another_thread),
        test!(writable_only_when_there_is_space),
        test!(pollrdhup_and_pollhup_after_shutdowns),
        test!(pollrdhup_after_peer_close),
        test!(no_pollhup_after_peer_close_alone),
        test!(pollout_after_own_shutdown_wr),
        test!(epoll_edge_triggered_reports_once_per_new_data),
        test!(epoll_edge_triggered_quiet_when_peer_reads_our_data),
        test!(epoll_oneshot_until_rearmed),
        test!(one_fd_in_two_epoll_sets),
        test!(poll_mixes_rings_pipes_and_kernel_sockets),
        test!(select_mixes_rings_pipes_and_kernel_sockets),
        test!(epoll_mixes_rings_pipes_and_kernel_sockets),
        test!(waits_time_out),
        test!(o_nonblock_toggling_fcntl_and_fionbio),
        test!(dup_family_keeps_the_connection),
        test!(so_rcvtimeo_and_so_sndtimeo),
        test!(eintr_without_sa_restart_and_restart_with_it),
        test!(errno_untouched_by_calls_that_succeed),
        test!(a_program_closing_the_liveness_lock_makes_its_member_beat),
        test!(pthread_cancel_ends_calls_blocked_on_a_ring),
        test!(the_engine_loads_only_where_it_is_needed),
        test!(a_panic_in_the_engine_is_contained_in_a_c_program),
        test!(a_forked_handler_runs_no_engine_until_it_needs_it),
        test!(ppoll_pselect_epoll_pwait_apply_their_sigmask),
        test!(blocked_send_eintr_and_sa_restart),
        test!(concurrent_send_and_recv_from_two_threads),
        test!(fork_child_serves_parent_closes_at_once),
        test!(fork_children_never_inherit_the_epoll_list_locked),
        test!(fork_parent_and_child_both_write),
        test!(exec_keeps_an_inherited_connection),
        test!(fork_exec_child_serves_parent_closes_at_once),
        test!(spawned_child_keeps_connection_after_parent_closes),
        test!(o_nonblock_shared_with_forked_child),
        test!(sendfile_from_a_file),
        test!(splice_to_and_from_a_connection),
        test!(getsockname_getpeername_like_the_kernel),
        test!(ipv4_client_on_a_dual_stack_listener),
        test!(ipv6_loopback),
        test!(peer_killed_mid_stream_eof_within_2s),
        test!(peer_killed_while_idle_wakes_epoll_and_recv),
        test!(peer_killed_while_we_send_epipe_or_reset),
        test!(peer_killed_at_random_moments)
            .ignore("slow: 20 SIGKILLs of a streaming peer at random moments"),
        test!(asyncio_streams_echo),
        test!(selectors_echo_server_20_clients),
        test!(inetd_handler_chain_dup2_exec_exec),
        test!(inetd_handler_without_the_library),
        test!(late_ring_after_a_slow_accept),
        test!(late_ring_after_the_region_was_full),
        test!(ten_thousand_connections_on_rings_then_the_region_back_to_baseline),
        test!(a_thousand_short_lived_client_processes_all_on_rings),
        test!(late_ring_not_tried_with_a_plain_client),
        test!(a_claimed_hold_is_never_given_back_on_a_reused_channel_slot),
        test!(late_ring_in_the_child_of_a_server_that_forks_per_connection),
        test!(late_ring_not_taken_while_a_fork_shares_the_connection),
        test!(late_ring_marker_freed_by_a_forked_handler_that_exits_without_close),
        test!(late_ring_for_16_connections_accepted_at_once),
        test!(late_ring_while_demoted_and_promoted),
        test!(late_ring_under_event_loops_epoll_and_poll),
        test!(late_ring_under_event_loops_select_and_epoll),
        test!(late_ring_with_a_server_started_before_its_region),
        test!(switch_storm_1200_connections_at_random_moments),
        test!(switch_flip_8_streams_demoted_and_promoted),
        test!(switch_flip_poll_driven_pair_never_reads_a_doorbell_as_readable),
        test!(switch_flip_epoll_driven_pair_never_reads_a_doorbell_as_readable),
        test!(switch_flip_epoll_edge_triggered_pair_loses_no_wakeup),
        test!(inetd_handler_exits_without_close),
        test!(scm_rights_handoff_to_preloaded_worker),
        test!(scm_rights_handoff_to_plain_worker),
        test!(scm_rights_handoff_to_preloaded_worker_comes_back_to_its_ring),
        test!(scm_rights_handoff_of_a_promoted_connection_with_unread_bytes),
        test!(scm_rights_handoff_with_unread_bytes_and_a_full_ring_fails_until_they_are_read),
        test!(demote_of_a_promoted_connection_with_unread_bytes_by_the_operator),
        test!(a_paused_sweep_holding_a_closed_connection_leaves_its_successor_alone),
        test!(a_fin_found_after_leaving_the_ring_is_not_the_peer_closing),
        test!(exec_adopts_a_switched_connection_and_brings_it_back_to_its_ring),
        test!(scm_rights_by_sendmmsg_and_recvmmsg_comes_back_to_its_ring),
        test!(exec_through_an_image_without_the_library_pins_the_connection_to_tcp),
        test!(reexec_server_chroot_and_setuid).needs(memloop_testkit::root()),
        test!(msg_oob_mid_stream_leaves_the_ring),
        test!(pidfd_getfd_of_a_ring_connection_shared_by_owner_and_grabber),
        test!(pidfd_getfd_grabber_carries_on_alone_and_comes_back_to_the_ring),
        test!(pidfd_getfd_owner_carries_on_alone_and_is_promoted_exactly),
        test!(pidfd_getfd_of_a_stopped_holder_fails_with_eagain_then_succeeds),
        test!(xdom_echo_10mb_sha256_both_ways).needs(needs_domains()),
        test!(xdom_nonblocking_connect_pollout_so_error).needs(needs_domains()),
        test!(xdom_pollrdhup_and_pollhup_after_shutdowns).needs(needs_domains()),
        test!(xdom_fork_child_serves).needs(needs_domains()),
        test!(xdom_exec_keeps_an_inherited_connection).needs(needs_domains()),
        test!(xdom_ipv4_client_on_a_dual_stack_listener).needs(needs_domains()),
        test!(xdom_echo_10mb_over_ipv6).needs(needs_domains()),
        test!(xdom_echo_10mb_over_ipv6_link_local).needs(needs_domains()),
        test!(xdom_names_over_ipv6).needs(needs_domains()),
        test!(xdom_peer_killed_mid_stream).needs(needs_domains()),
        test!(xdom_peer_killed_while_idle).needs(needs_domains()),
        test!(xdom_selectors_echo_server_20_clients).needs(needs_domains()),
        test!(xdom_switch_storm).needs(needs_domains()),
        test!(xdom_late_ring_after_a_slow_accept).needs(needs_domains()),
        test!(xdom_switch_flip).needs(needs_domains()),
        test!(switch_flip_sigkill_at_random_moments)
            .ignore("slow: 20 SIGKILLs of a flipping connection's ends at random moments"),
        test!(switch_ten_gigabytes_through_one_flipping_connection)
            .ignore("slow: 10^10 checksummed bytes each way through one flipping connection"),
    ])
}

/// `xdom_*`: network-namespace domains need root and `ip`.
fn needs_domains() -> memloop_testkit::Need {
    memloop_testkit::all([
        memloop_testkit::root(),
        memloop_testkit::tool("ip", &["-V"]),
    ])
}

/// Seconds each script may run (its own watchdog fires earlier, at `DEADLINE`).
const PROCESS_TIMEOUT: u64 = 60;
const DEADLINE: u64 = 45;

fn scripts() -> PathBuf {
    workspace().join("tests/semantics")
}

// ---- guards -----------------------------------------------------------------------------------

/// Two network-namespace domains on a bridge, on a subnet nobody else routes; removed on drop.
struct Domains {
    prefix: String,
    /// Domain 0's address (the server's).
    server: String,
}

/// The address family a scenario across domains dials (domain 0's address of that kind).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Family {
    V4,
    /// The domain's global IPv6 address (`memloop domains up` gives each one).
    V6,
    /// Its link-local IPv6 address, scoped to the client's `eth0`.
    LinkLocal,
}

static SUBNETS: Mutex<u32> = Mutex::new(0);

impl Domains {
    fn up() -> Domains {
        let bin = memloop_bin();
        let routes = Command::new("ip")
            .args(["-4", "route", "show"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let mut next = SUBNETS.lock().unwrap_or_else(|e| e.into_inner());
        let second = 200 + std::process::id() % 50;
        let (prefix, subnet, third) = loop {
            *next += 1;
            let third = *next % 250;
            let subnet = format!("10.{second}.{third}.0/24");
            if !routes.contains(&subnet) {
                break (
                    format!("sx{}{}", std::process::id() % 10_000, *next % 100),
                    subnet,
                    third,
                );
            }
        };
        drop(next);
        let d = Domains {
            prefix,
            server: format!("10.{second}.{third}.1"),
        };
        let out = Command::new(&bin)
            .args([
                "domains", "up", "2", "--prefix", &d.prefix, "--subnet", &subnet,
            ])
            .output()
            .expect("run memloop domains up");
        assert!(
            out.status.success(),
            "memloop domains up: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        d
    }

    /// The address of domain 0 (the server's) a client dials for `family`.
    fn server_addr(&self, family: Family) -> String {
        let ns = format!("{}-d0", self.prefix);
        let scope = match family {
            Family::V4 => return self.server.clone(),
            Family::V6 => "global",
            Family::LinkLocal => "link",
        };
        // (A link-local address is tentative for a moment after the link came up: until its
        // duplicate address detection is done, nothing can bind or reach it.)
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let out = Command::new("ip")
                .args(["-n", &ns, "-j", "-6", "addr", "show", "dev", "eth0"])
                .output()
                .expect("ip -6 addr show");
            let v: serde_json::Value =
                serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
            let found = v[0]["addr_info"].as_array().and_then(|a| {
                a.iter()
                    .find(|i| i["scope"] == scope && i["tentative"].as_bool() != Some(true))
            });
            if let Some(a) = found.and_then(|i| i["local"].as_str()) {
                return match family {
                    Family::LinkLocal => format!("{a}%eth0"),
                    _ => a.to_string(),
                };
            }
            assert!(
                std::time::Instant::now() < deadline,
                "domain 0 has no usable {scope} IPv6 address: {v}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `cmd` wrapped to run in domain `i`.
    fn wrap(&self, i: u32, cmd: Vec<String>) -> Vec<String> {
        let mut v = vec![
            memloop_bin().display().to_string(),
            "domains".into(),
            "exec".into(),
            i.to_string(),
            "--prefix".into(),
            self.prefix.clone(),
            "--".into(),
        ];
        v.extend(cmd);
        v
    }
}

impl Drop for Domains {
    fn drop(&mut self) {
        let _ = Command::new(memloop_bin())
            .args(["domains", "down", "--prefix", &self.prefix])
            .output();
    }
}

// ---- scenarios --------------------------------------------------------------------------------

#[derive(Clone, Copy)]
struct Scenario {
    script: &'static str,
    case: &'static str,
    /// Connections the server must accept on rings under the preload.
    rings: usize,
    /// The server SIGKILLs itself on purpose.
    server_dies: bool,
    /// The server binds this instead of the address the client dials.
    bind: Option<&'static str>,
    /// The address the client dials on loopback (default 127.0.0.1).
    host: Option<&'static str>,
    /// Passed to both roles as `--extra`.
    extra: Option<&'static str>,
    /// What the server's debug log must contain under the preload (several: ` && `).
    evidence: Option<&'static str>,
    /// Under the preload the connection is expected to leave its ring for its TCP socket, for
    /// this reason (`fd_passed`, `exec`, `oob`, ...): a log (server or client) must have a
    /// `switched to TCP` line naming it, and lines saying that the connection stays on TCP
    /// for it are not problems.
    switches: Option<&'static str>,
    /// Preload runs (a racy bug shows up within a few).
    repeat: usize,
    /// More `NAME=VALUE`s (space-separated) in the server's environment under the preload
    /// (e.g. `MEMLOOP_TEST_PAUSE`).
    server_env: Option<&'static str>,
    /// Channel slots of the scenario's region (default: in proportion to its 64 MiB): one
    /// makes a connection take its predecessor's slot (slots are handed out next-fit).
    channels: Option<u32>,
    /// Across domains: the address family dialled.
    family: Family,
}

const fn sc(script: &'static str, case: &'static str) -> Scenario {
    Scenario {
        script,
        case,
        rings: 1,
        server_dies: false,
        bind: None,
        host: None,
        extra: None,
        evidence: None,
        switches: None,
        repeat: 1,
        server_env: None,
        channels: None,
        family: Family::V4,
    }
}

impl Scenario {
    const fn rings(mut self, n: usize) -> Self {
        self.rings = n;
        self
    }
    const fn dies(mut self) -> Self {
        self.server_dies = true;
        self
    }
    const fn family(mut self, f: Family) -> Self {
        self.family = f;
        self
    }
    const fn bind(mut self, b: &'static str) -> Self {
        self.bind = Some(b);
        self
    }
    const fn host(mut self, h: &'static str) -> Self {
        self.host = Some(h);
        self
    }
    const fn extra(mut self, e: &'static str) -> Self {
        self.extra = Some(e);
        self
    }
    const fn evidence(mut self, e: &'static str) -> Self {
        self.evidence = Some(e);
        self
    }
    const fn switches(mut self, reason: &'static str) -> Self {
        self.switches = Some(reason);
        self
    }
    const fn server_env(mut self, e: &'static str) -> Self {
        self.server_env = Some(e);
        self
    }
    const fn channels(mut self, n: u32) -> Self {
        self.channels = Some(n);
        self
    }
    const fn repeat(mut self, n: usize) -> Self {
        self.repeat = n;
        self
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Kernel,
    Preload,
    /// Preloaded, but with `MEMLOOP_DISABLE=1`.
    Disabled,
}

/// `timeout … [env LD_PRELOAD=… MEMLOOP_…] python3 SCRIPT ROLE ARGS`.
fn role_cmd(
    s: &Scenario,
    mode: Mode,
    region: Option<&str>,
    role: &str,
    args: Vec<String>,
) -> Vec<String> {
    let preload = (mode != Mode::Kernel).then(|| region.expect("region"));
    let mut v = env_prefix(PROCESS_TIMEOUT, preload);
    if mode == Mode::Disabled {
        v.push("MEMLOOP_DISABLE=1".into());
    }
    if let (Some(e), true, "server") = (s.server_env, mode != Mode::Kernel, role) {
        v.extend(e.split(' ').map(String::from));
    }
    v.push("python3".into());
    v.push(
        scripts()
            .join(format!("{}.py", s.script))
            .display()
            .to_string(),
    );
    v.push(role.into());
    v.extend(["--case".into(), s.case.into()]);
    v.extend(["--deadline".into(), DEADLINE.to_string()]);
    if let Some(e) = s.extra {
        v.extend(["--extra".into(), e.into()]);
    }
    v.extend(args);
    v
}

/// One run of the scenario: the server, then (once it published its port) the client.
fn run_pair(s: &Scenario, mode: Mode, region: Option<&str>, doms: Option<&Domains>) -> Outcome {
    let scratch = Scratch::new("semantics", s.case);
    let dir = &scratch.0;
    let port_file = dir.join("port");
    let host = match doms {
        Some(d) => d.server_addr(s.family),
        None => s.host.unwrap_or("127.0.0.1").to_string(),
    };
    let mut sargs = vec![
        "--host".into(),
        host.clone(),
        "--port-file".into(),
        port_file.display().to_string(),
    ];
    if let Some(b) = s.bind {
        sargs.extend(["--bind".into(), b.into()]);
    }
    let mut scmd = role_cmd(s, mode, region, "server", sargs);
    if let Some(d) = doms {
        scmd = d.wrap(0, scmd);
    }
    let mut server = spawn(&scmd, &dir.join("s.out"), &dir.join("s.err"));
    let port = wait_for_port(&mut server, &port_file, Duration::from_secs(20));
    let client = match port {
        Some(port) => {
            let cargs = vec![
                "--host".into(),
                host,
                "--port".into(),
                port.to_string(),
                "--port-file".into(),
                port_file.display().to_string(),
            ];
            let mut ccmd = role_cmd(s, mode, region, "client", cargs);
            if let Some(d) = doms {
                ccmd = d.wrap(1, ccmd);
            }
            let mut c = spawn(&ccmd, &dir.join("c.out"), &dir.join("c.err"));
            wait_bounded(&mut c, Duration::from_secs(PROCESS_TIMEOUT + 10))
        }
        None => not_started(),
    };
    // Once the client is done the server has little left to do: do not wait out its watchdog
    // when it hangs (e.g. in accept after a client that failed before connecting).
    let server = wait_bounded(&mut server, Duration::from_secs(15));
    outcome_in(dir, server, client)
}

/// What both roles left in `dir` (`s.out`, `s.err`, `c.out`, `c.err`) with their exit statuses.
fn outcome_in(
    dir: &std::path::Path,
    server: std::process::ExitStatus,
    client: std::process::ExitStatus,
) -> Outcome {
    let read = |n: &str| fs::read_to_string(dir.join(n)).unwrap_or_default();
    Outcome {
        server,
        client,
        server_out: read("s.out"),
        server_err: read("s.err"),
        client_out: read("c.out"),
        client_err: read("c.err"),
    }
}

/// The scenario's own verdict: both roles said OK (a dying server: was SIGKILLed).
fn assert_passed(s: &Scenario, o: &Outcome, what: &str) {
    let client_ok = o.client.success() && o.client_out.contains(&format!("OK client {}", s.case));
    let server_ok = if s.server_dies {
        killed(&o.server)
    } else {
        o.server.success() && o.server_out.contains(&format!("OK server {}", s.case))
    };
    assert!(
        client_ok && server_ok,
        "{}",
        o.report(&format!("{what}: the scenario failed"))
    );
}

/// Under the preload: the connections went over rings, nothing fell back, nothing panicked.
fn assert_ring_used(s: &Scenario, o: &Outcome, what: &str) {
    let accepted = o.server_err.matches("accepted on a ring").count();
    let mut problems = Vec::new();
    if accepted < s.rings {
        problems.push(format!(
            "the server accepted {accepted} connection(s) on rings, want {}",
            s.rings
        ));
    }
    for e in s.evidence.iter().flat_map(|e| e.split(" && ")) {
        if !o.server_err.contains(e) {
            problems.push(format!("the server's log lacks {e:?}"));
        }
    }
    if let Some(reason) = s.switches {
        let switched = [&o.server_err, &o.client_err]
            .iter()
            .flat_map(|l| l.lines())
            .any(|l| l.contains(SWITCHED) && l.contains(reason));
        if !switched {
            problems.push(format!(
                "no log says {SWITCHED:?} with reason {reason:?} (the connection was expected \
                 to leave its ring)"
            ));
        }
    }
    problems.extend(doorbell_count_problems(&[&o.server_err, &o.client_err]));
    for (who, log) in [("server", &o.server_err), ("client", &o.client_err)] {
        for bad in ["stays on TCP", "no ring offered", "panicked", "ring error"] {
            // A connection that switched on purpose goes on on TCP, and may say so.
            let excused =
                |line: &str| bad == "stays on TCP" && s.switches.is_some_and(|r| line.contains(r));
            if log.lines().any(|l| l.contains(bad) && !excused(l)) {
                problems.push(format!("the {who}'s log says {bad:?}"));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{}",
        o.report(&format!("{what}: {}", problems.join("; ")))
    );
}

/// The library's log line for a connection that left its ring (live path switching).
const SWITCHED: &str = "switched to TCP";

fn check_with(s: Scenario, doms: Option<&Domains>) {
    let place = if doms.is_some() {
        "across two domains"
    } else {
        "on loopback"
    };
    let t0 = Instant::now();
    let kernel = run_pair(&s, Mode::Kernel, None, doms);
    assert_passed(
        &s,
        &kernel,
        &format!(
            "{}/{} on kernel TCP {place} (the reference)",
            s.script, s.case
        ),
    );
    let t1 = Instant::now();
    for i in 0..s.repeat {
        let region = scenario_region(&s);
        let o = run_pair(&s, Mode::Preload, Some(&region.0), doms);
        let what = format!(
            "{}/{} under the preload {place} (run {} of {})",
            s.script,
            s.case,
            i + 1,
            s.repeat
        );
        assert_passed(&s, &o, &what);
        assert_ring_used(&s, &o, &what);
    }
    eprintln!(
        "{}/{} {place}: kernel {:.2} s, preload {:.2} s",
        s.script,
        s.case,
        (t1 - t0).as_secs_f64(),
        t1.elapsed().as_secs_f64()
    );
}

/// The scenario's region: 64 MiB, its tables in proportion unless it names its channels.
fn scenario_region(s: &Scenario) -> RegionGuard {
    let mut params = memloop::registry::RegionParams::for_size(64 << 20);
    if let Some(n) = s.channels {
        params.max_channels = n;
    }
    RegionGuard::with_params("sem", s.case, params)
}

/// Kernel reference and preload run on loopback.
fn check(s: Scenario) {
    check_with(s, None);
}

/// Kernel reference and preload run with the server in domain 0 and the client in domain 1.
fn check_domains(s: Scenario) {
    let d = Domains::up();
    check_with(s, Some(&d));
}

// ---- MEMLOOP_DISABLE ----------------------------------------------------------------------------

/// `MEMLOOP_DISABLE=1`: the library stays loaded but dormant: the data still arrives, over the
/// kernel, and the region never hears of the programs.
fn memloop_disable_keeps_everything_on_tcp() {
    let s = sc("stream", "echo_10mb");
    let region = RegionGuard::new("sem", s.case, 64 << 20);
    let o = run_pair(&s, Mode::Disabled, Some(&region.0), None);
    assert_passed(&s, &o, "stream/echo_10mb with MEMLOOP_DISABLE=1");
    for (who, log) in [("server", &o.server_err), ("client", &o.client_err)] {
        for active in [
            "transparent layer active",
            "accepted on a ring",
            "offered a ring",
        ] {
            assert!(
                !log.contains(active),
                "{}",
                o.report(&format!(
                    "MEMLOOP_DISABLE=1 but the {who}'s log says {active:?}"
                ))
            );
        }
    }
}

// ---- stream -----------------------------------------------------------------------------------

fn echo_10mb_sha256_both_ways() {
    check(sc("stream", "echo_10mb"));
}

fn many_small_messages() {
    check(sc("stream", "small_messages"));
}

/// Issue 14's grow/shrink storm through real programs: the server's tx window is set to a
/// random size before each of its sends (`MEMLOOP_TEST_RESIZE=1`: a grow at once, copying
/// wrapped bytes, a shrink when the ring is empty) while both streams are checked — 2,000
/// ping-pongs and 20,000 framed writes (their sha256), and 10 MiB each way.
fn windows_resized_at_every_send_lose_nothing() {
    for case in ["small_messages", "echo_10mb"] {
        check(
            sc("stream", case)
                .server_env("MEMLOOP_TEST_RESIZE=1")
                .evidence("test resize"),
        );
    }
}

fn msg_peek_then_read() {
    check(sc("stream", "peek"));
}

fn msg_waitall_gathers_pieces() {
    check(sc("stream", "waitall"));
}

fn msg_dontwait_eagain_on_empty_and_full() {
    check(sc("stream", "dontwait"));
}

fn msg_nosignal_write_to_closed_peer_is_epipe() {
    check(sc("stream", "nosignal_epipe"));
}

fn write_to_closed_peer_raises_sigpipe() {
    check(sc("stream", "sigpipe"));
}

fn echo_256mb_sha256_both_ways() {
    check(sc("stream", "echo_10mb").extra("268435456"));
}

fn msg_peek_with_waitall_waits_for_all() {
    check(sc("flags", "peek_waitall"));
}

fn shutdown_rd_still_reads_queued_data() {
    check(sc("flags", "shut_rd"));
}

/// MSG_OOB: the ring has no urgent data, so the connection switches to TCP first (POLLPRI,
/// select's exceptional set and recv(MSG_OOB) are then the kernel's).
fn msg_oob_urgent_byte_leaves_the_ring() {
    check(sc("flags", "oob").switches("oob"));
}

fn siocoutq_counts_unsent_bytes() {
    check(sc("flags", "siocoutq"));
}

// ---- non-blocking -------------------------------------------------------------------------------

fn nonblocking_connect_pollout_so_error() {
    check(sc("nonblock", "nb_connect").rings(3));
}

fn nonblocking_read_eagain() {
    check(sc("nonblock", "nb_read"));
}

fn accept4_flags_visible_via_fcntl() {
    check(sc("nonblock", "accept4_flags").rings(2));
}

// ---- data calls -----------------------------------------------------------------------------------

fn readv_writev_recvmsg_sendmsg_recvfrom_sendto() {
    check(sc("vectored", "vectored_io"));
}

fn fionread_counts_unread_bytes() {
    check(sc("vectored", "fionread"));
}

// ---- shutdown and close -----------------------------------------------------------------------

fn shutdown_wr_eof_after_data_and_peer_still_sends() {
    check(sc("shutdown", "shut_wr"));
}

/// A server that accepts late and speaks first, the client asleep for the decision in a
/// blocking recv, poll, select and epoll (level and edge): the accept wakes each, by futex or
/// by a doorbell for a sleeper in the kernel.
fn a_server_speaking_first_wakes_a_client_waiting_for_the_accept() {
    check(sc("nonblock", "greet"));
    check_domains(sc("nonblock", "greet"));
}

fn close_delivers_queued_data_then_eof() {
    check(sc("shutdown", "close_delivers"));
}

fn abortive_close_linger0_is_a_reset() {
    check(sc("resets", "linger0"));
}

fn close_with_unread_data_is_a_reset() {
    check(sc("resets", "close_unread"));
}

// ---- wake-ups -----------------------------------------------------------------------------------

/// Runs `wakes/<case>` with `extra` under the preload (after the kernel reference) and
/// returns the region's TCP doorbell and wake-fallback counts.
fn wake_counts(case: &'static str, extra: &'static str) -> (u64, u64) {
    let s = sc("wakes", case).extra(extra);
    let kernel = run_pair(&s, Mode::Kernel, None, None);
    assert_passed(&s, &kernel, &format!("wakes/{case} {extra} on kernel TCP"));
    let region = RegionGuard::new("sem", case, 64 << 20);
    let o = run_pair(&s, Mode::Preload, Some(&region.0), None);
    let what = format!("wakes/{case} {extra} under the preload");
    assert_passed(&s, &o, &what);
    assert_ring_used(&s, &o, &what);
    let r = memloop::Region::open(&memloop::RegionSpec::parse(&region.0)).expect("region");
    let c = r.registry().counters();
    let get = |i: usize| c.get(i).copied().unwrap_or(0);
    (
        get(memloop::registry::COUNTER_DOORBELLS),
        get(memloop::registry::COUNTER_WAKE_FALLBACK),
    )
}

/// The scenario's rounds: each one wakes the server at least once.
const WAKE_ROUNDS: u64 = 40;

/// The server sleeps (and the client often does) in a blocking recv, poll, select and epoll
/// (level, edge, one-shot; with and without timeouts) before each of 40 messages: every
/// wake-up comes by futex or wake socket — a handful of doorbells at most (the accept's, a
/// shutdown's), none fallen back.
fn sleepers_in_every_kind_of_wait_are_woken_without_tcp() {
    for kind in [
        "recv",
        "poll",
        "poll:5",
        "select",
        "select:5",
        "epoll_lt",
        "epoll_lt:5",
        "epoll_et",
        "epoll_oneshot",
        "epoll_oneshot:5",
    ] {
        let (doorbells, fallback) = wake_counts("echo", kind);
        assert!(
            doorbells < WAKE_ROUNDS / 4 && fallback == 0,
            "{kind}: {doorbells} doorbells over TCP and {fallback} fallen-back wake-ups for \
             {WAKE_ROUNDS} sleeps"
        );
    }
}

/// A writer that fills the ring sleeps for room — in a blocking send (the futex of the
/// ring's producer end), poll, select or epoll — and the reader's releases wake it.
fn writers_asleep_on_a_full_ring_are_woken_without_tcp() {
    for kind in ["send", "poll", "select", "epoll_lt"] {
        let (doorbells, fallback) = wake_counts("fill", kind);
        assert!(
            doorbells < WAKE_ROUNDS / 4 && fallback == 0,
            "{kind}: {doorbells} doorbells over TCP and {fallback} fallen-back wake-ups for a \
             writer that slept for room"
        );
    }
}

/// The control: a blocking recv with SO_RCVTIMEO keeps sleeping on its socket (the kernel's
/// EINTR rule for timed waits is not the futex's), so its wake-ups are doorbells — the count
/// the test above relies on does see them.
fn a_timed_blocking_recv_is_woken_by_doorbells() {
    let (doorbells, _) = wake_counts("echo", "recv_timeout");
    assert!(
        doorbells >= WAKE_ROUNDS / 2,
        "{doorbells} doorbells for {WAKE_ROUNDS} timed sleeps: the doorbell count misses them"
    );
}

/// A blocking recv asleep on the futex: a handler with SA_RESTART lets it go on, one without
/// ends it with EINTR — as on TCP (the kernel reference runs the same script).
fn signals_interrupt_a_futex_sleep_as_they_do_a_recv() {
    let (doorbells, fallback) = wake_counts("signals", "");
    assert!(
        doorbells < WAKE_ROUNDS / 4 && fallback == 0,
        "{doorbells} doorbells, {fallback} fallen back: the sleeps were not on the futex"
    );
}

/// The program closes the library's wake socket (as `closefrom` does) and puts its own pipe
/// at that number: its polls are still woken, and the pipe's byte is left alone.
fn a_program_that_closes_the_wake_socket_and_reuses_its_number() {
    let (_, fallback) = wake_counts("reuse", "");
    assert_eq!(
        fallback, 0,
        "a new wake socket takes over: no wake-up falls back"
    );
}

/// `shutdown(SHUT_RD)` ends a `recv` another thread is blocked in, as the kernel's does (the
/// sleeper on the ring's futex is woken by it).
fn shutdown_rd_ends_a_recv_blocked_in_another_thread() {
    wake_counts("shut_rd", "");
}

// ---- readiness ----------------------------------------------------------------------------------

fn poll_select_epoll_readable_and_writable() {
    check(sc("readiness", "poll_select_epoll"));
}

fn writable_only_when_there_is_space() {
    check(sc("readiness", "writable"));
}

fn pollrdhup_and_pollhup_after_shutdowns() {
    check(sc("readiness", "hup_rdhup"));
}

fn pollrdhup_after_peer_close() {
    check(sc("readiness", "close_hup"));
}

fn no_pollhup_after_peer_close_alone() {
    check(sc("readiness", "close_hup_strict"));
}

fn pollout_after_own_shutdown_wr() {
    check(sc("readiness", "shut_wr_pollout"));
}

fn epoll_edge_triggered_reports_once_per_new_data() {
    check(sc("readiness", "epoll_et").rings(2));
}

fn epoll_edge_triggered_quiet_when_peer_reads_our_data() {
    check(sc("readiness", "epoll_et_quiet"));
}

fn epoll_oneshot_until_rearmed() {
    check(sc("readiness", "epoll_oneshot"));
}

fn one_fd_in_two_epoll_sets() {
    check(sc("readiness", "epoll_two_sets"));
}

fn poll_mixes_rings_pipes_and_kernel_sockets() {
    check(sc("readiness", "mixed_poll"));
}

fn select_mixes_rings_pipes_and_kernel_sockets() {
    check(sc("readiness", "mixed_select"));
}

fn epoll_mixes_rings_pipes_and_kernel_sockets() {
    check(sc("readiness", "mixed_epoll"));
}

fn waits_time_out() {
    check(sc("readiness", "timeouts"));
}

// ---- fd control -------------------------------------------------------------------------------

fn o_nonblock_toggling_fcntl_and_fionbio() {
    check(sc("fdctl", "nonblock_toggle"));
}

fn dup_family_keeps_the_connection() {
    check(sc("fdctl", "dup_family").rings(2));
}

fn so_rcvtimeo_and_so_sndtimeo() {
    check(sc("fdctl", "sockopt_timeouts"));
}

fn eintr_without_sa_restart_and_restart_with_it() {
    check(sc("fdctl", "eintr"));
}

fn errno_untouched_by_calls_that_succeed() {
    check(sc("fdctl", "errno_kept"));
}

/// A program that closes every fd it did not open (`os.closerange`, as daemons do) closes the
/// library's liveness lock too: the member must start beating before the lock goes (else a
/// judge in another pid namespace would find it dead), and its connection still works.
fn a_program_closing_the_liveness_lock_makes_its_member_beat() {
    std::env::set_var("MEMLOOP_BIN", memloop_bin());
    let s = sc("fdctl", "closerange");
    let kernel = run_pair(&s, Mode::Kernel, None, None);
    assert_passed(
        &s,
        &kernel,
        "fdctl/closerange on kernel TCP (the reference)",
    );
    let region = RegionGuard::new("sem", s.case, 64 << 20);
    let o = run_pair(&s, Mode::Preload, Some(&region.0), None);
    assert_passed(&s, &o, "fdctl/closerange under the preload");
    assert!(
        o.client_err.contains("the lock went, the member beats"),
        "{}",
        o.report("the client did not check its member (not under the preload?)")
    );
}

/// `pthread_cancel` of a thread blocked in a socket call on a ring connection or in `accept`
/// (`tests/semantics/c/cancel.c`, one process holding both ends): every such call is a
/// cancellation point, so on kernel TCP the thread ends cancelled, and so it must under the
/// preload. Before `crate::cancel`, `recv`/`read` stayed blocked (a futex sleep is no
/// cancellation point) and `poll`/`epoll_wait`/`select` aborted the process ("FATAL:
/// exception not rethrown": the cancellation's unwind reached the hook's `catch_unwind`).
fn pthread_cancel_ends_calls_blocked_on_a_ring() {
    let dir = Scratch::new("semantics", "cancel");
    let exe = build_c(&dir, "cancel");
    let run = |region: Option<&str>, modes: &str| run_c(&exe, region, modes);
    // Each alone (the first cancellation of the process), then all in one process, twice
    // (threads cancelled before, their `pthread_t` reused by the next).
    const MODES: [&str; 7] = [
        "recv",
        "read",
        "poll",
        "epoll",
        "select",
        "accept",
        "recv accept poll read epoll select accept recv select poll epoll read",
    ];
    for m in MODES {
        let (code, said) = run(None, m);
        assert_eq!(code, Some(0), "kernel TCP, {m}: {said}");
    }
    let region = RegionGuard::new("sem", "cancel", 64 << 20);
    let bad: Vec<String> = MODES
        .iter()
        .map(|m| (m, run(Some(&region.0), m)))
        .filter(|(_, (code, _))| *code != Some(0))
        .map(|(m, (code, said))| format!("{m}: exit {code:?} ({said})"))
        .collect();
    assert!(bad.is_empty(), "under the preload: {}", bad.join("; "));
}

/// `libmemloop.so` loads its engine only in a process that needs it, with the settings the
/// process started with (`tests/semantics/c/lazy_engine.c`): a program without sockets, and
/// its fork child, never map the engine; a child forked while another thread loads it does not
/// wait for that load; a program that clears its environment before its first socket still
/// gets a ring in its region (the ring's bytes are counted there).
fn the_engine_loads_only_where_it_is_needed() {
    let dir = Scratch::new("semantics", "lazy");
    let exe = build_c(&dir, "lazy_engine");
    let region = RegionGuard::new("sem", "lazy", 64 << 20);
    let (code, said) = run_c(&exe, Some(&region.0), "idle");
    assert_eq!(code, Some(0), "idle: {said}");
    assert_eq!(said, "idle: engine absent");
    let bytes = || {
        let r = memloop::Region::open(&memloop::RegionSpec::parse(&region.0)).expect("region");
        let c = r.registry().counters();
        c.get(memloop::registry::COUNTER_RING_BYTES)
            .copied()
            .unwrap_or(0)
    };
    // A fork while another thread loads the engine (paused in its start-up): the child does
    // not wait for a load that will never finish in it.
    let mut cmd = env_prefix(60, Some(&region.0));
    cmd.push("MEMLOOP_TEST_PAUSE=engine-load:500000:1".into());
    cmd.push(exe.display().to_string());
    cmd.push("fork-while-loading".into());
    let out = Command::new(&cmd[0]).args(&cmd[1..]).output().expect("run");
    let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(out.status.code(), Some(0), "fork-while-loading: {said}");
    assert_eq!(said, "fork-while-loading: child not stuck");
    let before = bytes();
    let (code, said) = run_c(&exe, Some(&region.0), "clearenv");
    assert_eq!(code, Some(0), "clearenv: {said}");
    assert_eq!(said, "clearenv: engine loaded");
    assert!(
        bytes() >= before + 10,
        "clearenv: the exchange did not go through a ring of its region ({} bytes before, {} after)",
        before,
        bytes()
    );
}

/// A panic inside the engine is contained in a C program, which has no unwinder loaded of its
/// own (`tests/semantics/c/contained_panic.c`, with a test panic in `connect`): the call fails
/// with EIO and the program goes on, its next connection works. The engine loads libgcc_s
/// only then (its unwinder entry points forward to it: `shim/unwind_forward.c`).
fn a_panic_in_the_engine_is_contained_in_a_c_program() {
    let dir = Scratch::new("semantics", "panic");
    let exe = build_c(&dir, "contained_panic");
    let region = RegionGuard::new("sem", "panic", 64 << 20);
    let mut cmd = env_prefix(60, Some(&region.0));
    cmd.push("MEMLOOP_TEST_PANIC=connect:1".into());
    cmd.push(exe.display().to_string());
    let out = Command::new(&cmd[0]).args(&cmd[1..]).output().expect("run");
    let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
    let log = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{said}\n{log}");
    assert_eq!(
        said, "first connect: EIO; unwinder before: absent, after: loaded; second connect: ok",
        "{log}"
    );
    assert!(log.contains("test panic at connect"), "{log}");
}

/// A fork-per-connection server's child, whose parent holds only plain connections and
/// listeners, puts the engine's fork handler off (`tests/semantics/c/deferred_child.c`): it
/// echoes a client without the library over plain TCP (in `poll`), closes the listener and every fd from 100 up, its copy of the
/// engine's lock fd is gone at once; its own fork child and then itself need the engine later
/// (a new socket to a member) and get rings. The handler runs exactly twice (once in each,
/// when first needed), and never in the parent's log.
fn a_forked_handler_runs_no_engine_until_it_needs_it() {
    use std::io::{BufRead, BufReader, Read, Write};
    let dir = Scratch::new("semantics", "deferred");
    let exe = build_c(&dir, "deferred_child");
    let region = RegionGuard::new("sem", "deferred", 64 << 20);
    let mut cmd = env_prefix(60, Some(&region.0));
    cmd.push(exe.display().to_string());
    cmd.push(format!("/dev/shm/memloop-{}", region.0));
    let mut child = Command::new(&cmd[0])
        .args(&cmd[1..])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run");
    let mut out = BufReader::new(child.stdout.take().expect("stdout"));
    let mut first = String::new();
    out.read_line(&mut first).expect("port line");
    let port: u16 = first
        .trim()
        .trim_start_matches("port ")
        .parse()
        .expect("port");
    // This test process is no member: the server's connection stays plain.
    let mut c = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let mut echoed = Vec::new();
    for _ in 0..5 {
        c.write_all(b"ping\n").expect("send");
        let mut b = [0u8; 5];
        c.read_exact(&mut b).expect("echo");
        echoed.extend_from_slice(&b);
    }
    c.shutdown(std::net::Shutdown::Write).expect("shutdown");
    let mut rest = String::new();
    out.read_to_string(&mut rest).expect("output");
    let mut log = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut log)
        .expect("log");
    let status = child.wait().expect("wait");
    assert_eq!(echoed, b"ping\n".repeat(5));
    assert!(status.success(), "{rest}\n{log}");
    assert!(rest.contains("grandchild ok"), "{rest}\n{log}");
    assert!(
        rest.contains("child ok: lock fds 1 in the parent, 0 here; 25 bytes echoed; grandchild ok"),
        "{rest}\n{log}"
    );
    // Twice, each time at the new socket, with the listener's close noted: a wake in `poll`
    // would come before it in the child, and one in `closefrom` would make the grandchild's
    // fork a fresh one, whose handler finds nothing closed.
    let ran: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("the engine's child handler ran when first needed"))
        .collect();
    assert_eq!(
        ran.len(),
        2,
        "the deferred handler ran {} times:\n{log}",
        ran.len()
    );
    assert!(ran.iter().all(|l| !l.contains("closed=0")), "{ran:?}");
    let r = memloop::Region::open(&memloop::RegionSpec::parse(&region.0)).expect("region");
    let bytes = r.registry().counters()[memloop::registry::COUNTER_RING_BYTES];
    assert!(
        bytes >= 16,
        "the late exchanges used no ring ({bytes} ring bytes)\n{log}"
    );
}

/// Runs a program built by [`build_c`] with `args` (space separated), under the preload in
/// `region` or on kernel TCP: its exit code and what it printed.
fn run_c(exe: &std::path::Path, region: Option<&str>, args: &str) -> (Option<i32>, String) {
    let mut cmd = env_prefix(60, region);
    cmd.push(exe.display().to_string());
    cmd.extend(args.split_whitespace().map(String::from));
    let out = Command::new(&cmd[0]).args(&cmd[1..]).output().expect("run");
    let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.code(), said)
}

/// Builds `tests/semantics/c/NAME.c` into `dir` (gcc, warnings as errors).
fn build_c(dir: &Scratch, name: &str) -> PathBuf {
    let exe = dir.0.join(name);
    gcc(
        &workspace().join(format!("tests/semantics/c/{name}.c")),
        &exe,
    );
    exe
}

/// `tests/semantics/c/first_closer.c`: a client closes right after sending, a C server that
/// spins in `recv` sees the ring's EOF within nanoseconds and closes at once. The client's
/// FIN must still go first, as on TCP, leaving TIME_WAIT on the client's side and none on the
/// server's listening port; and a child the server forks after each close must not keep the
/// held socket open (the client would wait in FIN_WAIT2 for the server's FIN). Without the second closer's socket held until the first one's
/// FIN (`conn/linger.rs`), most runs left TIME_WAIT on the server's port (up to 49 of 50
/// connections).
fn the_side_closing_second_on_the_ring_sends_the_second_fin() {
    let dir = Scratch::new("semantics", "first_closer");
    let exe = build_c(&dir, "first_closer");
    let run = |region: Option<&str>, mode: &str| run_c(&exe, region, mode);
    for mode in ["", "fork"] {
        let (code, said) = run(None, mode);
        assert_eq!(code, Some(0), "kernel TCP ({mode}): {said}");
    }
    let region = RegionGuard::new("sem", "fclose", 64 << 20);
    for (round, mode) in ["", "fork", "", "fork", ""].iter().enumerate() {
        let (code, said) = run(Some(&region.0), mode);
        assert_eq!(code, Some(0), "round {round} ({mode}): {said}");
    }
}

fn ppoll_pselect_epoll_pwait_apply_their_sigmask() {
    check(sc("signals", "sigmask_waits"));
}

fn blocked_send_eintr_and_sa_restart() {
    check(sc("signals", "eintr_send"));
}

// ---- threads ------------------------------------------------------------------------------------

fn concurrent_send_and_recv_from_two_threads() {
    check(sc("threads", "duplex_threads"));
}

// ---- processes ----------------------------------------------------------------------------------

/// With parent and child on one CPU the parent closes its copy before the child runs at all.
fn fork_child_serves_parent_closes_at_once() {
    check(sc("procs", "fork_child_serves").extra("one_cpu").repeat(2));
}

/// 300 forks while another thread creates and closes epoll sets: each child closes an
/// inherited epoll fd. Before, a child could inherit the library's list of epoll fds locked by
/// that thread and spin for good in its first close (an orphaned storm client did, at 65 % of
/// a CPU, for 40 minutes).
fn fork_children_never_inherit_the_epoll_list_locked() {
    check(sc("procs", "fork_amid_epolls"));
}

fn fork_parent_and_child_both_write() {
    check(sc("procs", "fork_both_write"));
}

fn exec_keeps_an_inherited_connection() {
    check(sc("procs", "exec_inherit").evidence("inherited ring connection adopted after exec"));
}

fn fork_exec_child_serves_parent_closes_at_once() {
    check(
        sc("procs", "fork_exec_inherit")
            .extra("one_cpu")
            .evidence("inherited ring connection adopted after exec")
            .repeat(2),
    );
}

fn spawned_child_keeps_connection_after_parent_closes() {
    check(sc("procs", "spawn_inherit").evidence("inherited ring connection adopted after exec"));
}

fn o_nonblock_shared_with_forked_child() {
    check(sc("procs", "fork_shared_nonblock"));
}

// ---- sendfile, names ------------------------------------------------------------------------------

fn sendfile_from_a_file() {
    check(sc("sendfile", "sendfile"));
}

fn splice_to_and_from_a_connection() {
    check(sc("sendfile", "splice"));
}

fn getsockname_getpeername_like_the_kernel() {
    check(sc("names", "names"));
}

fn ipv4_client_on_a_dual_stack_listener() {
    check(sc("names", "names").bind("::").extra("dualstack"));
}

fn ipv6_loopback() {
    check(sc("names", "names").host("::1"));
}

// ---- peer death ---------------------------------------------------------------------------------

fn peer_killed_mid_stream_eof_within_2s() {
    check(sc("death", "killed_streaming").dies());
}

fn peer_killed_while_idle_wakes_epoll_and_recv() {
    check(sc("death", "killed_idle").dies());
}

fn peer_killed_while_we_send_epipe_or_reset() {
    check(sc("death", "killed_while_sending").dies());
}

fn peer_killed_at_random_moments() {
    check(
        sc("death", "killed_streaming")
            .dies()
            .extra("random")
            .repeat(20),
    );
}

// ---- programs -----------------------------------------------------------------------------------

fn asyncio_streams_echo() {
    check(sc("apps", "asyncio_echo").rings(10));
}

fn selectors_echo_server_20_clients() {
    check(sc("apps", "selectors_echo").rings(20));
}

// ---- handoffs -----------------------------------------------------------------------------------
// A connection handed to another process or program image the way real servers do it. A new
// image that loads the library adopts the ring connection; one that does not (or a process
// the fd is passed to) gets it after it left its ring for its TCP socket (live path
// switching) — without losing a byte either way.

const ADOPTED: &str = "inherited ring connection adopted after exec";

/// inetd: fork, dup2 onto fds 0 and 1, close the original, exec a handler that forks and execs
/// a `read(0)`/`write(1)` echo; EOF follows the last byte promptly. The images are preloaded:
/// the ring connection is adopted by each.
fn inetd_handler_chain_dup2_exec_exec() {
    check(sc("handoff", "inetd_chain").evidence(ADOPTED));
}

/// The server accepts past the client's decide wait: the connection falls back to TCP at
/// connect and comes to its ring mid-stream (the late ring) — every byte checked in order
/// both ways, EOF exact, `late` counted under switches, both sides promoted.
fn late_ring_after_a_slow_accept() {
    late_ring(sc("late", "slow_accept"), 64 << 20, "cancelled", None);
}

/// The same with the server in domain 0 and the client in domain 1.
fn xdom_late_ring_after_a_slow_accept() {
    let d = Domains::up();
    late_ring(sc("late", "slow_accept"), 64 << 20, "cancelled", Some(&d));
}

/// Sixteen connections, all accepted past the decide wait, each streaming both ways: every
/// one comes to its ring (16 `late` switches), every byte checked.
fn late_ring_for_16_connections_accepted_at_once() {
    late_ring(sc("late", "many").rings(16), 64 << 20, "cancelled", None);
}

/// Single-threaded event loops on non-blocking sockets: the client connects without blocking
/// and watches its socket with edge-triggered epoll from before the decision, the server with
/// poll. Both convert in a data call; the client's epoll item moves to the new connection.
fn late_ring_under_event_loops_epoll_and_poll() {
    late_ring(sc("late", "evloop_epoll"), 64 << 20, "cancelled", None);
}

/// The same with the server on level-triggered epoll (registered while plain: the kernel
/// registration moves into our set) and the client on select.
fn late_ring_under_event_loops_select_and_epoll() {
    late_ring(sc("late", "evloop_select"), 64 << 20, "cancelled", None);
}

/// The server listens before its region exists (its library is dormant); then the region is
/// created and a preloaded client connects: nobody listens there in the region yet, so it
/// falls back (`no_listener`) and is armed; the server joins at that accept, publishes its
/// listener and a decline marker, and the connection comes to its ring mid-stream.
fn late_ring_with_a_server_started_before_its_region() {
    let region = RegionGuard::new("sem", "joined_later", 64 << 20);
    // The scenario's server creates it (after it listens); the guard only names and removes it.
    let _ = memloop::Region::destroy(&memloop::RegionSpec::parse(&region.0));
    let bin: &'static str = Box::leak(memloop_bin().display().to_string().into_boxed_str());
    late_ring_in(
        sc("late", "joined_later").extra(bin),
        &region,
        "no_listener",
        None,
    );
}

/// The 16 late connections while `memloop demote --all` / `promote --all` fire from outside
/// the programs (0-2 ms apart) until they finish: late promotions race demotes and promotions
/// of the connections already on rings. Every byte checked, no doorbell taken for data.
fn late_ring_while_demoted_and_promoted() {
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    let s = sc("late", "many");
    let kernel = run_pair(&s, Mode::Kernel, None, None);
    assert_passed(&s, &kernel, "late/many on kernel TCP (the reference)");
    let region = RegionGuard::new("sem", "lateflip", 64 << 20);
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let flipper = {
        let (stop, region) = (stop.clone(), region.0.clone());
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Relaxed) {
                let verb = ["demote", "promote"][(i % 2) as usize];
                let _ = Command::new(memloop_bin())
                    .args([verb, "--all", "--wait", "0"])
                    .env("MEMLOOP_REGION", &region)
                    .output();
                std::thread::sleep(Duration::from_micros(i * 7919 % 2000));
                i += 1;
            }
            i
        })
    };
    let o = run_pair(&s, Mode::Preload, Some(&region.0), None);
    stop.store(true, Relaxed);
    let flips = flipper.join().unwrap_or(0);
    let what = "late/many under the preload, flipped";
    assert_passed(&s, &o, what);
    assert_no_doorbell_errors(&o);
    let v = status_of(&region.0);
    let problems = doorbell_count_problems(&[&o.server_err, &o.client_err]);
    eprintln!("late flip: {flips} commands, switches {}", v["switches"]);
    assert!(
        problems.is_empty() && v["switches"]["late"].as_u64().unwrap_or(0) >= 1,
        "{}",
        o.report(&format!("{what}: {problems:?}, switches {}", v["switches"]))
    );
}

/// The client fills a small region with ring connections until one falls back, connects (no
/// ring memory: TCP), then closes the fillers: the connection comes to its ring.
fn late_ring_after_the_region_was_full() {
    // 2 MiB: its ring memory runs out (rings shrink with the pressure, to 16 KiB) after
    // about twenty fillers, well before their limit (64) and its 64 channel slots — the
    // server's decline marker for the connection under test needs one.
    let region = RegionGuard::new("sem", "region_full", 2 << 20);
    late_ring_in(sc("late", "region_full"), &region, "region_full", None);
}

/// Issue 14: 10,000 connections open at once between two preloaded processes, in the default
/// region (2 GiB: its ring sizes shrink with pressure, no connection falls back); each echoes
/// its own 64 bytes, then all close. Every one is accepted on a ring, and the region's
/// channels and ring memory are back where they started.
fn ten_thousand_connections_on_rings_then_the_region_back_to_baseline() {
    let s = sc("scale", "ten_thousand").rings(10_000);
    let region = scale_run(s);
    let reg = memloop::Region::open(&memloop::RegionSpec::parse(&region.0)).expect("region");
    let u = reg.registry().usage();
    assert!(
        u.channels == 0 && u.segments_used == 0 && u.conns == 0,
        "the region kept {} channels, {} ring segments, {} records after every close",
        u.channels,
        u.segments_used,
        u.conns
    );
}

/// Issue 14: 1,000 short-lived client processes (forked, 8 at a time, each exits without
/// closing) against one server: every connection on a ring (the member table recycles the
/// dead).
fn a_thousand_short_lived_client_processes_all_on_rings() {
    scale_run(sc("scale", "many_processes").rings(1000));
}

/// The kernel reference, then the preload run in a default-sized region (kept for a look).
fn scale_run(s: Scenario) -> RegionGuard {
    let kernel = run_pair(&s, Mode::Kernel, None, None);
    let reference = format!("scale/{} on kernel TCP (the reference)", s.case);
    assert_passed(&s, &kernel, &reference);
    let region = RegionGuard::new("sem", s.case, 2 << 30);
    let o = run_pair(&s, Mode::Preload, Some(&region.0), None);
    let what = format!("scale/{} under the preload", s.case);
    assert_passed(&s, &o, &what);
    assert_ring_used(&s, &o, &what);
    region
}

/// The slow accept with a client run without the library: the server's connection stays on
/// TCP (it cannot know the client is not preloaded until no late offer comes), no late offer
/// is made, taken or counted as failed, the data is exact.
fn late_ring_not_tried_with_a_plain_client() {
    let s = sc("late", "plain_client");
    let kernel = run_pair(&s, Mode::Kernel, None, None);
    assert_passed(
        &s,
        &kernel,
        "late/plain_client on kernel TCP (the reference)",
    );
    let region = RegionGuard::new("sem", s.case, 64 << 20);
    let o = run_pair(&s, Mode::Preload, Some(&region.0), None);
    assert_passed(&s, &o, "late/plain_client under the preload");
    let status = status_of(&region.0);
    let late = status["switches"]["late"].as_u64().unwrap_or(0);
    let failed = status["late_failed"].as_u64().unwrap_or(0);
    let tried = o.server_err.contains("late ring: server") || o.client_err.contains("late ring");
    assert!(
        late == 0 && failed == 0 && !tried,
        "{}",
        o.report(&format!(
            "a late ring with a plain client: late {late}, failed {failed}"
        ))
    );
    // Nobody announced, no offer, no member client looking: the server knows its client runs
    // without the library and publishes no decline marker (it would hold a channel slot, and
    // arm the connection, for a late offer that cannot come).
    let fallback = |name: &str| status["fallbacks"][name].as_u64().unwrap_or(0);
    assert!(
        fallback("peer_not_preloaded") == 1 && fallback("no_offer") == 0,
        "{}",
        o.report(&format!(
            "the server's fallback for a plain client: peer_not_preloaded {}, no_offer {} \
             (want 1 and 0)",
            fallback("peer_not_preloaded"),
            fallback("no_offer")
        ))
    );
}

/// A connection passed to this process itself and claimed at once, then closed; the next
/// connection takes its channel slot and is passed the same way, claimed only after the first
/// one's claim time (10 s). The first one's hold must not be given back on the slot's new
/// words: before, it pinned the second connection to TCP (no promotion ever) and took one of
/// its holders. Here the second comes back to its ring.
fn a_claimed_hold_is_never_given_back_on_a_reused_channel_slot() {
    std::env::set_var("MEMLOOP_BIN", memloop_bin());
    check(sc("handoff", "slot_reuse").evidence("promoted: back on the ring"));
}

/// A server that forks per connection (postgres): it accepts past the client's decide wait,
/// forks, and closes its copy; the child streams. The child's connection comes to its ring
/// once the parent let go — both processes hold the server's decline marker meanwhile.
fn late_ring_in_the_child_of_a_server_that_forks_per_connection() {
    late_ring(sc("late", "forked_server"), 64 << 20, "cancelled", None);
}

/// The parent keeps its copy open while the child streams: two processes hold the server's
/// side for the whole stream, so the client's late offers are never taken (a conversion in
/// one would leave the other writing where the ring cannot see). The data is exact.
fn late_ring_not_taken_while_a_fork_shares_the_connection() {
    let s = sc("late", "forked_shared");
    let kernel = run_pair(&s, Mode::Kernel, None, None);
    assert_passed(
        &s,
        &kernel,
        "late/forked_shared on kernel TCP (the reference)",
    );
    let region = RegionGuard::new("sem", s.case, 64 << 20);
    let o = run_pair(&s, Mode::Preload, Some(&region.0), None);
    assert_passed(&s, &o, "late/forked_shared under the preload");
    let status = status_of(&region.0);
    let late = status["switches"]["late"].as_u64().unwrap_or(0);
    let offered = o.client_err.contains("late ring offered");
    let converted = o.server_err.contains("late ring: server converted");
    assert!(
        late == 0 && offered && !converted,
        "{}",
        o.report(&format!(
            "a connection shared by a fork: late {late}, offered {offered}, converted {converted}"
        ))
    );
    assert_eq!(
        status["usage"]["channels"].as_u64(),
        Some(0),
        "markers left: {status}"
    );
}

/// The forked handler greets and calls `exit` without closing (the kernel closes its fds,
/// no `close` runs): the server's decline marker, held by the child since the fork, is still
/// freed — the server, which published it, checks while it lives.
fn late_ring_marker_freed_by_a_forked_handler_that_exits_without_close() {
    let bin: &'static str = Box::leak(memloop_bin().display().to_string().into_boxed_str());
    let s = sc("late", "forked_exit").extra(bin);
    let kernel = run_pair(&s, Mode::Kernel, None, None);
    assert_passed(
        &s,
        &kernel,
        "late/forked_exit on kernel TCP (the reference)",
    );
    let region = RegionGuard::new("sem", s.case, 64 << 20);
    let o = run_pair(&s, Mode::Preload, Some(&region.0), None);
    assert_passed(&s, &o, "late/forked_exit under the preload");
    assert!(
        o.server_err
            .contains("forked: the child follows the late ring"),
        "{}",
        o.report("the child did not follow the late ring (nothing was tested)")
    );
}

/// `fallback`: the reason the client's connection fell back for at connect (counted).
fn late_ring(s: Scenario, region_bytes: usize, fallback: &str, doms: Option<&Domains>) {
    let region = RegionGuard::new("sem", s.case, region_bytes);
    late_ring_in(s, &region, fallback, doms);
}

/// [`late_ring`] in `region` (which the scenario may create itself).
fn late_ring_in(s: Scenario, region: &RegionGuard, fallback: &str, doms: Option<&Domains>) {
    let kernel = run_pair(&s, Mode::Kernel, None, doms);
    let reference = format!("late/{} on kernel TCP (the reference)", s.case);
    assert_passed(&s, &kernel, &reference);
    let o = run_pair(&s, Mode::Preload, Some(&region.0), doms);
    let what = format!("late/{} under the preload", s.case);
    assert_passed(&s, &o, &what);
    assert_no_doorbell_errors(&o);
    let status = status_of(&region.0);
    let count = |group: &str, k: &str| status[group][k].as_u64().unwrap_or(0);
    let mut problems = doorbell_count_problems(&[&o.server_err, &o.client_err]);
    let late = count("switches", "late");
    if late < s.rings as u64 {
        problems.push(format!("{late} late rings counted, want {}", s.rings));
    }
    if count("fallbacks", fallback) < 1 {
        problems.push(format!("no fallback {fallback:?} counted at connect"));
    }
    if count("usage", "channels") != 0 {
        problems.push("channels or decline markers left after every process ended".into());
    }
    for (who, log) in [("server", &o.server_err), ("client", &o.client_err)] {
        if !log.contains("promoted: back on the ring") {
            problems.push(format!(
                "the {who}'s log lacks \"promoted: back on the ring\""
            ));
        }
        for bad in ["panicked", "ring error"] {
            if log.contains(bad) {
                problems.push(format!("the {who}'s log says {bad:?}"));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{}",
        o.report(&format!("{what}: {}", problems.join("; ")))
    );
}

/// The switch storm: 1200 checksummed bidirectional streams (random write sizes, up to
/// 512 KiB each way), each switched from its ring to TCP at a random moment by the server or
/// the client passing its fd with SCM_RIGHTS, or by `memloop demote --all` fired every
/// 1–20 ms. Zero bytes lost, duplicated or reordered, exact EOF; the region counts ≥ 1000
/// switches.
fn switch_storm_1200_connections_at_random_moments() {
    storm(None);
}

/// The storm with the server in domain 0 and the client in domain 1.
fn xdom_switch_storm() {
    let d = Domains::up();
    storm(Some(&d));
}

/// The flip storm: 8 long checksummed bidirectional streams (96 MiB each way, random write
/// sizes) demoted and promoted back and forth by `memloop demote|promote --all` fired at
/// random moments (0–2 ms apart) for as long as they run. Zero bytes lost, duplicated or
/// reordered; ≥ 1000 switches counted.
fn switch_flip_8_streams_demoted_and_promoted() {
    flip(None);
}

fn xdom_switch_flip() {
    let d = Domains::up();
    flip(Some(&d));
}

fn flip(doms: Option<&Domains>) {
    std::env::set_var("MEMLOOP_BIN", memloop_bin());
    let s = sc("storm", "flip").extra("8");
    let kernel = run_pair(&s, Mode::Kernel, None, doms);
    assert_passed(&s, &kernel, "flip on kernel TCP (the reference)");
    let region = RegionGuard::new("sem", "flip", 64 << 20);
    let t0 = Instant::now();
    let o = run_pair(&s, Mode::Preload, Some(&region.0), doms);
    assert_passed(&s, &o, "flip under the preload");
    assert_no_doorbell_errors(&o);
    let v = status_of(&region.0);
    let switches = &v["switches"];
    let count = |k: &str| switches[k].as_u64().unwrap_or(0);
    let (demoted, promoted) = (count("operator"), count("promoted"));
    let back = [&o.server_err, &o.client_err]
        .iter()
        .map(|l| l.matches("promoted: back on the ring").count())
        .sum::<usize>();
    eprintln!(
        "flip: {demoted} demotes and {promoted} promotions ({back} sides came back to their \
         rings), {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    assert!(
        demoted + promoted >= 1000 && back >= 100,
        "{}",
        o.report(&format!(
            "too few switches: {demoted} demotes, {promoted} promotions, {back} sides back"
        ))
    );
}

/// One connection between two socat-like sides (one thread each, waiting in `poll` on the
/// server and `select` on the client, then making a blocking read of what is said readable or
/// writing a piece when writable; pieces made only when a wait ran out, so both sides are
/// often idle in their waits), demoted and promoted back and forth by the flipper.
/// Both checksums, exact EOF, promotions counted. (The VM promotion
/// stall: a connection leaving its ring, or on TCP when the peer stopped for a promotion, was
/// said readable for the peer's doorbells on its socket; the blocking read then waited for
/// data the peer — in the same read — never sent. Before the fix this hung every run.)
fn switch_flip_poll_driven_pair_never_reads_a_doorbell_as_readable() {
    flipped_pair("poll_flip");
}

/// [`switch_flip_poll_driven_pair_never_reads_a_doorbell_as_readable`] with level-triggered
/// epoll (the client's set nested in an outer one): a switched connection's registration was
/// the kernel's, which reported the peer's doorbells after its TCP stop as `EPOLLIN`.
fn switch_flip_epoll_driven_pair_never_reads_a_doorbell_as_readable() {
    flipped_pair("epoll_flip");
}

/// Non-blocking event loops on the flipped connection, edge-triggered epoll on the server and
/// one-shot on the client, reading and writing until `EAGAIN`: every wake-up for data or room
/// must come, on whichever path the bytes go (a lost one hangs a side).
fn switch_flip_epoll_edge_triggered_pair_loses_no_wakeup() {
    flipped_pair("epoll_et_flip");
}

/// One connection of `storm.py` `case` flipped by the flipper: checks
/// on kernel TCP, then under the preload, no doorbell errors, ≥ 10 promotions.
fn flipped_pair(case: &'static str) {
    std::env::set_var("MEMLOOP_BIN", memloop_bin());
    let s = sc("storm", case);
    let kernel = run_pair(&s, Mode::Kernel, None, None);
    assert_passed(
        &s,
        &kernel,
        &format!("{case} on kernel TCP (the reference)"),
    );
    let region = RegionGuard::new("sem", case, 64 << 20);
    let o = run_pair(&s, Mode::Preload, Some(&region.0), None);
    assert_passed(&s, &o, &format!("{case} under the preload"));
    assert_no_doorbell_errors(&o);
    let promoted = status_of(&region.0)["switches"]["promoted"]
        .as_u64()
        .unwrap_or(0);
    eprintln!("{case}: {promoted} promotions");
    assert!(
        promoted >= 10,
        "{}",
        o.report(&format!("too few promotions: {promoted}"))
    );
}

/// No byte was taken for a doorbell that was not one (the library reports every such byte,
/// even when the streams' checksums happen to survive it).
fn assert_no_doorbell_errors(o: &Outcome) {
    for log in [&o.server_err, &o.client_err] {
        let bad: Vec<&str> = log
            .lines()
            .filter(|l| {
                l.contains("as doorbells") || l.contains("data received past the peer's TCP stop")
            })
            .take(5)
            .collect();
        assert!(
            bad.is_empty(),
            "{}",
            o.report(&format!("doorbell errors: {bad:#?}"))
        );
    }
}

fn status_of(region: &str) -> serde_json::Value {
    let status = Command::new(memloop_bin())
        .args(["status", "--json", "--region", region])
        .output()
        .expect("memloop status");
    serde_json::from_slice(&status.stdout).expect("status JSON")
}

fn storm(doms: Option<&Domains>) {
    // The client fires `memloop demote` itself; the binary comes from the environment.
    std::env::set_var("MEMLOOP_BIN", memloop_bin());
    let s = sc("storm", "storm").extra("1200");
    let kernel = run_pair(&s, Mode::Kernel, None, doms);
    assert_passed(&s, &kernel, "storm on kernel TCP (the reference)");
    let region = RegionGuard::new("sem", "storm", 64 << 20);
    let t0 = Instant::now();
    let o = run_pair(&s, Mode::Preload, Some(&region.0), doms);
    assert_passed(&s, &o, "storm under the preload");
    assert_no_doorbell_errors(&o);
    let status = Command::new(memloop_bin())
        .args(["status", "--json", "--region", &region.0])
        .output()
        .expect("memloop status");
    let v: serde_json::Value = serde_json::from_slice(&status.stdout).expect("status JSON");
    let switches = &v["switches"];
    let total: u64 = switches
        .as_object()
        .map(|m| m.values().filter_map(|x| x.as_u64()).sum())
        .unwrap_or(0);
    let rings = v["ring_connections"].as_u64().unwrap_or(0);
    eprintln!(
        "storm: {rings} ring connections, {total} switches, by reason {switches}, {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    assert!(
        rings >= 1100,
        "{}",
        o.report("most connections must start on rings")
    );
    assert!(
        total >= 1000,
        "{}",
        o.report(&format!("too few switches: {total}"))
    );
}

/// The same with a handler image run without the library: the connection leaves its ring
/// before the exec.
fn inetd_handler_without_the_library() {
    check(
        sc("handoff", "inetd_chain")
            .extra("plain_handler")
            .switches("exec"),
    );
}

/// The handler images end with `_exit(0)` without closing the connection.
fn inetd_handler_exits_without_close() {
    check(sc("handoff", "inetd_exit_no_close").evidence(ADOPTED));
}

/// The acceptor passes the connection (with bytes in flight) to a preloaded worker with
/// SCM_RIGHTS and closes its copy at once.
fn scm_rights_handoff_to_preloaded_worker() {
    check(sc("handoff", "scm_rights_preloaded").switches("fd_passed"));
}

/// The same with the client's stream paced: the worker adopts the demoted connection, holds it
/// alone once the acceptor's copy is closed, and it comes back to its ring mid-stream.
fn scm_rights_handoff_to_preloaded_worker_comes_back_to_its_ring() {
    check(
        sc("handoff", "scm_rights_back_to_ring")
            .switches("fd_passed")
            .evidence("promoted: back on the ring"),
    );
}

/// A dispatcher that never reads its connection: the client's bytes sent while it is on TCP
/// (`memloop demote`) are still unread when `memloop promote` brings it back to its ring (the
/// dispatcher's side comes back with them in its socket, in front of the client's doorbells),
/// the client writes more on the ring, then the dispatcher passes the fd to a preloaded worker
/// with SCM_RIGHTS. The demote for the handoff carries those bytes through the ring: the
/// worker reads them, the ring bytes and the rest in order, and no doorbell as data.
fn scm_rights_handoff_of_a_promoted_connection_with_unread_bytes() {
    std::env::set_var("MEMLOOP_BIN", memloop_bin());
    check(
        sc("handoff", "unread_tail")
            .switches("fd_passed")
            .evidence("carried the peer's last TCP bytes"),
    );
}

/// The same with the client's ring bytes filling the ring (1 MiB): the unread bytes cannot be
/// carried, so the SCM_RIGHTS message fails with EBUSY (after the bounded wait for the program
/// to read them) instead of passing the fd on its ring; the dispatcher reads them, gives them
/// to the worker itself and passes the fd again, which now leaves its ring as usual.
fn scm_rights_handoff_with_unread_bytes_and_a_full_ring_fails_until_they_are_read() {
    std::env::set_var("MEMLOOP_BIN", memloop_bin());
    check(
        sc("handoff", "unread_tail_no_room")
            .switches("fd_passed")
            .evidence("SCM_RIGHTS refused (EBUSY)"),
    );
}

/// As `unread_tail`, with `memloop demote` asked after the promotion, while the dispatcher
/// waits elsewhere: its side carries the unread bytes from its heartbeat (the peer asked),
/// and the fd then goes on TCP already.
fn demote_of_a_promoted_connection_with_unread_bytes_by_the_operator() {
    std::env::set_var("MEMLOOP_BIN", memloop_bin());
    check(
        sc("handoff", "unread_tail_operator")
            .switches("operator")
            .evidence("carried the peer's last TCP bytes"),
    );
}

/// The sweep race of stop 26 (a switch step on a connection already let go), in one order:
/// the server's heartbeat sweep lists connection A and pauses (`MEMLOOP_TEST_PAUSE`), A is
/// closed on both sides, B takes its channel slot (and, in the server, its fd number) and is
/// demoted by the operator while the server is in none of its calls; then the sweep resumes
/// with A. B must switch once, as asked, and carry 4 MiB each way intact (races.py).
fn a_paused_sweep_holding_a_closed_connection_leaves_its_successor_alone() {
    std::env::set_var("MEMLOOP_BIN", memloop_bin());
    check(
        sc("races", "stale_sweep")
            .rings(2)
            .channels(1)
            .server_env("MEMLOOP_TEST_PAUSE=sweep-listed:500000:1")
            .switches("operator")
            // The pause happened, and B was slot 0's next incarnation (A's successor).
            .evidence("test pause && ChannelId { idx: 0, gen: 1 } side=Server reason=operator"),
    );
}

/// The ring-wait race of stop 26 (a FIN found by a sleeper after its side left the ring), in
/// one order: the server's reader pauses before its socket sleep (`MEMLOOP_TEST_PAUSE`, with
/// doorbell wake-ups), the client shuts down on the ring and the server demotes the connection
/// (SCM_RIGHTS to itself); the reader then finds the client's FIN. It must read EOF and leave
/// the client's side open in the registry (races.py).
fn a_fin_found_after_leaving_the_ring_is_not_the_peer_closing() {
    std::env::set_var("MEMLOOP_BIN", memloop_bin());
    check(
        sc("races", "eof_after_leaving")
            .server_env("MEMLOOP_WAKE=doorbell MEMLOOP_TEST_PAUSE=ring-sleep:1000000:1")
            .switches("fd_passed")
            .evidence("test pause"),
    );
}

/// The same handoff with the fd sent by `sendmmsg` and received by `recvmmsg` (the C
/// library's batch calls): demoted before it goes, adopted and promoted by the worker.
fn scm_rights_by_sendmmsg_and_recvmmsg_comes_back_to_its_ring() {
    check(
        sc("handoff", "scm_rights_mmsg")
            .switches("fd_passed")
            .evidence("promoted: back on the ring"),
    );
}

/// A connection moved to TCP (the server passes it to itself), then the server forks and the
/// child re-execs with it on fd 3: the new image adopts it from its constructor (the old
/// image handed its hold on) and it comes back to its ring mid-stream.
fn exec_adopts_a_switched_connection_and_brings_it_back_to_its_ring() {
    check(
        sc("handoff", "exec_back_to_ring")
            .switches("fd_passed")
            .evidence("promoted: back on the ring"),
    );
}

/// The child execs an image without the library (the connection leaves its ring before),
/// which execs a preloaded one that serves: the connection is pinned to TCP — the plain image
/// could write on it after a promotion's stop — and every byte arrives over TCP.
fn exec_through_an_image_without_the_library_pins_the_connection_to_tcp() {
    check(
        sc("handoff", "exec_through_plain")
            .switches("exec")
            .evidence("pinned to TCP: exec into an image without the library"),
    );
}

/// The same, to a worker run without `LD_PRELOAD`: it must get every byte over plain TCP.
fn scm_rights_handoff_to_plain_worker() {
    check(sc("handoff", "scm_rights_plain_worker").switches("fd_passed"));
}

/// sshd-like: fork, move the connection to fd 3, re-exec, chroot into an empty directory and
/// drop to `nobody`, then serve.
fn reexec_server_chroot_and_setuid() {
    check(sc("handoff", "reexec_privsep").evidence(ADOPTED));
}

/// An urgent byte between two megabyte streams: in-band bytes in order around it, SIOCATMARK
/// at the mark (`flags.py` `oob`, run by `bug_msg_oob_urgent_byte`, covers POLLPRI, select and
/// recv(MSG_OOB) on a tiny stream).
fn msg_oob_mid_stream_leaves_the_ring() {
    check(sc("handoff", "oob").switches("oob"));
}

/// A third (preloaded) process takes the client's ring connection with `pidfd_getfd` (the raw
/// system call, through ctypes) while the client's rx ring holds an echo it has not read:
/// the connection leaves its ring first (switch reason `pidfd`); then client and grabber take
/// turns on it, every chunk's echo checked; the server's sha256 of the whole stream and EOF
/// in both. `memloop promote --all` is asked every 50 ms meanwhile: no promotion may happen
/// while the client, unaware of the grabber, holds it too. (Without the hook the grabber's
/// bytes went on TCP, where the server took them for doorbells: it hung.)
fn pidfd_getfd_of_a_ring_connection_shared_by_owner_and_grabber() {
    std::env::set_var("MEMLOOP_BIN", memloop_bin());
    check(
        sc("handoff", "pidfd_shared")
            .switches("pidfd")
            .evidence(PIDFD_CALLED_OFF),
    );
}

/// The server's log line for a promotion it called off because a process that took the
/// socket with `pidfd_getfd` holds it (the promoter asks every 50 ms).
const PIDFD_CALLED_OFF: &str =
    "promotion called off: a process that took the socket with pidfd_getfd holds it too";

/// The grabber SIGSTOPs the client, then takes its ring connection: it cannot leave its ring,
/// so `pidfd_getfd` fails with `EAGAIN` (after `MEMLOOP_PIDFD_WAIT_US`, 0.3 s here; counted
/// as `pidfd_failed`) instead of handing out a socket whose bytes are in a ring; after
/// SIGCONT a new call succeeds and the shared stream runs as above.
fn pidfd_getfd_of_a_stopped_holder_fails_with_eagain_then_succeeds() {
    std::env::set_var("MEMLOOP_BIN", memloop_bin());
    check(sc("handoff", "pidfd_owner_stopped").switches("pidfd"));
}

/// The same; then the client closes its copy and the grabber, holding the connection alone,
/// carries on (paced): it comes back to its ring mid-stream.
fn pidfd_getfd_grabber_carries_on_alone_and_comes_back_to_the_ring() {
    check(
        sc("handoff", "pidfd_owner_closes")
            .switches("pidfd")
            .evidence("promoted: back on the ring"),
    );
}

/// The same; then the grabber closes its copy and the client carries on alone while
/// `memloop promote --all` is asked every 50 ms: the client never knew of the grabber, so its
/// TCP phase is counted from the kernel's stream positions at the promotion (its own counts
/// miss the grabber's bytes: it would read the server's doorbells as data).
fn pidfd_getfd_owner_carries_on_alone_and_is_promoted_exactly() {
    std::env::set_var("MEMLOOP_BIN", memloop_bin());
    check(
        sc("handoff", "pidfd_grabber_closes")
            .switches("pidfd")
            .evidence("promoted: back on the ring"),
    );
}

// ---- across two domains ---------------------------------------------------------------------------

fn xdom_echo_10mb_sha256_both_ways() {
    check_domains(sc("stream", "echo_10mb"));
}

fn xdom_nonblocking_connect_pollout_so_error() {
    check_domains(sc("nonblock", "nb_connect").rings(3));
}

fn xdom_pollrdhup_and_pollhup_after_shutdowns() {
    check_domains(sc("readiness", "hup_rdhup"));
}

fn xdom_fork_child_serves() {
    check_domains(sc("procs", "fork_child_serves").extra("one_cpu"));
}

fn xdom_exec_keeps_an_inherited_connection() {
    check_domains(
        sc("procs", "exec_inherit").evidence("inherited ring connection adopted after exec"),
    );
}

fn xdom_ipv4_client_on_a_dual_stack_listener() {
    check_domains(sc("names", "names").bind("::").extra("dualstack"));
}

/// What the server's log shows when its UDP socket received by a ring.
const PAIR_TAKEN: &str = "datagram pair taken";

fn udp_echo_sizes_and_sources() {
    check(sc("udp", "echo").evidence(PAIR_TAKEN));
}

fn udp_connected_send_recv_read_write_and_unspec() {
    check(sc("udp", "connected").evidence(PAIR_TAKEN));
}

fn udp_peek_trunc_fionread() {
    check(sc("udp", "peek_trunc").evidence(PAIR_TAKEN));
}

fn udp_dontwait_nonblock_and_rcvtimeo() {
    check(sc("udp", "nowait").evidence(PAIR_TAKEN));
}

fn udp_sendmmsg_recvmmsg_waitforone() {
    check(sc("udp", "mmsg").evidence(PAIR_TAKEN));
}

/// A forked child serves the socket too: it leaves its ring at the fork (counted), and every
/// datagram is answered by one of the processes.
fn udp_socket_shared_by_fork_leaves_its_ring() {
    check(
        sc("udp", "fork")
            .evidence("datagram pair taken && leaves its ring: shared with a forked child"),
    );
}

/// inetd's 'wait' shape: the server forks when its socket is readable and only the child
/// (or the program it execs) reads. The datagrams queued on the ring at the fork are handed
/// back to their sender, which sends them again by the kernel: all arrive, in order.
fn udp_datagrams_queued_at_a_fork_reach_the_child_that_reads() {
    let ev = "datagram pair taken && unread datagrams handed back";
    check(sc("udp", "fork_queued").evidence(ev));
    check(sc("udp", "inetd_exec").evidence(ev));
    check(sc("udp", "inetd_plain").evidence(ev));
    check_domains(sc("udp", "inetd_exec").evidence(ev));
}

/// Receivers asleep in the kernel (no ring peer yet) are woken by a new peer's first datagram
/// (its wake datagram, which they never see).
fn udp_first_datagram_wakes_a_receiver_asleep_in_the_kernel() {
    check(sc("udp", "wake").evidence(PAIR_TAKEN));
    // (Its pair is withdrawn before the receiver takes it: no pair in the server's log.)
    check(sc("udp", "closed_sender"));
}

/// A sender that says "sent" and closes before its receiver took its pair re-sends the
/// pair's datagrams by the kernel; a non-blocking receiver reading meanwhile finds them all.
fn udp_a_closing_senders_datagrams_are_never_missed() {
    check(sc("udp", "withdrawn"));
    check_domains(sc("udp", "withdrawn"));
}

fn udp_sleepers_in_poll_select_recvfrom_are_woken() {
    check(sc("udp", "readiness").evidence(PAIR_TAKEN));
}

fn udp_sendmsg_recvmsg_scatter_gather() {
    check(sc("udp", "vectored").evidence(PAIR_TAKEN));
}

fn udp_eight_peers_on_one_socket() {
    check(sc("udp", "many_peers").evidence(PAIR_TAKEN));
}

fn udp_members_and_a_kernel_only_peer_at_once() {
    check(sc("udp", "mixed").evidence(PAIR_TAKEN));
}

/// `SO_RCVBUF` sizes what a socket's rings queue: a large buffer loses nothing of a burst, a
/// small one keeps a few datagrams, as the kernel does.
fn udp_receive_buffer_sizes_the_queue() {
    check(sc("udp", "rcvbuf").evidence(PAIR_TAKEN));
}

fn udp_flood_never_blocks_and_keeps_order() {
    check(sc("udp", "flood").evidence(PAIR_TAKEN));
}

/// A UDP socket in epoll sets: level- and edge-triggered, asleep when datagrams come, and an
/// asyncio event loop with eight peers.
fn udp_socket_in_epoll_sets() {
    check(sc("udp", "epoll").evidence(PAIR_TAKEN));
    check(sc("udp", "epoll_et_sleepy").evidence(PAIR_TAKEN));
    check(sc("udp", "asyncio").evidence(PAIR_TAKEN));
}

/// Across two domains (the server's bridge address, IPv4 and IPv6): sizes, sources, epoll.
fn xdom_udp_echo_and_epoll_across_domains() {
    check_domains(sc("udp", "echo").evidence(PAIR_TAKEN));
    check_domains(sc("udp", "echo").family(Family::V6).evidence(PAIR_TAKEN));
    check_domains(sc("udp", "epoll_et_sleepy").evidence(PAIR_TAKEN));
}

/// `::1`, and a dual-stack `[::]` server reached at 127.0.0.1 (IPv4-mapped on its side).
fn udp_echo_over_ipv6_loopback_and_dual_stack() {
    check(sc("udp", "echo").host("::1").evidence(PAIR_TAKEN));
    check(
        sc("udp", "echo")
            .bind("::")
            .host("127.0.0.1")
            .evidence(PAIR_TAKEN),
    );
}

/// Across domains over IPv6: each domain's global (ULA) address, and its link-local one
/// (scoped to the client's interface) — both on a ring, every byte checked.
fn xdom_echo_10mb_over_ipv6() {
    check_domains(sc("stream", "echo_10mb").family(Family::V6));
}

fn xdom_echo_10mb_over_ipv6_link_local() {
    check_domains(sc("stream", "echo_10mb").family(Family::LinkLocal));
}

fn xdom_names_over_ipv6() {
    check_domains(sc("names", "names").family(Family::V6));
}

fn xdom_peer_killed_mid_stream() {
    check_domains(sc("death", "killed_streaming").dies());
}

fn xdom_peer_killed_while_idle() {
    check_domains(sc("death", "killed_idle").dies());
}

fn xdom_selectors_echo_server_20_clients() {
    check_domains(sc("apps", "selectors_echo").rings(20));
}

/// Doorbell counts logged when each side of a channel closes ("doorbell counts at close"): a
/// side can never have read more doorbells than its peer sent — live path switching discards
/// exactly `sent - read` of them, so a miscount there would eat data.
fn doorbell_count_problems(logs: &[&str]) -> Vec<String> {
    use std::collections::HashMap;
    let field = |line: &str, key: &str| -> Option<String> {
        let start = line.find(key)? + key.len();
        let rest = &line[start..];
        let end = rest.find(' ').unwrap_or(rest.len());
        Some(rest[..end].to_string())
    };
    // channel → side → (sent, read)
    let mut seen: HashMap<String, HashMap<String, (u64, u64)>> = HashMap::new();
    for line in logs.iter().flat_map(|l| l.lines()) {
        if !line.contains("doorbell counts at close") {
            continue;
        }
        let ch = line.find("ch=").and_then(|i| {
            line[i..]
                .find(" side=")
                .map(|j| line[i + 3..i + j].to_string())
        });
        let (Some(ch), Some(side), Some(sent), Some(read)) = (
            ch,
            field(line, "side="),
            field(line, "sent=").and_then(|v| v.parse().ok()),
            field(line, "read=").and_then(|v| v.parse().ok()),
        ) else {
            continue;
        };
        seen.entry(ch).or_default().insert(side, (sent, read));
    }
    let mut problems = Vec::new();
    for (ch, sides) in &seen {
        if let (Some(c), Some(s)) = (sides.get("Client"), sides.get("Server")) {
            if c.1 > s.0 || s.1 > c.0 {
                problems.push(format!(
                    "channel {ch}: doorbells client sent {} read {}, server sent {} read {}",
                    c.0, c.1, s.0, s.1
                ));
            }
        }
    }
    problems
}

/// The harness's doorbell check (used on every preload run) is not vacuous: it reads the
/// library's log lines, accepts counts that add up and names a side that read more than its
/// peer sent.
fn doorbell_count_check_catches_a_miscount() {
    let line = |side: &str, sent: u64, read: u64| {
        format!(
            "2026-01-01T00:00:00Z DEBUG memloop_preload::conn::share: doorbell counts at close \
             ch=ChannelId {{ idx: 0, gen: 0 }} side={side} sent={sent} read={read}"
        )
    };
    let ok = [line("Server", 4, 99), line("Client", 100, 4)].join("\n");
    assert!(doorbell_count_problems(&[&ok]).is_empty());
    let bad = [line("Server", 4, 101), line("Client", 100, 4)].join("\n");
    let p = doorbell_count_problems(&[&bad]);
    assert!(p.len() == 1 && p[0].contains("client sent 100"), "{p:?}");
}

// ---- switching, slow tier: memloop-pump -----------------------------------------------------------
// One fast checksummed connection (`memloop-pump`, crate `memloop-evtest`: a deterministic
// pseudo-random stream keyed by offset each way, random write and read sizes, every byte
// compared as it is read) while the flipper of `storm.py` demotes and promotes it.

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.replace('_', "").parse().ok())
        .unwrap_or(default)
}

fn pump_bin() -> PathBuf {
    support::artifact(
        "MEMLOOP_PUMP",
        "memloop-pump",
        "cargo build --release -p memloop-evtest",
    )
}

/// `timeout … [preload] memloop-pump ROLE ARGS` (in domain `dom` if given).
fn pump_cmd(
    region: Option<&str>,
    limit: u64,
    doms: Option<(&Domains, u32)>,
    role: &str,
    args: &[String],
) -> Vec<String> {
    let mut v = env_prefix(limit, region);
    v.push(pump_bin().display().to_string());
    v.push(role.into());
    v.extend(args.iter().cloned());
    match doms {
        Some((d, i)) => d.wrap(i, v),
        None => v,
    }
}

/// `storm.py flipper`: `memloop demote --all` and `memloop promote --all` on the region, in
/// turn, 0–2 ms apart, until its stdin closes ([`Flipper::stop`]).
struct Flipper(support::Proc);

impl Flipper {
    fn start(region: &str, log: &std::path::Path) -> Flipper {
        let c = Command::new("python3")
            .arg(scripts().join("storm.py"))
            .arg("flipper")
            .env_remove("LD_PRELOAD")
            .env("MEMLOOP_BIN", memloop_bin())
            .env("MEMLOOP_REGION", region)
            .env("STORM_DEMOTER_LOG", log)
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(fs::File::create(log).expect("flipper log"))
            .spawn()
            .expect("start the flipper");
        Flipper(support::Proc(c))
    }

    fn stop(mut self) {
        drop(self.0 .0.stdin.take()); // its cue to stop
        let st = wait_bounded(&mut self.0, Duration::from_secs(30));
        assert!(st.success(), "the flipper ended with {st}");
    }
}

/// The fields of a pump's `OK pump ROLE k=v …` line.
fn pump_ok(out: &str) -> Option<std::collections::HashMap<String, String>> {
    let line = out.lines().find(|l| l.starts_with("OK pump "))?;
    Some(
        line.split_whitespace()
            .filter_map(|w| w.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    )
}

/// The region is back where it started: after `memloop region reclaim` (the preload does not
/// leave the region when a process exits — a clean exit too stays listed, dead, until some
/// member reclaims it) no member, endpoint, channel, connection record or ring segment is
/// left. Before the reclaim, every member still listed must be dead: nothing of the run is
/// still running. Returns the dead members the reclaim removed.
fn assert_region_at_baseline(region: &str, o: &Outcome, what: &str) -> usize {
    let before = status_of(region);
    let members = before["members"].as_array().cloned().unwrap_or_default();
    let alive: Vec<_> = members.iter().filter(|m| m["alive"] == true).collect();
    assert!(
        alive.is_empty(),
        "{}",
        o.report(&format!(
            "{what}: members still alive after the run: {alive:?}"
        ))
    );
    let out = Command::new(memloop_bin())
        .args(["region", "reclaim", "--region", region])
        .output()
        .expect("memloop region reclaim");
    assert!(
        out.status.success(),
        "memloop region reclaim: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v = status_of(region);
    let mut left = Vec::new();
    for k in ["members", "endpoints", "channels", "connections"] {
        let n = v[k].as_array().map_or(usize::MAX, |a| a.len());
        if n != 0 {
            left.push(format!("{k}: {}", v[k]));
        }
    }
    for k in ["members", "endpoints", "channels", "conns", "segments_used"] {
        if v["usage"][k].as_u64() != Some(0) {
            left.push(format!("usage.{k} = {}", v["usage"][k]));
        }
    }
    assert!(
        left.is_empty(),
        "{}",
        o.report(&format!(
            "{what}: the region is not back at its baseline after the run and a reclaim: {}",
            left.join("; ")
        ))
    );
    members.len()
}

/// A small generator for the random moments (splitmix64).
struct Moments(u64);

impl Moments {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) % n
    }
}

/// How one kill trial went (for the summary line).
#[derive(Default)]
struct KillTrial {
    received: u64,
    read_end: String,
    write_end: String,
    switches: u64,
    reclaimed: usize,
}

/// One trial: a pump pair streaming both ways without end (under the preload: with the
/// flipper at work), the victim SIGKILLed `delay_ms` after both connected. The survivor must
/// end by itself with a correct prefix of the victim's stream, then EOF or ECONNRESET on its
/// reads and EPIPE or ECONNRESET on its writes.
fn kill_trial(region: Option<&str>, kill_server: bool, delay_ms: u64, what: &str) -> KillTrial {
    let scratch = Scratch::new("semantics", "flipkill");
    let dir = &scratch.0;
    let file = |n: &str| dir.join(n).display().to_string();
    let common = |seed: u64, peer: u64, pid: &str| -> Vec<String> {
        [
            "--send",
            "inf",
            "--expect",
            "inf",
            "--peer-may-die",
            "--stall",
            "20",
            "--seed",
            &seed.to_string(),
            "--peer-seed",
            &peer.to_string(),
            "--pid-file",
            pid,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let mut sargs = vec!["--port-file".to_string(), file("port")];
    sargs.extend(common(71, 72, &file("s.pid")));
    let scmd = pump_cmd(region, PROCESS_TIMEOUT, None, "server", &sargs);
    let mut server = spawn(&scmd, &dir.join("s.out"), &dir.join("s.err"));
    let port = wait_for_port(&mut server, &dir.join("port"), Duration::from_secs(20))
        .unwrap_or_else(|| panic!("{what}: the server published no port"));
    let flipper = region.map(|r| Flipper::start(r, &dir.join("flipper.err")));
    let mut cargs = vec!["--port".to_string(), port.to_string()];
    cargs.extend(common(72, 71, &file("c.pid")));
    let ccmd = pump_cmd(region, PROCESS_TIMEOUT, None, "client", &cargs);
    let mut client = spawn(&ccmd, &dir.join("c.out"), &dir.join("c.err"));
    // Both connected (each writes its pid once it has the connection).
    let pid_of =
        |n: &str| -> Option<i32> { fs::read_to_string(dir.join(n)).ok()?.trim().parse().ok() };
    let end = Instant::now() + Duration::from_secs(20);
    while pid_of("s.pid").is_none() || pid_of("c.pid").is_none() {
        assert!(Instant::now() < end, "{what}: the pair never connected");
        std::thread::sleep(Duration::from_millis(5));
    }
    // Under the preload the moment is counted from the first switch: the kill must fall among
    // the flips.
    if let Some(r) = region {
        while switch_count(r) == 0 {
            assert!(
                Instant::now() < end + Duration::from_secs(20),
                "{what}: the connection never switched"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    std::thread::sleep(Duration::from_millis(delay_ms));
    let switches_before = region.map_or(0, switch_count);
    let victim = pid_of(if kill_server { "s.pid" } else { "c.pid" }).expect("victim pid");
    // SAFETY: kill(2) on the pid the victim wrote itself; it cannot have been reused, as the
    // victim is a descendant of ours that nobody has waited for yet.
    let r = unsafe { libc::kill(victim, libc::SIGKILL) };
    assert_eq!(r, 0, "kill {victim}");
    let limit = Duration::from_secs(45);
    let (survivor_st, victim_st) = if kill_server {
        let c = wait_bounded(&mut client, limit);
        (c, wait_bounded(&mut server, Duration::from_secs(10)))
    } else {
        let s = wait_bounded(&mut server, limit);
        (s, wait_bounded(&mut client, Duration::from_secs(10)))
    };
    if let Some(f) = flipper {
        f.stop();
    }
    let read = |n: &str| fs::read_to_string(dir.join(n)).unwrap_or_default();
    let (server_st, client_st) = if kill_server {
        (victim_st, survivor_st)
    } else {
        (survivor_st, victim_st)
    };
    let o = Outcome {
        server: server_st,
        client: client_st,
        server_out: read("s.out"),
        server_err: read("s.err"),
        client_out: read("c.out"),
        client_err: read("c.err"),
    };
    let (survivor, survivor_out) = if kill_server {
        ("client", &o.client_out)
    } else {
        ("server", &o.server_out)
    };
    assert!(
        killed(&victim_st),
        "{}",
        o.report(&format!("{what}: the victim did not die by SIGKILL"))
    );
    let ok = pump_ok(survivor_out).filter(|_| survivor_st.success());
    let Some(ok) = ok else {
        panic!(
            "{}",
            o.report(&format!(
                "{what}: the surviving {survivor} failed ({}; a hang shows as a stall, a timeout \
                 or a kill after 45 s)",
                support::describe(&survivor_st)
            ))
        );
    };
    let (read_end, write_end) = (ok["read_end"].clone(), ok["write_end"].clone());
    assert!(
        ["EOF", "ECONNRESET"].contains(&read_end.as_str())
            && ["EPIPE", "ECONNRESET"].contains(&write_end.as_str()),
        "{}",
        o.report(&format!(
            "{what}: the surviving {survivor}'s reads ended with {read_end}, its writes with \
             {write_end} (want EOF or ECONNRESET, then EPIPE or ECONNRESET)"
        ))
    );
    let mut t = KillTrial {
        received: ok["received"].parse().unwrap_or(0),
        read_end,
        write_end,
        ..KillTrial::default()
    };
    if let Some(r) = region {
        assert_no_doorbell_errors(&o);
        for (who, log) in [("server", &o.server_err), ("client", &o.client_err)] {
            assert!(
                !log.contains("panicked"),
                "{}",
                o.report(&format!("{what}: the {who}'s log says \"panicked\""))
            );
        }
        t.switches = switches_before;
        t.reclaimed = assert_region_at_baseline(r, &o, what);
    }
    t
}

/// Switches the region counted so far: demotes by the operator plus promotions.
fn switch_count(region: &str) -> u64 {
    let v = status_of(region);
    let count = |k: &str| v["switches"][k].as_u64().unwrap_or(0);
    count("operator") + count("promoted")
}

/// The flip storm with deaths: a connection streaming both ways without end is demoted and
/// promoted back and forth by the flipper while one
/// side — the server and the client in turn — is SIGKILLed at a random moment (0–1500 ms
/// after the first switch), `MEMLOOP_FLIP_KILL_TRIALS` times (20; the seed of the moments is
/// `MEMLOOP_FLIP_KILL_SEED`, printed). Each time the survivor ends by itself (its stall watchdog
/// and a 45 s bound catch a hang), everything it received is a correct prefix of the dead side's
/// stream (every byte compared), its reads end with EOF or ECONNRESET and its writes with EPIPE
/// or ECONNRESET; afterwards nothing of the pair is alive and, once the dead are reclaimed, the
/// region is back at its baseline (no member, channel, connection record or segment left).
/// Both kill directions run once on kernel TCP first (the reference). Every trial runs; the
/// failed ones are listed at the end.
fn switch_flip_sigkill_at_random_moments() {
    let trials = env_u64("MEMLOOP_FLIP_KILL_TRIALS", 20);
    let seed = env_u64(
        "MEMLOOP_FLIP_KILL_SEED",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64),
    );
    eprintln!("flip kill: {trials} trials, MEMLOOP_FLIP_KILL_SEED={seed}");
    for kill_server in [true, false] {
        kill_trial(
            None,
            kill_server,
            300,
            &format!("kernel TCP reference, server killed: {kill_server}"),
        );
    }
    let mut moments = Moments(seed);
    let t0 = Instant::now();
    let mut totals = (0u64, 0u64, 0usize);
    let mut ends = std::collections::BTreeMap::<String, usize>::new();
    let mut failed = Vec::new();
    for i in 0..trials {
        let kill_server = i % 2 == 0;
        let delay = moments.below(1500);
        let victim = if kill_server { "server" } else { "client" };
        let what = format!(
            "flip kill trial {} of {trials} ({victim} SIGKILLed {delay} ms after the first \
             switch, seed {seed})",
            i + 1
        );
        // Every trial runs (a failed one is reported at the end, its report printed now).
        let trial = std::panic::catch_unwind(|| {
            let region = RegionGuard::new("sem", "flipkill", 64 << 20);
            kill_trial(Some(&region.0), kill_server, delay, &what)
        });
        let Ok(t) = trial else {
            eprintln!("  trial {:>3}: FAILED ({what})", i + 1);
            failed.push(what);
            continue;
        };
        eprintln!(
            "  trial {:>3}: {victim} killed {delay:>4} ms after the first switch ({:>3} by \
             then); survivor got {:>10} bytes, reads ended {}, writes {}; {} dead reclaimed",
            i + 1,
            t.switches,
            t.received,
            t.read_end,
            t.write_end,
            t.reclaimed
        );
        totals.0 += t.switches;
        totals.1 += t.received;
        totals.2 += t.reclaimed;
        *ends
            .entry(format!("{}/{}", t.read_end, t.write_end))
            .or_default() += 1;
    }
    eprintln!(
        "flip kill: {trials} trials, {} switches before the kills, {} bytes checked, ends \
         {ends:?}, {} dead members reclaimed, {:.1} s",
        totals.0,
        totals.1,
        totals.2,
        t0.elapsed().as_secs_f64()
    );
    assert!(
        failed.is_empty(),
        "{} of {trials} trials failed (their reports are above):\n{}",
        failed.len(),
        failed.join("\n")
    );
}

/// One connection, ≥ 10^10 checksummed bytes (`MEMLOOP_SWITCH_BYTES`, default 10^10) from the
/// client to the server and as many back at the same time (`MEMLOOP_SWITCH_BYTES_BACK`), while
/// the flipper demotes and promotes it for as long as it runs: every byte
/// compared as it is read, exact EOF both ways, no doorbell error; the switches counted are
/// printed with the bytes and the time. Across two domains when they can be made (root and
/// `ip`), else on loopback. A short kernel-TCP run first is the reference.
fn switch_ten_gigabytes_through_one_flipping_connection() {
    let bytes = env_u64("MEMLOOP_SWITCH_BYTES", 10_000_000_000);
    let back = env_u64("MEMLOOP_SWITCH_BYTES_BACK", bytes);
    let doms = needs_domains().is_ok().then(Domains::up);
    let place = if doms.is_some() {
        "across two domains"
    } else {
        "on loopback (no domains here)"
    };
    let reference = pump_pair(None, doms.as_ref(), 100_000_000, 100_000_000, 120);
    assert_pumped(&reference, 100_000_000, 100_000_000, "kernel TCP reference");
    // Generous: hangs are caught by the pumps' stall watchdogs (60 s without progress).
    let limit = 300 + (bytes + back) / 20_000_000;
    let region = RegionGuard::new("sem", "flip10g", 64 << 20);
    let t0 = Instant::now();
    let o = pump_pair(Some(&region.0), doms.as_ref(), bytes, back, limit);
    let secs = t0.elapsed().as_secs_f64();
    let what = format!("{bytes} + {back} bytes through one flipping connection {place}");
    assert_pumped(&o, bytes, back, &what);
    assert_no_doorbell_errors(&o);
    let problems = doorbell_count_problems(&[&o.server_err, &o.client_err]);
    assert!(problems.is_empty(), "{}", o.report(&problems.join("; ")));
    let v = status_of(&region.0);
    let count = |k: &str| v["switches"][k].as_u64().unwrap_or(0);
    let (demoted, promoted) = (count("operator"), count("promoted"));
    let back_on_ring = [&o.server_err, &o.client_err]
        .iter()
        .map(|l| l.matches("promoted: back on the ring").count())
        .sum::<usize>();
    eprintln!(
        "{what}: {demoted} demotes, {promoted} promotions ({back_on_ring} sides back on their \
         rings), {secs:.1} s, {:.0} MB/s both ways together",
        (bytes + back) as f64 / secs / 1e6
    );
    assert!(
        demoted >= 1 && promoted >= 1,
        "{}",
        o.report(&format!(
            "{what}: the connection never flipped ({demoted} demotes, {promoted} promotions)"
        ))
    );
    assert_region_at_baseline(&region.0, &o, &what);
}

/// A pump pair, the client sending `c2s` bytes and the server `s2c`, both at once; under the
/// preload with the flipper at work from before the client connects until it is done.
fn pump_pair(
    region: Option<&str>,
    doms: Option<&Domains>,
    c2s: u64,
    s2c: u64,
    limit: u64,
) -> Outcome {
    let scratch = Scratch::new("semantics", "pump");
    let dir = &scratch.0;
    let port_file = dir.join("port").display().to_string();
    let host = doms.map_or("127.0.0.1".to_string(), |d| d.server.clone());
    let args = |send: u64, expect: u64, seed: u64, peer: u64| -> Vec<String> {
        vec![
            "--send".into(),
            send.to_string(),
            "--expect".into(),
            expect.to_string(),
            "--seed".into(),
            seed.to_string(),
            "--peer-seed".into(),
            peer.to_string(),
            "--progress".into(),
            "1".into(),
        ]
    };
    let mut sargs = vec![
        "--host".to_string(),
        host.clone(),
        "--port-file".into(),
        port_file.clone(),
    ];
    sargs.extend(args(s2c, c2s, 81, 82));
    let scmd = pump_cmd(region, limit, doms.map(|d| (d, 0)), "server", &sargs);
    let mut server = spawn(&scmd, &dir.join("s.out"), &dir.join("s.err"));
    let port = wait_for_port(&mut server, &dir.join("port"), Duration::from_secs(20));
    let flipper = region.map(|r| Flipper::start(r, &dir.join("flipper.err")));
    let client = match port {
        Some(port) => {
            let mut cargs = vec![
                "--host".to_string(),
                host,
                "--port".into(),
                port.to_string(),
            ];
            cargs.extend(args(c2s, s2c, 82, 81));
            let ccmd = pump_cmd(region, limit, doms.map(|d| (d, 1)), "client", &cargs);
            let mut c = spawn(&ccmd, &dir.join("c.out"), &dir.join("c.err"));
            wait_bounded(&mut c, Duration::from_secs(limit + 10))
        }
        None => not_started(),
    };
    let server = wait_bounded(&mut server, Duration::from_secs(30));
    if let Some(f) = flipper {
        f.stop();
    }
    outcome_in(dir, server, client)
}

/// Both pumps said OK with the exact counts (each checked every byte and the EOF itself).
fn assert_pumped(o: &Outcome, c2s: u64, s2c: u64, what: &str) {
    let want = |sent: u64, received: u64| {
        move |ok: std::collections::HashMap<String, String>| {
            ok["sent"] == sent.to_string()
                && ok["received"] == received.to_string()
                && ok["read_end"] == "EOF"
                && ok["write_end"] == "done"
        }
    };
    let server_ok = o.server.success() && pump_ok(&o.server_out).is_some_and(want(s2c, c2s));
    let client_ok = o.client.success() && pump_ok(&o.client_out).is_some_and(want(c2s, s2c));
    assert!(
        server_ok && client_ok,
        "{}",
        o.report(&format!("{what}: the pumps failed"))
    );
}
