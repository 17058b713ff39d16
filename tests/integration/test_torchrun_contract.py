"""torchrun's contract, whole: its command line, its environment, its recovery for unchanged scripts, a bounded exit.

Every script here is one written for torchrun, run unchanged (none imports
undying), with real processes, real SIGKILLs and a real torchrun to compare with.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from tests.integration.jobs import job_table, manager_url, status, wait_for

REPO = Path(__file__).resolve().parents[2]

# A script that follows torchrun's contract: it records its environment and arguments, meets its
# peers with init_process_group (env://) and, as TORCHELASTIC_USE_AGENT_STORE says, hosts or joins
# a store of its own on MASTER_ADDR:MASTER_PORT.
ENV_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from datetime import timedelta
    import torch, torch.distributed as dist

    rank = int(os.environ["RANK"])
    names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
             "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
             "UNDYING_SEED"]
    seen = {k: v for k, v in os.environ.items() if k in names or k.startswith("TORCHELASTIC_")
            or k.startswith("TORCH_NCCL")}
    dist.init_process_group("gloo")
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    host = os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "False" and rank == 0
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=host, timeout=timedelta(seconds=30))
    store.set(f"hello/{rank}", "x")
    store.wait([f"hello/{r}" for r in range(int(os.environ["WORLD_SIZE"]))])
    out = {"env": seen, "argv": sys.argv[1:], "sum": t.item()}
    with open(os.path.join(sys.argv[sys.argv.index("--out") + 1], f"{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    # A file left open and still referenced at exit (as a library's module-level handle is): its
    # buffered write reaches the disk when the process ends.
    sys.left_open = open(os.path.join(sys.argv[sys.argv.index("--out") + 1], f"{rank}.left-open"), "w")
    sys.left_open.write("written, never closed")
""")


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("OMP_NUM_THREADS", None)  # what each launcher sets of its own
    return env


def _launch(launcher: list[str], flags: list[str], script: Path, script_args: list[str], log: Path,
            cwd: Path, reap: list[int]) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", *launcher, *flags, str(script), *script_args],
                                   stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=cwd,
                                   start_new_session=True)
    reap.append(process.pid)
    return process


def events(db: Path, kind: str) -> list[dict]:  # type: ignore[type-arg]
    """Every event of ``kind`` in a job's log, oldest first, with its generation and rank."""
    con = sqlite3.connect(db)
    try:
        return [{**json.loads(d), "generation": g, "rank": r}
                for g, r, d in con.execute("SELECT generation, rank, data FROM events WHERE kind = ? ORDER BY id",
                                           (kind,))]
    finally:
        con.close()


def _read(folder: Path, ranks: int) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads((folder / f"{r}.json").read_text()) for r in range(ranks)]


