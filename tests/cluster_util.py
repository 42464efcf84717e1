"""The real things launch.sh meets on a cluster, on this machine: a two-node SLURM and an sshd on loopback. For the
launch tests, and by hand: `python -m tests.cluster_util DIR` (from the root) starts the SLURM and prints how to use it.

Debian's slurm-wlm 22.05 (slurmctld, slurmd, the client commands) with munge for authentication. Both nodes,
n1 and n2, are 127.0.0.1: two slurmd processes (`slurmd -N n1`, `slurmd -N n2`) on distinct ports, with `%n`
in their spool, log and pid paths so they do not collide. Everything lives under one directory: slurm.conf, a
munge key and socket of its own (so a munged the machine may already run is left alone), logs, state. The
client commands find the cluster through SLURM_CONF, which `Cluster.env()` sets.

The sshd listens on 127.0.0.2 (another address of this machine: a host launch.sh reaches only through ssh),
with its own host key, config and authorized key under one directory; the client options are `Sshd.opts`.

Installing: when the daemons are missing and we are root with apt-get, `ensure_installed()` installs Debian's
`slurmd slurmctld slurm-client munge` (and openssh for the hostfile tests). Where that cannot happen the tests
that need it skip and say why; under CI (CI=true) they fail instead, because there they must run.
"""
import os
import shutil
import subprocess
import sys
import time

from infra.distributed import free_port

PACKAGES = {"slurmctld": "slurmctld", "slurmd": "slurmd", "sbatch": "slurm-client", "munged": "munge",
            "sshd": "openssh-server", "ssh": "openssh-client"}


