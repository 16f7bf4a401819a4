"""A real two-node SLURM cluster on this machine runs examples/gpt/slurm/pretrain_gpt.sbatch.

Recipe: Debian's slurm-wlm; three network
namespaces of this test's own (controller, node 1, node 2) joined by a bridge;
``slurmctld`` and one ``slurmd`` per node namespace, started with ``nsenter``;
the node names in /etc/hosts. ``sbatch -N 2`` starts torchrun on each node
(2 ranks each, gloo across the nodes): TP=2 inside a node, DP=2 across them, so
ZeRO's distributed optimizer group spans both nodes. The test checks that the
job completed, the loss fell, the optimizer group spanned the two nodes, and
that the checkpoint loads (merged into a TP=1 model, it reproduces the job's
final validation loss). A second job is pre-empted (SIGUSR1 to its batch shell, as
``--signal=B:USR1`` sends it): its ranks save and exit, and a third job resumes from
that checkpoint. Everything it set up — jobs, daemons, processes in its
namespaces, namespaces, bridge, /etc/hosts lines — is removed afterwards, also
on failure.

Runs only when its prerequisites are present — the SLURM binaries (slurmctld, slurmd,
sbatch, scontrol, sinfo), root, ``ip`` and ``nsenter``, working network namespaces —
and skips with a one-line reason otherwise: a plain ``make test`` installs nothing.
With MPZERO_REQUIRE_SLURM_TEST=1 (CI's ``.ci/run``) it must run: it may then set the
machine up (``apt-get install slurm-wlm`` when missing), and a prerequisite that is
still missing fails the test instead of skipping it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from examples.gpt import checkpointing, data
from examples.gpt.model import GPT, GPTConfig
from examples.gpt.plot_log import read_log
from mpzero.checkpoint import dcp as mdcp

from gpt_test_data import merged_model, verify_all  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
GPT_DIR = REPO / "examples" / "gpt"
SBATCH = GPT_DIR / "slurm" / "pretrain_gpt.sbatch"


HOSTS = Path("/etc/hosts")
HOSTS_LOCK = Path("/run/lock/mpzero-slurm-test-hosts.lock")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
            "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
JOB_ARGS = ["--cpu", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "16",
            "--train-iters", "30", "--lr", "3e-3", "--min-lr", "3e-4",
            "--lr-warmup-iters", "5", "--tensor-model-parallel-size", "2",
            "--log-interval", "1", "--eval-interval", "0", "--eval-iters", "2",
            "--save-interval", "15", "--num-threads", "1", "--no-progress", "--seed", "7"]


SLURM_BINARIES = ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo")
REQUIRED = os.environ.get("MPZERO_REQUIRE_SLURM_TEST") == "1"


def _unavailable(reason: str):
    if REQUIRED:
        pytest.fail(f"two-node SLURM test required (MPZERO_REQUIRE_SLURM_TEST=1): {reason}")
    pytest.skip(reason)


def missing_prerequisite(check_slurm: bool = True) -> str | None:
    """Why this test cannot run here (one line), or None. Changes nothing on the machine."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, slurmd)"
    for tool in ("ip", "nsenter"):
        if not shutil.which(tool):
            return f"needs {tool}"
    if check_slurm:
        absent = [b for b in SLURM_BINARIES if not shutil.which(b)]
        if absent:
            return (f"SLURM not installed ({', '.join(absent)} missing); "
                    "MPZERO_REQUIRE_SLURM_TEST=1 installs it")
    try:
        ok = subprocess.run(["ip", "netns", "list"], capture_output=True,
                            timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return None if ok else "network namespaces unavailable (`ip netns list` failed)"


# Without MPZERO_REQUIRE_SLURM_TEST=1 the test runs only on a machine that already has
# everything; asking for it (CI) lets ensure_slurm() install SLURM.
_MISSING = None if REQUIRED else missing_prerequisite()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(_MISSING is not None, reason=f"two-node SLURM: {_MISSING}")]