def test_a_torchrun_command_line_runs_with_torchruns_environment(tmp_path: Path, reap: list[int]) -> None:
    """`torchrun` replaced by `undying run`, nothing else: same arguments for the script, same variables, same
    meanings; the script's own store works; a fault-free run prints no WARNING line."""
    script = tmp_path / "envdump.py"
    script.write_text(ENV_SCRIPT)
    flags = ["--standalone", "--nproc_per_node=2"]
    # Arguments that repeat the launchers' own options are the script's; so is one that abbreviates
    # them (`--n 3`, which torchrun itself refuses as ambiguous: it gets another word).
    runs = {}
    for name, launcher in (("torchrun", ["torch.distributed.run"]), ("undying", ["undying", "run"])):
        out = tmp_path / name
        out.mkdir()
        script_args = ["--n" if name == "undying" else "--steps", "3", "--nnodes", "5", "-v", "--out", str(out)]
        extra = ["--job-dir", str(tmp_path / "job")] if name == "undying" else []
        log = tmp_path / f"{name}.log"
        process = _launch(launcher, [*extra, *flags], script, script_args, log, tmp_path, reap)
        assert process.wait(timeout=120) == 0, log.read_text()[-3000:]
        runs[name] = (_read(out, 2), log.read_text())
    (torchrun, _), (undying, undying_log) = runs["torchrun"], runs["undying"]
    assert "WARNING" not in undying_log, undying_log
    assert "succeeded" in undying_log
    for rank in range(2):
        ours, theirs = undying[rank], torchrun[rank]
        assert ours["argv"][:-1] == ["--n", "3", "--nnodes", "5", "-v", "--out"]
        assert theirs["argv"][:-1] == ["--steps", "3", "--nnodes", "5", "-v", "--out"]
        assert ours["sum"] == theirs["sum"] == 3.0
        mine, torch_env = ours["env"], theirs["env"]
        # Every variable torchrun sets is set, to the same value where the value is no port, path or id.
        missing = sorted(set(torch_env) - set(mine) - {"UNDYING_SEED"})
        assert not missing, missing
        differ = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "MASTER_ADDR",
                  "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE"}
        same = {k: torch_env[k] for k in torch_env if k not in differ}
        assert {k: mine[k] for k in same} == same
        # The same meanings where the values differ.
        assert mine["MASTER_ADDR"] in ("127.0.0.1", "localhost") and torch_env["MASTER_ADDR"] in ("127.0.0.1", "localhost")
        assert int(mine["MASTER_PORT"]) > 0 and mine["MASTER_PORT"] == undying[0]["env"]["MASTER_PORT"]
        assert mine["TORCHELASTIC_RUN_ID"] == job_table(tmp_path / "job" / "events.db")["job_id"]
        assert mine["TORCHELASTIC_ERROR_FILE"].endswith("error.json") and \
            Path(mine["TORCHELASTIC_ERROR_FILE"]).parent.is_dir()
        assert mine["TORCHELASTIC_MAX_RESTARTS"] == "3"  # (undying's default; torchrun's is 0)
        assert mine["TORCHELASTIC_USE_AGENT_STORE"] == "False"  # the script hosts its own store (it did, above)
        assert mine["UNDYING_SEED"] == "0"
        for name in runs:  # undying's worker skips the interpreter's teardown, not the flush of open files
            assert (tmp_path / name / f"{rank}.left-open").read_text() == "written, never closed", name


def test_a_fault_free_run_of_a_step_api_script_prints_no_warning(tmp_path: Path, reap: list[int]) -> None:
    """The success line and the spares let go at the end are no warnings (the other test: an unchanged script)."""
    from undying.demo import TRAIN_SCRIPT

    process, _, log = _undying(tmp_path, "job", ["--nproc-per-node", "2", "--spares", "1"],
                               TRAIN_SCRIPT, ["--epochs", "1"], reap)
    assert process.wait(timeout=120) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "succeeded" in text and "WARNING" not in text and "whole-group restart" not in text, text[-3000:]


