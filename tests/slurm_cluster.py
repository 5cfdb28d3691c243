"""A real two-node SLURM cluster for the tests: munged, slurmctld and two slurmd started from a temporary folder.

The two nodes are two slurmd daemons on this machine (`slurmd -N NAME`, each on its own port), so jobs of
`launch.nodes: 2` really run one srun task on each node and torchrun rendezvous across them. Each node offers
this machine's CPUs (2 here, so both nodes together claim the cores twice): CPU launches ask for
`--cpus-per-task=gpus_per_node`, and the one-node jobs of two ranks must still fit one node. Each node
name resolves to this machine (the host's own name and `localhost`; NodeAddr=127.0.0.1), as the batch script's
rendezvous host (the first node of the allocation) must. One-node jobs land on either node.

Why real daemons: the batch scripts we render depend on sbatch parsing #SBATCH lines, signals reaching the
batch shell, `scontrol requeue` and job arrays; stand-ins would only test our assumptions about them. The
daemons are started by PID and stopped by PID (no systemd here, and other engineers share the machine), on
ports picked free at start so a second cluster on the same host does not collide. Where the cluster cannot
start (not root, packages missing) the fixture skips with the reason; it never passes silently, and where
MOE_TRAIN_REQUIRE_SLURM=1 (.ci/run on a machine that can run it) it fails instead of skipping.

Import `slurm_cluster` from a test module (it is a session-scoped pytest fixture).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers import free_port

BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "sinfo", "scancel")
# Set by .ci/run where a cluster can run (root, apt-get): there a skip would hide the tests, so it fails instead.
REQUIRE_ENV = "MOE_TRAIN_REQUIRE_SLURM"
INSTALL_HINT = (
    "apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "
    "slurmctld slurmd slurm-client munge"
)


@dataclass
class SlurmCluster:
    """A running cluster: `env` makes sbatch/squeue/scontrol talk to it."""

    root: Path
    conf: Path
    env: dict[str, str]
    run_dir: Path | None = None
    procs: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *args: str, check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """Run a SLURM client command against this cluster."""
        return subprocess.run(
            list(args), env=kw.pop("env", self.env), capture_output=True, text=True, check=check, timeout=timeout,
            **kw,
        )

    def job_state(self, job_id: str) -> str:
        """The state of a job as scontrol reports it (PENDING, RUNNING, COMPLETED, FAILED, ...)."""
        return self.job_field(job_id, "JobState") or "UNKNOWN"

    def job_field(self, job_id: str, name: str) -> str | None:
        out = self.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
        for item in out.split():
            if item.startswith(name + "="):
                return item.split("=", 1)[1]
        return None

    def wait_state(self, job_id: str, states: set[str], timeout: float = 60) -> str:
        """Poll until the job reaches one of `states`; fails the test with the last state on timeout."""
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in states:
                return state
            time.sleep(0.3)
        pytest.fail(f"job {job_id} did not reach {sorted(states)} within {timeout}s (last state {state})")

    def wait_done(self, job_id: str, timeout: float = 90) -> str:
        return self.wait_state(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"},
                               timeout)

    def stop(self) -> None:
        """Stop the daemons we started, newest first, by PID."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.procs.clear()
        if self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)


