"""Slurm's environment, read once: where this node sits in the job, so `srun undying run` needs
no other flag.

Inside an ``srun`` step with one task per node, Slurm tells each task everything a
multi-node job needs: how many nodes (``SLURM_STEP_NUM_NODES``), which one this is
(``SLURM_NODEID``), the nodes in order (``SLURM_STEP_NODELIST``: its first node also runs the
manager), the job's id (``SLURM_JOB_ID``, the same across requeues, so a requeued job resumes
its own job dir) and where the job was submitted from (``SLURM_SUBMIT_DIR``, on the filesystem
the nodes share on almost every cluster: the job dir's default parent).

Only a step is detected. In a batch script's own shell or an ``salloc`` shell
(``SLURM_JOB_ID`` set, no ``SLURM_STEP_ID``) there is one process for the whole allocation,
and under ``srun --ntasks-per-node`` > 1 there are several undying launchers on one node:
both are refused in one line that says what to write, unless the user chose the layout with
flags (``--standalone``, ``--manager``, ``--rdzv-endpoint``). Outside Slurm nothing is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from undying.config.manager import DEFAULT_MANAGER_PORT
from undying.errors import UsageError
from undying.inputs import check_job_id

__all__ = ["SlurmStep", "expand_hostlist", "read_slurm", "manager_port", "slurm_facts",
           "MAX_NODES"]

MAX_NODES = 65_536  # more names than this in one node list is a malformed variable, not a job
_MAX_TEXT = 1 << 20
# A job's manager port: each job of a node its own (two jobs may share a node), below Linux's
# ephemeral range (32768 and up), three ports each (join, control store, HTTP).
PORT_SLOTS = 500
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


@dataclass(frozen=True)
class SlurmStep:
    """This task's place in an ``srun`` step: the job, its nodes, this node's rank."""

    job_id: str  # Slurm's number, as text
    nodes: tuple[str, ...]  # the step's nodes in Slurm's order; nodes[0] hosts the manager
    node_rank: int  # SLURM_NODEID: this node's index in ``nodes``
    submit_dir: str
    restart_count: int  # SLURM_RESTART_COUNT: how many times Slurm requeued the job

    @property
    def nnodes(self) -> int:
        return len(self.nodes)

    @property
    def undying_job_id(self) -> str:
        """The undying job id: ``slurm-<Slurm's job id>``, stable across requeues."""
        return check_job_id(f"slurm-{self.job_id}", "SLURM_JOB_ID")

    @property
    def job_dir(self) -> str:
        """The default job dir: ``<submit dir>/undying-jobs/slurm-<id>``, where every node sees
        it."""
        return f"{self.submit_dir.rstrip('/') or '/'}/undying-jobs/{self.undying_job_id}"


def manager_port(job_id: str) -> int:
    """The manager's default port for Slurm job ``job_id``: 29400 + 3 x (id mod 500)."""
    return DEFAULT_MANAGER_PORT + 3 * (int(job_id) % PORT_SLOTS)


def _brackets(text: str) -> Iterator[str]:
    """Every name one hostlist item (``a[1-2]b[03,05]``) stands for, in order."""
    open_at = text.find("[")
    if open_at < 0:
        if "]" in text:
            raise ValueError(f"a ']' without '[' in {text!r}")
        yield text
        return
    close_at = text.find("]", open_at)
    if close_at < 0:
        raise ValueError(f"a '[' without ']' in {text!r}")
    prefix, ranges, rest = text[:open_at], text[open_at + 1:close_at], text[close_at + 1:]
    tails = list(_brackets(rest))
    for part in ranges.split(","):
        match = _RANGE.fullmatch(part.strip())
        if match is None:
            raise ValueError(f"{part!r} in {text!r} is not a number or a range N-M")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f"range {part!r} in {text!r} runs backwards")
        if int(high) - int(low) >= MAX_NODES:
            raise ValueError(f"range {part!r} in {text!r} names over {MAX_NODES} nodes")
        for n in range(int(low), int(high) + 1):
            for tail in tails:
                yield f"{prefix}{n:0{len(low)}d}{tail}"


