//! The processes of a data-parallel command: the parent starts one copy of the same
//! command per rank, each told its rank, the world size and where rank 0 listens, then
//! waits for them all and stops them all when one fails.

use std::ffi::OsString;
use std::net::{SocketAddr, TcpListener};
use std::process::{Child, Command, ExitStatus};
use std::time::Duration;

use anyhow::{Context, Result};

/// How often the parent looks at its children.
const POLL: Duration = Duration::from_millis(50);

/// What a process of the run is told: its rank, the world size and rank 0's address
/// (hidden flags of the command it runs).
#[derive(clap::Args, Debug, Clone)]
pub struct RankArgs {
    #[arg(long, hide = true, requires_all = ["dist_world", "dist_rendezvous"])]
    pub dist_rank: Option<usize>,
    #[arg(long, hide = true, requires = "dist_rank")]
    pub dist_world: Option<usize>,
    #[arg(long, hide = true, requires = "dist_rank")]
    pub dist_rendezvous: Option<SocketAddr>,
}

/// This process's place in a run: rank, world size, rank 0's address.
#[derive(Clone, Copy, Debug)]
pub struct Rank {
    pub rank: usize,
    pub world: usize,
    pub rendezvous: SocketAddr,
}

impl RankArgs {
    /// `Some` in a process the launcher started.
    pub fn rank(&self) -> Option<Rank> {
        match (self.dist_rank, self.dist_world, self.dist_rendezvous) {
            (Some(rank), Some(world), Some(rendezvous)) => Some(Rank {
                rank,
                world,
                rendezvous,
            }),
            _ => None,
        }
    }
}

/// A process's device in a run: `device`, moved to GPU `k + rank` where it is `cuda:k`;
/// with `gpus` (one process per GPU) and no GPU named, from `cuda:0`.
pub fn rank_device(
    device: crate::device::DeviceSpec,
    gpus: Option<usize>,
    rank: Option<Rank>,
) -> crate::device::DeviceSpec {
    use crate::device::DeviceSpec;
    let first = match (device, gpus) {
        (DeviceSpec::Cpu, Some(_)) => DeviceSpec::Cuda(0),
        (spec, _) => spec,
    };
    match (first, rank) {
        (DeviceSpec::Cuda(k), Some(r)) => DeviceSpec::Cuda(k + r.rank),
        (spec, _) => spec,
    }
}

/// Runs this command again as `world` processes (the same binary and arguments, plus
/// each one's [`RankArgs`]), meeting on loopback, and waits for them. NVLink multicast
/// stays off in each (`NCCL_NVLS_ENABLE=0`); on the CPU the cores are shared out between
/// them (`RAYON_NUM_THREADS`, unless it is set). Returns when all succeeded; when one
/// fails the others are killed and this process exits with the failed one's code.
pub fn run_ranks(world: usize, on_cpu: bool) -> Result<()> {
    let exe = std::env::current_exe().context("finding the twell binary to start")?;
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    // A port that was free a moment ago: rank 0 listens there.
    let rendezvous = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .context("finding a free loopback port")?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut children = Vec::with_capacity(world);
    for rank in 0..world {
        let mut cmd = Command::new(&exe);
        cmd.args(&args)
            .args(["--dist-rank", &rank.to_string()])
            .args(["--dist-world", &world.to_string()])
            .args(["--dist-rendezvous", &rendezvous.to_string()])
            .env("NCCL_NVLS_ENABLE", "0");
        if on_cpu && std::env::var_os("RAYON_NUM_THREADS").is_none() {
            cmd.env("RAYON_NUM_THREADS", (threads / world).max(1).to_string());
        }
        match cmd.spawn() {
            Ok(child) => children.push(child),
            Err(e) => {
                stop(&mut children);
                return Err(e).with_context(|| format!("starting process {rank} of {world}"));
            }
        }
    }
    if let Some((rank, status)) = supervise(children)? {
        eprintln!("finetune: process {rank} of {world} failed ({status}); stopped the others");
        std::process::exit(exit_code(status));
    }
    Ok(())
}