def _skip_reason() -> str | None:
    if os.name != "posix" or os.geteuid() != 0:
        return "a real SLURM cluster needs root (slurmd runs jobs as root here)"
    missing = [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        return f"SLURM/munge binaries missing ({', '.join(missing)}); install with: {INSTALL_HINT}"
    if node_names() is None:
        return (f"two SLURM nodes on this machine need two names for it in /etc/hosts: its host name and one of "
                f"{', '.join(SECOND_NODE_NAMES)}")
    return None


def _binary(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


# Names that /etc/hosts often maps to the loopback besides the host's own. `localhost` itself cannot be one: SLURM
# reads a NodeHostname of localhost as this host's name, and two nodes may not share a NodeHostname.
SECOND_NODE_NAMES = ("runsc", "localhost4", "ip6-localhost", "localhost.localdomain")


def _loopback(name: str) -> bool:
    try:
        return socket.gethostbyname(name).startswith("127.")
    except OSError:
        return False


def node_names() -> list[str] | None:
    """Two names that resolve to this machine, sorted as SLURM lists them: the host's own and another of
    SECOND_NODE_NAMES; None when /etc/hosts has no second one."""
    host = socket.gethostname().split(".")[0]
    second = next((name for name in SECOND_NODE_NAMES if name != host and _loopback(name)), None)
    return sorted([host, second]) if second is not None and _loopback(host) else None


def start_cluster(root: Path) -> SlurmCluster:
    """Write slurm.conf under `root`, start munged, slurmctld and one slurmd per node, and wait until both nodes
    are idle."""
    host = socket.gethostname().split(".")[0]
    nodes = node_names()
    # munged wants every folder above its socket world-executable; pytest's tmp folders are 0700.
    run = Path(tempfile.mkdtemp(prefix="moetrain-slurm-run-"))
    state = root / "state"
    spool = root / "spool"
    key_dir = root / "key"
    for d in (state, spool, key_dir):
        d.mkdir(parents=True, exist_ok=True)
    run.chmod(0o755)
    key_dir.chmod(0o700)
    key = key_dir / "munge.key"
    socket_path = run / "munge.socket.2"
    subprocess.run([_binary("mungekey"), "--create", f"--keyfile={key}", "--force"], check=True,
                   capture_output=True)
    ctld_port = free_port()
    node_lines = [f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname={name} Port={free_port()} "
                  f"CPUs={os.cpu_count()} State=UNKNOWN"
                  for name in nodes]
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                "ClusterName=moetrain-test",
                f"SlurmctldHost={host}",
                f"SlurmctldPort={ctld_port}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={socket_path},cred_expire=10",
                f"StateSaveLocation={state}",
                f"SlurmdSpoolDir={spool}/%n",
                f"SlurmctldPidFile={run}/slurmctld.pid",
                f"SlurmdPidFile={run}/slurmd-%n.pid",
                f"SlurmctldLogFile={root}/slurmctld.log",
                f"SlurmdLogFile={root}/slurmd-%n.log",
                "SlurmdParameters=config_overrides",  # the nodes as configured (they share this machine's cores)
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "JobCompType=jobcomp/none",
                "MpiDefault=none",
                "MailProg=/bin/true",
                "SchedulerType=sched/backfill",
                "SchedulerParameters=sched_interval=5,bf_interval=5",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "ReturnToService=2",
                "KillWait=5",
                *node_lines,
                f"PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    env = dict(os.environ, SLURM_CONF=str(conf))
    cluster = SlurmCluster(root=root, conf=conf, env=env, run_dir=run)
    logs = root / "daemons.out"
    out = logs.open("ab")
    try:
        cluster.procs.append(
            subprocess.Popen(
                [_binary("munged"), "-F", f"--key-file={key}", f"--socket={socket_path}",
                 f"--pid-file={run}/munged.pid", f"--log-file={root}/munged.log", f"--seed-file={run}/munge.seed"],
                stdout=out, stderr=out,
            )
        )
        _wait_for(lambda: socket_path.exists(), 10, "munged socket", cluster, root)
        cluster.procs.append(subprocess.Popen([_binary("slurmctld"), "-D", "-f", str(conf)], env=env, stdout=out,
                                              stderr=out))
        for name in nodes:
            (spool / name).mkdir(exist_ok=True)
            cluster.procs.append(subprocess.Popen([_binary("slurmd"), "-D", "-N", name, "-f", str(conf)], env=env,
                                                  stdout=out, stderr=out))

        def idle() -> bool:
            r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True,
                               timeout=10)
            return sorted(r.stdout.split()) == sorted([*nodes, "idle", "idle"])

        _wait_for(idle, 30, "both nodes idle", cluster, root)
    except BaseException:
        cluster.stop()
        raise
    finally:
        out.close()
    return cluster


def _wait_for(predicate, timeout: float, what: str, cluster: SlurmCluster, root: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        dead = [p.args[0] for p in cluster.procs if p.poll() is not None]
        if dead:
            break
        time.sleep(0.2)
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(root.glob("*.log")) + [root /
                                                                                                     "daemons.out"]
        if p.exists()
    )
    raise RuntimeError(f"SLURM test cluster: {what} not reached within {timeout}s\n{logs}")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A running two-node cluster for the whole session, stopped by PID at the end."""
    reason = _skip_reason()
    if reason and os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 (set by .ci/run on a machine that can run SLURM) but {reason}")
    if reason:
        pytest.skip(reason)
    cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()