def _items(text: str) -> Iterator[str]:
    """The comma-separated items of a hostlist; commas inside brackets do not separate."""
    depth, start = 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        elif char == "," and depth == 0:
            yield text[start:i]
            start = i + 1
    yield text[start:]


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compact node list (``n[0-3],gpu[01-02]``) as names in order; ValueError if bad."""
    if len(text) > _MAX_TEXT:
        raise ValueError(f"a node list of {len(text)} characters")
    names: list[str] = []
    for item in _items(text.strip()):
        if not item:
            raise ValueError(f"an empty name in {text!r:.80}")
        for name in _brackets(item):
            names.append(name)
            if len(names) > MAX_NODES:
                raise ValueError(f"{text!r:.80} names over {MAX_NODES} nodes")
    return names


def _tasks_per_node(text: str) -> list[int]:
    """``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``) as one count per node."""
    counts: list[int] = []
    for part in text.split(","):
        match = _TASKS.fullmatch(part.strip())
        if match is None:
            raise ValueError(f"{part!r}")
        counts += [int(match.group(1))] * min(int(match.group(2) or 1), MAX_NODES)
    return counts


def slurm_facts(environ: Mapping[str, str]) -> dict[str, int | str] | None:
    """The Slurm job a process runs in and how many times Slurm requeued it
    (``SLURM_RESTART_COUNT``), for the job's log and status; None outside Slurm."""
    job_id = (environ.get("SLURM_JOB_ID") or "").strip()
    if not job_id.isdigit() or len(job_id) > 12:
        return None
    restarts = (environ.get("SLURM_RESTART_COUNT") or "0").strip()
    return {"job_id": job_id,
            "restarts": int(restarts) if restarts.isdigit() and len(restarts) < 10 else 0}


def _variable(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name)
    if value is None or not value.strip():
        raise UsageError(f"Slurm set no {name} in this step (found SLURM_JOB_ID and "
                         "SLURM_STEP_ID): run `undying run` under srun, or pass --standalone or "
                         "--manager to choose the layout yourself")
    return value.strip()


def _number(environ: Mapping[str, str], name: str) -> int:
    text = _variable(environ, name)
    if not text.isdigit() or len(text) > 12:
        raise UsageError(f"{name}={text!r:.40} from Slurm is not a number; is the environment "
                         "a Slurm step's?")
    return int(text)


def read_slurm(environ: Mapping[str, str]) -> SlurmStep | None:
    """This task's :class:`SlurmStep`, None outside Slurm; UsageError where undying cannot run
    as is.

    Refused: a Slurm job's shell outside a step (a batch script, ``salloc``), and a
    step with more than one task on a node (several launchers would start the same ranks).
    """
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    _number(environ, "SLURM_JOB_ID")
    if not environ.get("SLURM_STEP_ID"):
        raise UsageError(
            f"undying run is in Slurm job {job_id} but not in an srun step (a batch script or "
            "salloc shell): write `srun --ntasks-per-node=1 undying run ...` to run one launcher "
            "per node, or pass --standalone to run on this node alone")
    tasks_text = _variable(environ, "SLURM_STEP_TASKS_PER_NODE")
    try:
        tasks = _tasks_per_node(tasks_text)
    except ValueError as e:
        raise UsageError(f"SLURM_STEP_TASKS_PER_NODE={tasks_text!r:.60} from Slurm: cannot read "
                         f"{e}") from None
    if any(n != 1 for n in tasks):
        raise UsageError(
            f"srun started {max(tasks)} tasks on a node (SLURM_STEP_TASKS_PER_NODE={tasks_text}): "
            "undying starts the ranks itself; write `srun --ntasks-per-node=1 undying run "
            "-n RANKS_PER_NODE ...`")
    nodelist = _variable(environ, "SLURM_STEP_NODELIST")
    try:
        nodes = tuple(expand_hostlist(nodelist))
    except ValueError as e:
        raise UsageError(f"SLURM_STEP_NODELIST={nodelist!r:.60} from Slurm: {e}") from None
    node_rank = _number(environ, "SLURM_NODEID")
    if len(nodes) != len(tasks) or len(set(nodes)) != len(nodes) or node_rank >= len(nodes):
        raise UsageError(f"Slurm's step variables disagree: SLURM_STEP_NODELIST={nodelist:.60} "
                         f"({len(nodes)} nodes), SLURM_STEP_TASKS_PER_NODE={tasks_text:.40}, "
                         f"SLURM_NODEID={node_rank}; pass --nnodes, --node-rank and --manager")
    facts = slurm_facts(environ)
    return SlurmStep(job_id=job_id.strip(), nodes=nodes, node_rank=node_rank,
                     submit_dir=environ.get("SLURM_SUBMIT_DIR") or ".",
                     restart_count=int(facts["restarts"]) if facts else 0)
