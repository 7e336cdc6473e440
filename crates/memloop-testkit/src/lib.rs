//! A test harness (`harness = false` targets, on libtest-mimic) for tests that cannot run on
//! every machine. A test whose needs are not met here is reported by the runner itself as
//! `ignored (<reason>)` — or, when `CI` is set, fails with the reason: a CI machine that cannot
//! run a test is a broken CI machine. It never counts as passed. Filters, `--ignored`,
//! `--include-ignored`, `--skip`, `--list` and `--exact` work as with the standard harness.
//!
//! ```no_run
//! # fn fast_one() {}
//! # fn needs_root() {}
//! # fn slow_one() {}
//! fn main() -> std::process::ExitCode {
//!     use memloop_testkit::test;
//!     memloop_testkit::run(vec![
//!         test!(fast_one),
//!         test!(needs_root).needs(memloop_testkit::root()),
//!         test!(slow_one).ignore("slow: 10^9 bytes"),
//!     ])
//! }
//! ```
#![forbid(unsafe_code)]

use libtest_mimic::{Arguments, Completion, Failed, Trial};
use std::process::{Command, ExitCode, Stdio};

/// Whether a test can run here: `Err(reason)` if not.
pub type Need = Result<(), String>;

/// Set (non-empty, not `0`) to make [`root`] answer as for an unprivileged user: shows the
/// ignored / CI-failure paths on a machine where everything could run.
pub const PRETEND_UNPRIVILEGED: &str = "MEMLOOP_TEST_PRETEND_UNPRIVILEGED";

/// Whether `CI` is set: a test that cannot run then fails instead of being ignored.
pub fn under_ci() -> bool {
    std::env::var_os("CI").is_some_and(|v| !v.is_empty())
}

/// Root (network namespaces, hugetlbfs mounts, `ip`).
pub fn root() -> Need {
    let pretend = std::env::var(PRETEND_UNPRIVILEGED).is_ok_and(|v| !v.is_empty() && v != "0");
    if pretend || !rustix::process::geteuid().is_root() {
        return Err(if pretend {
            format!("needs root: {PRETEND_UNPRIVILEGED} is set")
        } else {
            "needs root".into()
        });
    }
    Ok(())
}

/// A program that runs: `program args` starts and exits with success.
pub fn tool(program: &str, args: &[&str]) -> Need {
    let ok = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        Ok(())
    } else {
        Err(format!(
            "needs `{program}` (`{program} {}` failed)",
            args.join(" ")
        ))
    }
}

/// The first unmet need of several.
pub fn all(needs: impl IntoIterator<Item = Need>) -> Need {
    needs.into_iter().collect()
}

/// One test: a name, a body that panics on failure, what it needs, and whether it is left out
/// of the default run.
pub struct Test {
    name: String,
    ignored: bool,
    need: Need,
    body: Box<dyn FnOnce() + Send>,
}

/// `test!(f)`: the test named after the function `f`.
#[macro_export]
macro_rules! test {
    ($f:ident) => {
        $crate::Test::new(stringify!($f), $f)
    };
}

impl Test {
    pub fn new(name: impl Into<String>, body: impl FnOnce() + Send + 'static) -> Test {
        Test {
            name: name.into(),
            ignored: false,
            need: Ok(()),
            body: Box::new(body),
        }
    }

    /// Left out of the default run, like `#[ignore = reason]` (the slow tier, a known bug); the
    /// reason is for the reader of the test list.
    pub fn ignore(mut self, _reason: &str) -> Test {
        self.ignored = true;
        self
    }

    /// Adds a need; the first unmet one is the reason reported.
    pub fn needs(mut self, need: Need) -> Test {
        if self.need.is_ok() {
            self.need = need;
        }
        self
    }

    fn into_trial(self, ci: bool) -> Trial {
        let Test {
            name,
            ignored,
            need,
            body,
        } = self;
        let trial = match decide(need, ci) {
            Verdict::Run => Trial::test(name, move || {
                body();
                Ok(())
            }),
            Verdict::Fail(why) => Trial::test(name, move || Err(Failed::from(why))),
            Verdict::Ignore(why) => {
                Trial::ignorable_test(name, move || Ok(Completion::ignored_with(why)))
            }
        };
        trial.with_ignored_flag(ignored)
    }
}

/// What becomes of a test, given what it needs and whether `CI` is set.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Run,
    /// Reported by the runner as `ignored (reason)`.
    Ignore(String),
    /// Reported as a failure with this message.
    Fail(String),
}

fn decide(need: Need, ci: bool) -> Verdict {
    match need {
        Ok(()) => Verdict::Run,
        Err(why) if ci => Verdict::Fail(format!(
            "cannot run here: {why} (CI is set, so this is a failure, not a skip)"
        )),
        Err(why) => Verdict::Ignore(why),
    }
}

/// Runs the tests with the command line's filters and options; the exit code for `main`.
pub fn run(tests: Vec<Test>) -> ExitCode {
    let args = Arguments::from_args();
    let ci = under_ci();
    let trials = tests.into_iter().map(|t| t.into_trial(ci)).collect();
    libtest_mimic::run(&args, trials).exit_code()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unmet_need_is_ignored_with_its_reason_or_fails_under_ci() {
        let need = || Err("needs a unicorn".to_string());
        assert_eq!(
            decide(need(), false),
            Verdict::Ignore("needs a unicorn".into())
        );
        match decide(need(), true) {
            Verdict::Fail(msg) => assert!(msg.contains("needs a unicorn") && msg.contains("CI")),
            other => panic!("{other:?}"),
        }
        assert_eq!(decide(Ok(()), true), Verdict::Run);
        assert_eq!(decide(Ok(()), false), Verdict::Run);
    }

    #[test]
    fn ignore_marks_the_trial_and_keeps_the_need() {
        let t = Test::new("slow", || ())
            .ignore("slow")
            .needs(Err("a".into()));
        assert!(t.ignored);
        assert!(t.into_trial(false).has_ignored_flag());
        let fast = Test::new("fast", || ()).needs(Err("a".into()));
        assert!(!fast.into_trial(true).has_ignored_flag());
    }

    #[test]
    fn the_first_unmet_need_is_the_reason() {
        let need = all([Ok(()), Err("first".into()), Err("second".into())]);
        assert_eq!(need, Err("first".to_string()));
        let t = Test::new("t", || ())
            .needs(Err("a".into()))
            .needs(Err("b".into()));
        assert_eq!(t.need, Err("a".to_string()));
        assert!(tool("/nonexistent/tool", &[]).is_err());
    }
}