# The DDP tutorial's pattern, unchanged: a Trainer class, a snapshot per epoch, resumed from when it exists.
SNAPSHOT_SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import torch, torch.distributed as dist, torch.nn.functional as F
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    class Trainer:
        def __init__(self, model, loader, optimizer, snapshot_path):
            self.rank = int(os.environ["RANK"])
            self.model, self.loader, self.optimizer = model, loader, optimizer
            self.epochs_run, self.losses, self.snapshot_path = 0, [], snapshot_path
            if os.path.exists(snapshot_path):
                snapshot = torch.load(snapshot_path, weights_only=True)
                self.model.load_state_dict(snapshot["MODEL_STATE"])
                self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
                self.epochs_run, self.losses = snapshot["EPOCHS_RUN"], snapshot["LOSSES"]
            self.model = DDP(self.model)

        def _save_snapshot(self, epoch):
            snapshot = {"MODEL_STATE": self.model.module.state_dict(), "OPTIMIZER_STATE": self.optimizer.state_dict(),
                        "EPOCHS_RUN": epoch + 1, "LOSSES": self.losses}
            torch.save(snapshot, self.snapshot_path + ".tmp")
            os.replace(self.snapshot_path + ".tmp", self.snapshot_path)
            with open(os.path.join(out, "epochs"), "w") as f:
                f.write(str(epoch + 1))

        def train(self, max_epochs):
            for epoch in range(self.epochs_run, max_epochs):
                self.loader.sampler.set_epoch(epoch)
                for x, y in self.loader:
                    loss = F.mse_loss(self.model(x), y)
                    self.optimizer.zero_grad()
                    loss.backward()
                    self.optimizer.step()
                self.losses.append(loss.item())
                if self.rank == 0:
                    self._save_snapshot(epoch)
                time.sleep(0.4)

    out = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    with open(os.path.join(out, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    with open(os.path.join(out, "starts"), "a") as f:
        f.write(f"{rank} {os.environ['TORCHELASTIC_RESTART_COUNT']}\\n")
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    dataset = TensorDataset(x, torch.tanh(x.sum(dim=1, keepdim=True)))
    loader = DataLoader(dataset, batch_size=32, sampler=DistributedSampler(dataset))
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    trainer = Trainer(model, loader, torch.optim.AdamW(model.parameters(), lr=1e-2), os.path.join(out, "snapshot.pt"))
    trainer.train(7)
    if rank == 0:
        with open(os.path.join(out, "losses.json"), "w") as f:
            json.dump(trainer.losses, f)
    dist.destroy_process_group()
""")


def _undying(tmp_path: Path, name: str, flags: list[str], script: Path, script_args: list[str],
             reap: list[int]) -> tuple[subprocess.Popen[bytes], Path, Path]:
    job_dir, log = tmp_path / name, tmp_path / f"{name}.log"
    process = _launch(["undying", "run"], ["--job-dir", str(job_dir), "--spares", "0", "--stop-grace", "3", "--port", "0",
                                            *flags],
                      script, script_args, log, tmp_path, reap)
    return process, job_dir, log


def test_an_unchanged_script_gets_a_whole_group_restart_and_resumes_from_its_snapshot(
        tmp_path: Path, reap: list[int]) -> None:
    """SIGKILL of one rank of a snapshot-per-epoch DDP script: the group restarts at once, every rank resumes
    from the script's snapshot, the job succeeds and its losses are those of the run without the fault."""
    script = tmp_path / "tutorial.py"
    script.write_text(SNAPSHOT_SCRIPT)
    flags = ["--standalone", "--nproc-per-node", "2"]
    clean_out, faulty_out = tmp_path / "clean", tmp_path / "faulty"
    clean_out.mkdir()
    faulty_out.mkdir()
    clean, _, clean_log = _undying(tmp_path, "clean", flags, script, [str(clean_out)], reap)
    faulty, job_dir, log = _undying(tmp_path, "faulty", flags, script, [str(faulty_out)], reap)
    url = manager_url(job_dir)
    assert "whole-group restart: this script does not use undying's step API" in status(url)["recovery_mode"]
    epochs = faulty_out / "epochs"
    wait_for(lambda: epochs.is_file() and int(epochs.read_text() or 0) >= 2, 120, "two epochs and their snapshot")
    victim = int((faulty_out / "pid1").read_text())
    reap.append(victim)
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    assert faulty.wait(timeout=180) == 0, log.read_text()[-3000:]
    assert clean.wait(timeout=180) == 0, clean_log.read_text()[-3000:]
    assert "whole-group restart: this script does not use undying's step API" in log.read_text()  # the banner
    # Restarted at once (no timeout waited out), every rank, TORCHELASTIC_RESTART_COUNT 1.
    (restarted,) = events(job_dir / "events.db", "restarted")
    assert restarted["kind"] == "whole-group"
    (decided,) = events(job_dir / "events.db", "decided")
    assert decided["action"] == "restart" and "whole-group restart 1 of at most 3" in decided["reason"]
    spawned = [e for e in events(job_dir / "events.db", "spawned") if e["generation"] == restarted["generation"]]
    assert sorted(e["rank"] for e in spawned) == [0, 1]
    starts = (faulty_out / "starts").read_text().split("\n")
    assert sorted(s for s in starts if s) == ["0 0", "0 1", "1 0", "1 1"]
    # The losses continue from the snapshot: the same, epoch for epoch, bit for bit, as without the fault.
    losses = json.loads((faulty_out / "losses.json").read_text())
    assert losses == json.loads((clean_out / "losses.json").read_text()) and len(losses) == 7
    assert time.time() - killed < 120
    # The end summary in the script's own terms: wall time, the one restart and its cause; no step,
    # goodput or re-run line, and the launcher's count of recovered incidents is the summary's.
    text = log.read_text()
    head, *rest = text[text.rindex("\nundying: job ") + 1:].splitlines()
    summary = [head, *rest[:next(n for n, line in enumerate(rest) if not line.startswith(" "))]]
    flat = " ".join(line.strip() for line in summary)
    assert "succeeded: wall time" in flat and "whole-group restarts: 1 (at most 3" in flat, summary
    assert "crash of rank 1 (killed by SIGKILL); all 2 ranks started again" in flat, summary
    assert "incidents: 1, 1 recovered" in flat and "succeeded: 1 whole-group restart(s), 1 incident(s) recovered" \
        in text, text[-3000:]
    assert all(len(line) <= 80 for line in summary if str(job_dir) not in line), summary
    for word in ("step 0", "goodput", "re-run"):
        assert word not in flat, (word, summary)


KILLED_SCRIPT = textwrap.dedent("""
    import os, sys, time
    if os.environ["RANK"] == "0":
        sys.exit(0)  # rank 0 finishes at once
    with open(sys.argv[1], "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
""")

RECORD_SCRIPT = textwrap.dedent("""
    import os
    from torch.distributed.elastic.multiprocessing.errors import record

    @record
    def main():
        if os.environ["RANK"] == "1":
            raise ValueError("a bug in rank one")

    main()
""")


def test_a_killed_rank_that_is_not_recovered_is_no_success(tmp_path: Path, reap: list[int]) -> None:
    """--max-restarts 0: rank 0 finished, rank 1 is killed; the job fails, and says which rank and why."""
    script = tmp_path / "killed.py"
    script.write_text(KILLED_SCRIPT)
    pid_file = tmp_path / "pid"
    process, job_dir, log = _undying(tmp_path, "job", ["--nproc-per-node", "2", "--max-restarts", "0"], script,
                                     [str(pid_file)], reap)
    wait_for(lambda: pid_file.is_file() and pid_file.read_text(), 60, "rank 1 to start")
    wait_for(lambda: any(e["rank"] == 0 for e in events(job_dir / "events.db", "exited")), 60, "rank 0 to finish")
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert process.wait(timeout=60) == 1, log.read_text()[-3000:]
    reason = job_table(job_dir / "events.db")["exit_reason"]
    assert "rank 1 exited (killed by SIGKILL)" in reason and "(--max-restarts 0)" in reason, reason
    shown = subprocess.run([sys.executable, "-m", "undying", "status", "--job-dir", str(job_dir)], env=_env(),
                           capture_output=True, text=True, timeout=60, check=False)
    assert "whole-group restart: this script does not use undying's step API" in " ".join(shown.stdout.split()), \
        shown.stdout + shown.stderr


def test_torchruns_error_file_is_read_back_into_the_failure_report(tmp_path: Path, reap: list[int]) -> None:
    """A script whose main is decorated with torchrun's @record: its traceback, by rank, is in the report."""
    script = tmp_path / "record.py"
    script.write_text(RECORD_SCRIPT)
    process, job_dir, log = _undying(tmp_path, "job", ["--nproc-per-node", "2", "--max-restarts", "0"], script, [],
                                     reap)
    assert process.wait(timeout=120) == 1, log.read_text()[-3000:]
    reason = job_table(job_dir / "events.db")["exit_reason"]
    assert "rank 1 exited (exited with code 1: ValueError: a bug in rank one)" in reason, reason
    assert "rank 1:\nTraceback (most recent call last)" in reason and 'raise ValueError("a bug in rank one")' in reason


STUCK_EXIT_SCRIPT = textwrap.dedent("""
    import threading
    # A thread that never ends and is no daemon: the interpreter's exit waits for it forever.
    threading.Thread(target=threading.Event().wait, name="never-ends").start()
    print("training done", flush=True)
""")


def test_a_rank_stuck_in_its_exit_is_ended_after_the_exit_grace_and_the_job_succeeds(
        tmp_path: Path, reap: list[int]) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_EXIT_SCRIPT)
    started = time.monotonic()
    process, job_dir, log = _undying(tmp_path, "job", ["--nproc-per-node", "2", "--exit-grace", "2"], script, [],
                                     reap)
    assert process.wait(timeout=90) == 0, log.read_text()[-3000:]
    took = time.monotonic() - started
    stuck = events(job_dir / "events.db", "exit_stuck")
    assert sorted(e["rank"] for e in stuck) == [0, 1] and all(e["exit_grace_s"] == 2 for e in stuck), stuck
    assert "its script returned, but the process was still in its exit 2s later" in log.read_text()
    assert took < 60, f"{took:.1f}s: the exit grace, never the init timeout"


def test_a_module_with_torchruns_stream_flags(tmp_path: Path, reap: list[int]) -> None:
    """-m runs a module as `python -m`; --redirects 1 sends stdout to the files only, --tee 2 stderr to both;
    --local-ranks-filter 0 keeps rank 1 off the console (its files get everything)."""
    package = tmp_path / "trainpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "main.py").write_text(textwrap.dedent("""
        import os, sys
        rank = os.environ["RANK"]
        print(f"out of rank {rank} args {sys.argv[1:]}", flush=True)
        print(f"err of rank {rank}", file=sys.stderr, flush=True)
    """))
    logs = tmp_path / "logs"
    process, job_dir, log = _undying(tmp_path, "job", ["--nproc-per-node", "2", "--job-id", "mod", "--log-dir",
                                                       str(logs), "-r", "1", "--tee", "2", "--local-ranks-filter", "0",
                                                       "-m"], Path("trainpkg.main"), ["--n", "3"], reap)
    assert process.wait(timeout=120) == 0, log.read_text()[-3000:]
    console = log.read_text()
    for rank in (0, 1):
        folder = logs / "mod" / "attempt_0" / str(rank)
        assert (folder / "stdout.log").read_text() == f"out of rank {rank} args ['--n', '3']\n"
        assert (folder / "stderr.log").read_text() == f"err of rank {rank}\n"
    assert "err of rank 0" in console  # teed, and rank 0 is on the console
    assert "out of rank" not in console and "err of rank 1" not in console, console
    assert "whole-group restart" in console  # (the module does not import undying)


def test_no_python_runs_a_program_with_torchruns_environment(tmp_path: Path, reap: list[int]) -> None:
    program = tmp_path / "train.sh"
    program.write_text('#!/bin/sh\necho "rank $RANK of $WORLD_SIZE role $ROLE_NAME args $*" > "$1/$RANK"\n')
    program.chmod(0o755)
    process, job_dir, log = _undying(tmp_path, "job", ["--nproc-per-node", "2", "--no-python", "--role", "trainer"],
                                     program, [str(tmp_path)], reap)
    assert process.wait(timeout=120) == 0, log.read_text()[-3000:]
    for rank in (0, 1):
        assert (tmp_path / str(rank)).read_text() == f"rank {rank} of 2 role trainer args {tmp_path}\n"