def run(cmd: list[str], timeout: float = 60, check: bool = True, **kw):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def ensure_slurm() -> None:
    """Install slurm-wlm when missing; only when the test was asked for (REQUIRED)."""
    if all(shutil.which(b) for b in SLURM_BINARIES):
        return
    if not REQUIRED:
        pytest.skip("SLURM not installed (set MPZERO_REQUIRE_SLURM_TEST=1 to install it)")
    if not shutil.which("apt-get"):
        _unavailable("slurm-wlm is not installed and there is no apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run(["apt-get", "update", "-qq"], timeout=600, env=env)
    run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "slurm-wlm"],
        timeout=900, env=env)


class TwoNodeCluster:
    """Controller + two slurmd nodes, each in a network namespace; ``close()`` undoes all."""

    def __init__(self, workdir: Path) -> None:
        tag = os.getpid() % 10000
        self.tag = f"{tag:04d}"
        self.dir = workdir
        self.subnet = f"10.79.{tag % 250}"
        self.bridge = f"mpzbr{self.tag}"
        self.ns = [f"mpz{self.tag}c", f"mpz{self.tag}n1", f"mpz{self.tag}n2"]
        self.nodes = [f"mpz{self.tag}n1", f"mpz{self.tag}n2"]  # node names = their hosts
        self.addr = [f"{self.subnet}.10", f"{self.subnet}.11", f"{self.subnet}.12"]
        self.marker = f"# mpzero-slurm-test {self.tag}"
        self.conf = self.dir / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.created_ns: list[str] = []
        self.created_links: list[str] = []

    # -------------------------------------------------------------- setup
    def start(self) -> None:
        self._network()
        self._hosts_add()
        self._write_conf()
        self.ctl(["slurmctld", "-c"], timeout=60)
        for ns, node in zip(self.ns[1:], self.nodes):
            self.nsrun(ns, ["slurmd", "-N", node], timeout=60)
        self._wait_idle(90)

    def _network(self) -> None:
        run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self.created_links.append(self.bridge)
        run(["ip", "link", "set", self.bridge, "up"])
        for i, (ns, addr) in enumerate(zip(self.ns, self.addr)):
            run(["ip", "netns", "add", ns])
            self.created_ns.append(ns)
            veth = f"mpzv{self.tag}{i}"
            run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
            self.created_links.append(veth)
            run(["ip", "link", "set", veth, "master", self.bridge, "up"])
            run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0"])
            run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            run(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _hosts_add(self) -> None:
        lines = "".join(f"{a} {n} {self.marker}\n" for a, n in zip(self.addr[1:], self.nodes))
        with self._hosts_locked():
            text = HOSTS.read_text()
            if text and not text.endswith("\n"):
                text += "\n"
            HOSTS.write_text(text + lines)  # in place: /etc/hosts may be a bind mount

    def _write_conf(self) -> None:
        for sub in ("state", "spool" + self.nodes[0], "spool" + self.nodes[1]):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        d = self.dir
        nodes = "\n".join(f"NodeName={n} NodeAddr={a} CPUs=2 RealMemory=4000 State=UNKNOWN"
                          for n, a in zip(self.nodes, self.addr[1:]))
        self.conf.write_text(f"""\
ClusterName=mpz{self.tag}
SlurmctldHost={socket.gethostname().split('.')[0]}({self.addr[0]})
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
SelectType=select/cons_tres
SchedulerType=sched/backfill
ReturnToService=2
SlurmUser=root
SlurmctldPort=6817
SlurmdPort=6818
KillWait=5
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/ctld.log
SlurmdLogFile={d}/slurmd-%n.log
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.time() + timeout
        out = ""
        while time.time() < deadline:
            out = self.ctl(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if all(states.get(n, "").startswith("idle") for n in self.nodes):
                return
            time.sleep(1)
        raise TimeoutError(f"SLURM nodes not idle after {timeout}s: {out!r}\n{self.logs()}")

    # -------------------------------------------------------------- use
    def nsrun(self, ns: str, cmd: list[str], timeout: float = 60, check: bool = True, **kw):
        kw.setdefault("env", self.env)
        return run(["nsenter", f"--net=/run/netns/{ns}", *cmd], timeout=timeout, check=check,
                   **kw)

    def ctl(self, cmd: list[str], timeout: float = 60, check: bool = True, **kw):
        """A command in the controller's namespace (clients talk to slurmctld there)."""
        return self.nsrun(self.ns[0], cmd, timeout=timeout, check=check, **kw)

    def job_info(self, job_id: str) -> dict[str, str]:
        out = self.ctl(["scontrol", "show", "job", "-o", job_id], check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: str, timeout: float) -> dict[str, str]:
        deadline = time.time() + timeout
        info: dict[str, str] = {}
        while time.time() < deadline:
            info = self.job_info(job_id)
            if info.get("JobState") in TERMINAL:
                return info
            time.sleep(2)
        self.ctl(["scancel", job_id], check=False)
        raise TimeoutError(f"job {job_id} did not finish in {timeout}s: {info}\n{self.logs()}")

    def logs(self) -> str:
        parts = []
        for f in sorted(self.dir.glob("*.log")):
            parts.append(f"--- {f.name} ---\n{f.read_text(errors='replace')[-3000:]}")
        return "\n".join(parts)

    # -------------------------------------------------------------- teardown
    def close(self) -> None:
        """Undo everything; every step is attempted even when an earlier one fails."""
        if self.created_ns:
            with contextlib.suppress(Exception):
                self.ctl(["scancel", "--user", "root", "--quiet"], timeout=20, check=False)
        for pidfile in [self.dir / "slurmctld.pid",
                        *(self.dir / f"slurmd-{n}.pid" for n in self.nodes)]:
            with contextlib.suppress(Exception):
                _terminate(int(pidfile.read_text().split()[0]))
        for ns in reversed(self.created_ns):  # job steps and anything else left in there
            with contextlib.suppress(Exception):
                pids = run(["ip", "netns", "pids", ns], timeout=20, check=False).stdout.split()
                for pid in pids:
                    _terminate(int(pid), grace=2)
            with contextlib.suppress(Exception):
                run(["ip", "netns", "del", ns], timeout=20, check=False)
        for link in reversed(self.created_links):
            with contextlib.suppress(Exception):
                run(["ip", "link", "del", link], timeout=20, check=False)
        with contextlib.suppress(Exception):
            self._hosts_remove()

    def _hosts_remove(self) -> None:
        with self._hosts_locked():
            text = HOSTS.read_text()
            kept = [line for line in text.splitlines(keepends=True) if self.marker not in line]
            if len(kept) != len(text.splitlines(keepends=True)):
                HOSTS.write_text("".join(kept))

    @contextlib.contextmanager
    def _hosts_locked(self):
        HOSTS_LOCK.parent.mkdir(parents=True, exist_ok=True)
        with open(HOSTS_LOCK, "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def leftovers(self) -> list[str]:
        """Anything of this cluster still present (should be empty after close())."""
        found = []
        listed = run(["ip", "netns", "list"], check=False).stdout
        found += [ns for ns in self.ns if re.search(rf"^{ns}\b", listed, re.M)]
        links = run(["ip", "-o", "link", "show"], check=False).stdout
        found += [ln for ln in (self.bridge, *(f"mpzv{self.tag}{i}" for i in range(3)))
                  if f" {ln}:" in links or f" {ln}@" in links]
        found += [line for line in HOSTS.read_text().splitlines() if self.marker in line]
        return found


def _terminate(pid: int, grace: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds (a pid this test started)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.time() + grace
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = missing_prerequisite(check_slurm=False)
    if reason:
        _unavailable(reason)
    ensure_slurm()
    c = TwoNodeCluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
        yield c
    finally:
        c.close()
        left = c.leftovers()
        assert not left, f"teardown left behind: {left}"


def _val_loss(model: GPT, data_dir: Path, seq: int, windows: int, micro: int) -> float:
    tokens = data.load_tokens(data_dir, "val")
    starts = data.eval_starts(len(tokens), seq, windows)
    losses = []
    with torch.no_grad():
        for i in range(0, windows, micro):
            x, y = data.get_batch(tokens, starts[i:i + micro], seq)
            losses.append(model(x, y))
    return float(torch.stack(losses).mean())


def test_sbatch_two_nodes_trains_and_checkpoints(cluster):
    work = cluster.dir
    data_dir = work / "data"
    data.prepare(data.CorpusConfig(max_mb=0.5, vocab_size=512), data_dir, quiet=True)
    log, ckpt = work / "train.jsonl", work / "ckpt"
    env = dict(cluster.env, NPROC_PER_NODE="2", GLOO_SOCKET_IFNAME="auto",
               PYTHON=sys.executable, PYTHONPATH=str(REPO), MASTER_PORT="29533")
    sub = cluster.ctl(["sbatch", "-N", "2", "--parsable", "-o", str(work / "job-%j.out"),
                       "--time", "10", str(SBATCH), *JOB_ARGS, "--data-dir", str(data_dir),
                       "--save", str(ckpt), "--log-file", str(log)], env=env, cwd=REPO)
    job_id = sub.stdout.strip().split(";")[0]
    info = cluster.wait_job(job_id, timeout=400)
    out_file = work / f"job-{job_id}.out"
    output = out_file.read_text(errors="replace") if out_file.exists() else "(no output)"
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", (
        f"{info}\n{output[-6000:]}\n{cluster.logs()}")
    assert info.get("NumNodes") == "2", info

    # torchrun ran on both nodes; one gloo world of 4 = TP 2 x DP 2.
    for node in cluster.nodes:
        assert f"({node}): torchrun --node-rank" in output, output[-3000:]
    setup = [r for r in map(json.loads, log.read_text().splitlines())
             if r["kind"] == "setup"][0]
    assert setup["world_size"] == 4 and setup["tensor_model_parallel_size"] == 2
    assert sorted(set(setup["nodes"])) == cluster.nodes
    # ZeRO's distributed group (of rank 0) holds ranks on both nodes.
    assert {setup["nodes"][r] for r in setup["distributed_group_ranks"]} == set(cluster.nodes)

    train, evals = read_log(log)
    losses = [r["loss"] for r in train]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses

    # The checkpoint loads: verified, TP shards merged into a TP=1 model that reproduces
    # the job's final validation loss, and DistributedFusedAdam's format-2 state is there.
    latest = checkpointing.read_latest(ckpt)
    assert latest is not None and latest.name == "iter_0000030"
    manifest = checkpointing.read_manifest(latest)
    assert manifest["world_size"] == 4 and manifest["data"]["global_batch_size"] == 16
    args = manifest["args"]
    cfg = GPTConfig(vocab_size=args["padded_vocab_size"], seq_length=args["seq_length"],
                    num_layers=args["num_layers"], hidden_size=args["hidden_size"],
                    num_attention_heads=args["num_attention_heads"])
    model = GPT(cfg)
    model.load_state_dict(merged_model(latest))
    got = _val_loss(model, data_dir, cfg.seq_length, 2 * 16, 4)
    assert got == pytest.approx(evals[-1]["val_loss"], rel=1e-4)
    # The default format (torch_dist): the optimizer consolidates into a format-2 dict
    # with a state for every model parameter.
    assert manifest["ckpt_format"] == "torch_dist"
    full = mdcp.consolidate(latest / checkpointing.DCP_DIR)
    assert full["optimizer"]["format"] == 2
    param_states = [k for k in full["optimizer"]["state"] if isinstance(k, int)]
    assert len(param_states) == len(full["model"])


def _job_output(work: Path, job_id: str) -> str:
    out_file = work / f"job-{job_id}.out"
    return out_file.read_text(errors="replace") if out_file.exists() else "(no output)"


def _submit(cluster, work: Path, args: list[str], port: str) -> str:
    env = dict(cluster.env, NPROC_PER_NODE="2", GLOO_SOCKET_IFNAME="auto",
               PYTHON=sys.executable, PYTHONPATH=str(REPO), MASTER_PORT=port)
    sub = cluster.ctl(["sbatch", "-N", "2", "--parsable", "-o", str(work / "job-%j.out"),
                       "--time", "10", str(SBATCH), *JOB_ARGS, *args], env=env, cwd=REPO)
    return sub.stdout.strip().split(";")[0]


@pytest.mark.timeout(900)
def test_sbatch_preemption_saves_and_resumes(cluster):
    """SIGUSR1 to the batch shell (what ``#SBATCH --signal=B:USR1@180`` sends before the
    time limit; here ``scancel --batch --signal=USR1``): the script's trap passes it to
    srun, srun to torchrun on both nodes, torchrun to the 4 ranks; they save one
    checkpoint together and exit, nothing is left running on the nodes, and a second job
    resumes from that checkpoint."""
    work = cluster.dir / "preempt"
    work.mkdir()
    data_dir = cluster.dir / "data-preempt"
    data.prepare(data.CorpusConfig(max_mb=0.5, vocab_size=512), data_dir, quiet=True)
    ckpt = work / "ckpt"
    job_id = _submit(cluster, work, ["--train-iters", "100000", "--save-interval", "100000",
                                     "--data-dir", str(data_dir), "--save", str(ckpt)],
                     "29535")
    deadline = time.time() + 300
    while not re.search(r"iter +5/\d+ \|", _job_output(work, job_id)):
        info = cluster.job_info(job_id)
        assert info.get("JobState") not in TERMINAL and time.time() < deadline, (
            f"{info}\n{_job_output(work, job_id)[-6000:]}\n{cluster.logs()}")
        time.sleep(1)
    cluster.ctl(["scancel", "--batch", "--signal=USR1", job_id])
    info = cluster.wait_job(job_id, timeout=300)
    output = _job_output(work, job_id)
    # torchrun exits 1 after forwarding a signal, and the batch script passes srun's status
    # on: 1, or 143 when srun (--kill-on-bad-exit) terminates the other node's torchrun as
    # the first one exits 1. The ranks leave the save together, so it is complete by then.
    assert info.get("JobState") == "FAILED" and info.get("ExitCode") in ("1:0", "143:0"), (
        f"{info}\n{output[-6000:]}")
    assert "SIGUSR1: asking every rank to save and exit" in output, output[-6000:]
    it = int(re.search(r"saved checkpoint iter (\d+) ", output).group(1))
    assert f"exiting at iteration {it} (signal SIGUSR1)" in output, output[-6000:]
    assert checkpointing.read_latest(ckpt).name == f"iter_{it:07d}"
    assert verify_all(ckpt / f"iter_{it:07d}") == []
    # No rank outlived the job on either node.
    for ns in cluster.ns[1:]:
        pids = run(["ip", "netns", "pids", ns], check=False).stdout.split()
        left = [p for p in pids
                if "examples.gpt.train" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
        assert not left, (ns, left)
    # A second job resumes from the pre-emption's checkpoint and completes.
    job_id = _submit(cluster, work, ["--train-iters", str(it + 2), "--data-dir",
                                     str(data_dir), "--save", str(ckpt), "--load", str(ckpt),
                                     # the saved decay length (100000) continues
                                     "--use-checkpoint-opt-param-scheduler"],
                     "29536")
    info = cluster.wait_job(job_id, timeout=300)
    output = _job_output(work, job_id)
    assert info.get("JobState") == "COMPLETED" and info.get("ExitCode") == "0:0", (
        f"{info}\n{output[-6000:]}")
    assert f"loaded checkpoint iter {it} from" in output, output[-6000:]
    assert checkpointing.read_latest(ckpt).name == f"iter_{it + 2:07d}"
