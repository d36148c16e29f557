"""A real single-node Slurm cluster for the tests: munged, slurmctld and slurmd started on this host from a
configuration in a temporary folder, stopped by their process ids afterwards. CI installs the Debian packages
(`.ci/run`); where the daemons cannot be started, the tests that need them are skipped with the reason."""

import os
import shutil
import socket
import subprocess
import time

import pytest

CONF = """\
ClusterName=tests
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={dir}/munge.socket
CredType=cred/munge
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
KillWait=10
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=tests Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def why_not() -> str:
    """Why a Slurm cluster cannot be started here, or '' when it can."""
    missing = [
        b
        for b in ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")
        if not shutil.which(b)
    ]
    if missing:
        return (
            f"Slurm is not installed here ({', '.join(missing)} missing; .ci/run installs Debian's slurmctld, "
            "slurmd, slurm-client and munge)"
        )
    if os.geteuid() != 0:
        return "starting slurmd needs root"
    return ""


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """Start the daemons; yield the environment (SLURM_CONF) under which sbatch, squeue and scontrol reach them."""
    reason = why_not()
    if reason:
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("slurm")
    os.chmod(folder, 0o700)
    for sub in ("state", "spool"):
        (folder / sub).mkdir()
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    conf = folder / "slurm.conf"
    host = socket.gethostname().split(".")[0]
    conf.write_text(CONF.format(host=host, dir=folder, ctld_port=free_port(), d_port=free_port(), cpus=os.cpu_count()))
    env = dict(os.environ, SLURM_CONF=str(conf))
    logs = open(folder / "daemons.log", "w")
    daemons = []
    try:
        munge = [
            f"--socket={folder}/munge.socket",
            f"--key-file={key}",
            f"--log-file={folder}/munged.log",
            f"--pid-file={folder}/munged.pid",
            f"--seed-file={folder}/munged.seed",
        ]
        for cmd in (
            ["munged", "--foreground", "--force", *munge],
            ["slurmctld", "-D", "-f", str(conf)],
            ["slurmd", "-D", "-f", str(conf)],
        ):
            daemons.append(subprocess.Popen(cmd, env=env, stdout=logs, stderr=subprocess.STDOUT))
            time.sleep(0.5)
        deadline = time.time() + 60
        while True:
            sinfo = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True)
            if sinfo.stdout.strip() in ("idle", "mix", "alloc"):
                break
            if time.time() > deadline or any(d.poll() is not None for d in daemons):
                pytest.skip(
                    f"the Slurm daemons did not come up: {sinfo.stdout}{sinfo.stderr}"
                    f"{(folder / 'daemons.log').read_text()[-1000:]}"
                )
            time.sleep(0.5)
        yield env
    finally:
        for d in reversed(daemons):
            d.terminate()
        for d in reversed(daemons):
            try:
                d.wait(timeout=30)
            except subprocess.TimeoutExpired:
                d.kill()
        logs.close()


def wait_for_jobs(env: dict, job_id: str, timeout: float = 600) -> None:
    """Wait until no task of the job is pending or running."""
    deadline = time.time() + timeout
    while subprocess.run(["squeue", "-h", "-j", job_id], env=env, capture_output=True, text=True).stdout.strip():
        assert time.time() < deadline, f"job {job_id} still in the queue after {timeout} s"
        time.sleep(1)