def ensure_installed(commands):
    """Install the Debian packages behind `commands` when any is missing. Returns None when all are there, or
    the reason they cannot be had here."""
    missing = [c for c in commands if not shutil.which(c) and not os.path.exists(f"/usr/sbin/{c}")]
    if not missing:
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return f"{', '.join(missing)} not installed, and installing needs root and apt-get"
    pkgs = sorted({PACKAGES[c] for c in missing})
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    r = subprocess.run("apt-get update -q && apt-get install -y -q " + " ".join(pkgs), shell=True, env=env,
                       capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        return f"apt-get install {' '.join(pkgs)} failed: {r.stderr.strip()[-500:]}"
    return None


def _sbin(name):
    return shutil.which(name) or f"/usr/sbin/{name}"


class Cluster:
    """munged + slurmctld + two slurmd (n1, n2) under `root_dir`. `cpus` per node: the nodes share this
    machine's cores; SLURM only counts them."""

    def __init__(self, root_dir, cpus=2, gpus=0, ports=None):
        self.dir = os.path.abspath(root_dir)
        self.cpus, self.gpus = cpus, gpus
        # slurmctld's port and one per slurmd: free ports, so that a SLURM already on this machine is left alone
        self.ports = ports or [free_port(), free_port(), free_port()]
        self.procs = []
        self.reaper = None  # _reap_when_gone's watcher
        self.conf = os.path.join(self.dir, "slurm.conf")

    def env(self, **extra):
        return dict(os.environ, SLURM_CONF=self.conf, **extra)

    def _write_conf(self):
        d = self.dir
        for sub in ("state", "spool", "spool/n1", "spool/n2", "log", "run", "munge"):
            os.makedirs(os.path.join(d, sub), exist_ok=True)
        os.chmod(os.path.join(d, "munge"), 0o700)
        ctl, p1, p2 = self.ports
        # gpus > 0: each node advertises that many GPUs as gres (count only, no device files: nothing here is a
        # GPU), so that launch.sh's GPU requests meet a scheduler that checks them
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        # (slurmd counts a GPU per File; plain files stand for the devices: task/none constrains nothing)
        for i in range(self.gpus):
            open(os.path.join(d, f"gpu{i}"), "a").close()
        with open(os.path.join(d, "gres.conf"), "w") as f:
            f.write(f"NodeName=n[1-2] Name=gpu File={d}/gpu[0-{self.gpus - 1}]\n" if self.gpus else "")
        # cred_expire=10 (AuthInfo): a requeued job may start again 10 s after it ended, not SLURM's default 120
        # proctrack/linuxproc + task/none: no cgroups needed (containers rarely allow them); the tasks of a
        # step are tracked through their parent process ids, which is what scancel relies on here
        conf = f"""\
ClusterName=local
{"GresTypes=gpu" if self.gpus else ""}
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctl}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d}/munge/munge.sock,cred_expire=10
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd.%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
SwitchType=switch/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
MinJobAge=600
SlurmctldDebug=info
SlurmdDebug=info
NodeName=n1 NodeAddr=127.0.0.1 NodeHostname=localhost Port={p1} CPUs={self.cpus} RealMemory=4000{gres} State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 NodeHostname=localhost Port={p2} CPUs={self.cpus} RealMemory=4000{gres} State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""
        with open(self.conf, "w") as f:
            f.write(conf)
        key = os.path.join(d, "munge", "munge.key")
        if not os.path.exists(key):
            with open(key, "wb") as f:
                f.write(os.urandom(1024))
            os.chmod(key, 0o400)

    def start(self, timeout=60):
        self._write_conf()
        d = self.dir
        m = os.path.join(d, "munge")
        subprocess.run([_sbin("munged"), "--force", f"--socket={m}/munge.sock", f"--key-file={m}/munge.key",
                        f"--log-file={m}/munged.log", f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed"],
                       check=True, capture_output=True, text=True, timeout=30)
        env = self.env()
        # -D: in the foreground, as our children, so that stop() ends them whatever happens
        self.procs.append(subprocess.Popen([_sbin("slurmctld"), "-D", "-i", "-f", self.conf], env=env,
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for n in ("n1", "n2"):
            self.procs.append(subprocess.Popen([_sbin("slurmd"), "-D", "-N", n, "-f", self.conf], env=env,
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.time() + timeout
        while time.time() < deadline:
            r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=env, capture_output=True, text=True)
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            if states.get("n1") == "idle" and states.get("n2") == "idle":
                self._reap_when_gone()
                return self
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.5)
        logs = "".join(open(os.path.join(d, "log", f)).read()[-1500:] for f in sorted(os.listdir(os.path.join(d, "log"))))
        self.stop()
        raise RuntimeError(f"the local SLURM did not come up (sinfo: {r.stdout!r} {r.stderr!r}); logs:\n{logs}")

    def _reap_when_gone(self):
        """A pytest killed outright runs no teardown, and its cluster would go on running (and requeueing) its jobs
        for ever, on the cores of whatever runs next. A watcher in a session of its own cancels the jobs and ends
        the daemons once this process is gone; stop() ends the watcher first."""
        m = os.path.join(self.dir, "munge")
        script = (f"while kill -0 {os.getpid()} 2>/dev/null; do sleep 2; done; scancel --full --user=root; sleep 5; "
                  f"kill -9 {' '.join(str(p.pid) for p in self.procs)}; {_sbin('munged')} --stop --socket={m}/munge.sock")
        self.reaper = subprocess.Popen(["sh", "-c", script], env=self.env(), start_new_session=True,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self):
        if self.reaper:
            self.reaper.kill()
            self.reaper.wait()
            self.reaper = None
        env = self.env()
        subprocess.run(["scancel", "--full", "--user=root"], env=env, capture_output=True, timeout=30)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs = []
        m = os.path.join(self.dir, "munge")
        subprocess.run([_sbin("munged"), "--stop", f"--socket={m}/munge.sock"], capture_output=True, timeout=30)

    def job(self, job_id):
        """scontrol's view of a job as a dict (JobState, ExitCode, ...), {} once it is forgotten."""
        r = subprocess.run(["scontrol", "-o", "show", "job", str(job_id)], env=self.env(), capture_output=True,
                           text=True)
        out = {}
        for tok in r.stdout.split():
            if "=" in tok:
                k, v = tok.split("=", 1)
                out.setdefault(k, v)
        return out

    def steps(self):
        """The running job steps as (step id, number of tasks, node list)."""
        r = subprocess.run(["squeue", "-s", "-h", "-o", "%i|%A|%N"], env=self.env(), capture_output=True, text=True)
        return [tuple(line.split("|")) for line in r.stdout.splitlines() if line.strip()]

    def wait_job(self, job_id, timeout=600, poll=None):
        """Wait until the job has ended; calls poll() every half second while it runs. Returns scontrol's dict."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            j = self.job(job_id)
            if j.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", None):
                return j
            if poll:
                poll()
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} still {self.job(job_id).get('JobState')} after {timeout} s")


class Sshd:
    """An OpenSSH server on `addr`:port that lets root in with a key of its own (nothing in ~/.ssh is touched)."""

    def __init__(self, root_dir, addr="127.0.0.2"):
        self.dir, self.addr, self.port = os.path.abspath(root_dir), addr, free_port()
        self.proc = None
        self.log = os.path.join(self.dir, "sshd.log")
        key = os.path.join(self.dir, "id_ed25519")
        # how a client reaches it: launch.sh takes these as SSH_OPTS
        self.opts = (f"-p {self.port} -i {key} -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null "
                     f"-o LogLevel=ERROR")

    def start(self, timeout=30):
        d = self.dir
        os.makedirs(d, exist_ok=True)
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        for name in ("host_ed25519", "id_ed25519"):
            if not os.path.exists(os.path.join(d, name)):
                subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(d, name)], check=True)
        shutil.copy(os.path.join(d, "id_ed25519.pub"), os.path.join(d, "authorized_keys"))
        with open(os.path.join(d, "sshd_config"), "w") as f:
            f.write(f"""Port {self.port}
ListenAddress {self.addr}
HostKey {d}/host_ed25519
PidFile {d}/sshd.pid
AuthorizedKeysFile {d}/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
""")
        self.proc = subprocess.Popen([_sbin("sshd"), "-D", "-e", "-f", os.path.join(d, "sshd_config")],
                                     stdout=subprocess.DEVNULL, stderr=open(self.log, "w"))
        deadline = time.time() + timeout
        while time.time() < deadline:
            r = subprocess.run(["ssh", "-o", "BatchMode=yes", *self.opts.split(), self.addr, "true"],
                               capture_output=True, text=True, timeout=30)
            if r.returncode == 0:
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"sshd on {self.addr}:{self.port} did not let us in: {r.stderr}\n{open(self.log).read()}")

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)


if __name__ == "__main__":
    why = ensure_installed(["slurmctld", "slurmd", "sbatch", "munged"])
    if why:
        sys.exit(why)
    c = Cluster(sys.argv[1] if len(sys.argv) > 1 else "/tmp/slurm_local").start()
    print(f"SLURM is up: export SLURM_CONF={c.conf}; sinfo; Ctrl-C stops it", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        c.stop()