/// Waits for every child; at the first that fails, kills the others. Returns that one's
/// index and status, or `None` when all succeeded.
pub fn supervise(mut children: Vec<Child>) -> Result<Option<(usize, ExitStatus)>> {
    let mut running: Vec<usize> = (0..children.len()).collect();
    while !running.is_empty() {
        let mut still = Vec::with_capacity(running.len());
        for &k in &running {
            match children[k]
                .try_wait()
                .context("waiting for a process of the run")?
            {
                Some(status) if !status.success() => {
                    stop(&mut children);
                    return Ok(Some((k, status)));
                }
                Some(_) => {}
                None => still.push(k),
            }
        }
        running = still;
        if !running.is_empty() {
            std::thread::sleep(POLL);
        }
    }
    Ok(None)
}

/// Kills and reaps every child that is still running.
fn stop(children: &mut [Child]) {
    for child in children.iter_mut() {
        if let Ok(None) = child.try_wait() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The code to exit with for a child's status: its own, or 128 + the signal that ended
/// it, as a shell reports it.
fn exit_code(status: ExitStatus) -> i32 {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(signal) = status.signal() {
            return 128 + signal;
        }
    }
    status.code().unwrap_or(1)
}

/// `--peer-timeout`'s parser: seconds, positive and finite, as a `Duration` (clap
/// refuses anything else before a process starts).
pub fn parse_peer_timeout(text: &str) -> std::result::Result<Duration, String> {
    match text.parse::<f64>() {
        Ok(secs) if secs > 0.0 && secs.is_finite() => Ok(Duration::from_secs_f64(secs)),
        _ => Err(format!("must be a positive number of seconds, not {text}")),
    }
}

/// This process's communicator in the run: over TCP (rendezvous at rank 0), and on a GPU
/// of a build with `nccl`, then through NCCL (its unique id sent over TCP). Also says,
/// for the first process's report, how the sums travel.
pub fn communicator(
    rank: Rank,
    device: &candle_core::Device,
    timeout: Duration,
) -> Result<(Box<dyn twell_dist::Communicator>, &'static str)> {
    let options = twell_dist::TcpOptions::new(rank.rank, rank.world, rank.rendezvous)
        .with_connect_timeout(timeout)
        .with_timeout(timeout);
    let tcp = twell_dist::TcpCommunicator::connect(&options)?;
    let comm: Box<dyn twell_dist::Communicator> = match device {
        #[cfg(feature = "nccl")]
        candle_core::Device::Cuda(gpu) => {
            let mut tcp = tcp;
            Box::new(twell_dist::NcclCommunicator::new(gpu, &mut tcp)?)
        }
        _ => Box::new(tcp),
    };
    let how = match device.is_cpu() || cfg!(feature = "nccl") {
        true => "",
        false => {
            " (through host memory over TCP: a build with --features nccl reduces on the GPUs)"
        }
    };
    Ok((comm, how))
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::time::Instant;

    fn sh(script: &str) -> Child {
        Command::new("sh").args(["-c", script]).spawn().unwrap()
    }

    #[test]
    fn a_failure_stops_the_others_and_keeps_its_code() {
        let started = Instant::now();
        let children = vec![sh("sleep 30"), sh("sleep 0.2; exit 3"), sh("sleep 30")];
        let (k, status) = supervise(children).unwrap().expect("a failure");
        assert_eq!((k, exit_code(status)), (1, 3));
        assert!(started.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn success_waits_for_every_process() {
        let started = Instant::now();
        let children = vec![sh("exit 0"), sh("sleep 0.3")];
        assert!(supervise(children).unwrap().is_none());
        assert!(started.elapsed() >= Duration::from_millis(300));
        // A process ended by a signal reads as a shell reports it.
        let (_, status) = supervise(vec![sh("kill -9 $$")]).unwrap().unwrap();
        assert_eq!(exit_code(status), 137);
    }
}
