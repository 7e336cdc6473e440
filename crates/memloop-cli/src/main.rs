//! `memloop`: manage regions, show what is in them, run programs over rings. `memloop bench …`
//! is forwarded to the `memloop-bench` binary next to this one, so the operator tool does not
//! carry the benchmarks' plotting and progress-bar dependencies.
#![forbid(unsafe_code)]

mod forward;

use clap::{CommandFactory, Parser, Subcommand};
use memloop_cli::{
    blk_cmd, cat, container, domains, init_logging, link_cmd, pipe_cmd, region_cmd, run, status,
    switch_cmd,
};
use std::ffi::OsString;
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "memloop",
    version,
    about = "Shared-memory channels between co-resident processes and VMs"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Create, inspect or destroy a region.
    #[command(subcommand)]
    Region(region_cmd::RegionCmd),
    /// Members, endpoints, channels and counters of a region.
    Status(status::StatusArgs),
    /// Move live ring connections to their TCP sockets, without losing a byte (live path
    /// switching): the processes holding them leave the ring on their next call or heartbeat.
    Demote(switch_cmd::SwitchArgs),
    /// Bring connections that were demoted back onto their rings at an agreed stream position
    /// (a process started with MEMLOOP_PROMOTE=0 keeps them on TCP).
    Promote(switch_cmd::SwitchArgs),
    /// Benchmarks, side by side in one run (`memloop bench --help`; the `memloop-bench` binary).
    #[command(disable_help_flag = true)]
    Bench {
        /// Passed to `memloop-bench` unchanged.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Network-namespace domains on a bridge (the veth+bridge baseline).
    #[command(subcommand)]
    Domains(domains::DomainsCmd),
    /// Run an unmodified program with TCP to co-resident peers over shared memory (LD_PRELOAD).
    Run(run::RunArgs),
    /// Copy stdin into a native memloop stream, or one stream to stdout (netcat for services).
    Cat(cat::CatArgs),
    /// The pipe service (vPipe): transfers between descriptors moved by a service with
    /// splice, sendfile or copy_file_range, shared among tenants by weight.
    #[command(subcommand)]
    Pipe(pipe_cmd::PipeCmd),
    /// A network link over the region (MMNet): a TUN interface in each domain whose wire is
    /// shared memory, for traffic the preload cannot see (static binaries, ICMP, io_uring).
    #[command(subcommand)]
    Link(link_cmd::LinkCmd),
    /// A block device over the region (MMBlk): `export` a file or block device in the
    /// storage domain, `attach` it in a client domain as a loop device on a FUSE file.
    #[command(subcommand)]
    Blk(blk_cmd::BlkCmd),
    /// Containers opted in by an annotation (`io.memloop.region=REGION`): the OCI hook.
    #[command(subcommand)]
    Container(container::ContainerCmd),
    /// Write the man pages and shell completions, generated from this command line's own
    /// definition, under DIR (`man/`, `completions/`): what the package installs.
    #[command(hide = true)]
    GenerateDocs {
        /// Where to write them.
        dir: std::path::PathBuf,
    },
}

fn main() -> ExitCode {
    init_logging();
    // Called as `memloop-runc` (a symlink): an OCI runtime wrapper for engines without hooks.
    let mut argv = std::env::args_os();
    let name = argv.next().unwrap_or_default();
    if std::path::Path::new(&name).file_name() == Some(container::RUNTIME_NAME.as_ref()) {
        let args: Vec<OsString> = argv.collect();
        if let Err(e) = container::runtime(&args) {
            eprintln!("{e}");
        }
        return ExitCode::FAILURE; // (runtime() only returns if the real runtime did not run)
    }
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Region(c) => region_cmd::run(c),
        Cmd::Status(a) => status::run(&a),
        Cmd::Demote(a) => switch_cmd::demote(&a),
        Cmd::Promote(a) => switch_cmd::promote(&a),
        Cmd::Bench { args } => forward::bench(&args),
        Cmd::Domains(c) => domains::run(c),
        Cmd::Run(a) => run::run(&a),
        Cmd::Cat(a) => cat::run(&a),
        Cmd::Container(c) => container::run(c),
        Cmd::Pipe(c) => pipe_cmd::run(c),
        Cmd::Link(c) => link_cmd::run(c),
        Cmd::Blk(c) => blk_cmd::run(c),
        Cmd::GenerateDocs { dir } => generate_docs(&dir),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("memloop: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Man pages (`memloop.1`, one `memloop-SUB.1` per visible command) and completions (bash, zsh,
/// fish) from the clap definition.
fn generate_docs(dir: &std::path::Path) -> memloop_cli::error::CliResult<()> {
    use memloop_cli::error::Context;
    let man = dir.join("man");
    let comp = dir.join("completions");
    for d in [&man, &comp] {
        std::fs::create_dir_all(d).context(format!("creating {}", d.display()))?;
    }
    let cmd = Cli::command();
    let page = |c: clap::Command, file: &str| -> memloop_cli::error::CliResult<()> {
        let mut out = Vec::new();
        clap_mangen::Man::new(c)
            .render(&mut out)
            .context("rendering a man page")?;
        let path = man.join(file);
        std::fs::write(&path, out).context(format!("writing {}", path.display()))
    };
    page(cmd.clone(), "memloop.1")?;
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        // (A one-shot command: the page names live until it exits.)
        let name: &'static str = Box::leak(format!("memloop-{}", sub.get_name()).into_boxed_str());
        page(sub.clone().name(name), &format!("{name}.1"))?;
    }
    use clap_complete::Shell;
    for (shell, file) in [
        (Shell::Bash, "memloop"),
        (Shell::Zsh, "_memloop"),
        (Shell::Fish, "memloop.fish"),
    ] {
        let path = comp.join(file);
        let mut f = std::fs::File::create(&path).context(format!("creating {}", path.display()))?;
        clap_complete::generate(shell, &mut Cli::command(), "memloop", &mut f);
    }
    Ok(())
}
