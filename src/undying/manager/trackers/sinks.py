"""The three trackers, each behind one small interface: open the job's run (resumed), log rows of
committed steps, flush, close.

Each library is imported only when its tracker is asked for, in the
tracker's own thread (``feed``): the base install does not need it, and a
slow import or run start never holds the manager's loop. The run is the
job's: TensorBoard's folder, W&B's run id and MLflow's run (tagged with the
job id) are found again on a relaunch or a manager restart, never opened a
second time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

__all__ = ["Sink", "Row", "TRACKERS", "make_sink", "missing_library", "JOB_TAG"]

# A committed step and its values (the mean over the ranks, as `undying status` shows them).
Row = tuple[int, Mapping[str, float]]
# MLflow's run carries the job id in this tag; W&B's run id is the job id itself.
JOB_TAG = "undying.job_id"
# MLflow takes at most 1000 metrics in one log_batch call.
_MLFLOW_BATCH = 1000


class Sink(Protocol):
    """One tracker's run of the job."""

    def open(self, facts: Mapping[str, Any], last_step: int) -> dict[str, Any]:
        """Open (or resume) the job's run; returns what to keep in the cursor to find it again."""
        ...

    def log(self, rows: Sequence[Row]) -> None: ...

    def flush(self) -> None: ...

    def close(self, succeeded: bool) -> None: ...


class TensorBoard:
    """Event files under ``<job dir>/tensorboard/``: each launch its own file, the steps never
    repeated."""

    def __init__(self, job_id: str, job_dir: Path) -> None:
        self.folder = job_dir / "tensorboard"
        self._writer: Any = None

    def open(self, facts: Mapping[str, Any], last_step: int) -> dict[str, Any]:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: should an earlier launch have written steps past the cursor (killed between
        # its flush and its cursor's write), TensorBoard discards them in favour of these.
        self._writer = SummaryWriter(log_dir=str(self.folder), purge_step=last_step + 1)
        return {"log_dir": str(self.folder)}

    def log(self, rows: Sequence[Row]) -> None:
        for step, values in rows:
            for name, value in values.items():
                self._writer.add_scalar(name, value, step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self, succeeded: bool) -> None:
        self._writer.close()


class WandB:
    """One W&B run whose id is the job id, resumed by every launch (``resume="allow"``).

    Its project, entity, mode (``WANDB_MODE=offline``) and folder (``WANDB_DIR``,
    else the job dir) are W&B's own settings from the environment.
    """

    def __init__(self, job_id: str, job_dir: Path) -> None:
        self.job_id = job_id
        self.folder = Path(os.environ.get("WANDB_DIR") or job_dir)
        self._run: Any = None

    def open(self, facts: Mapping[str, Any], last_step: int) -> dict[str, Any]:
        import wandb

        # The launcher's terminal stays its own: no console capture, no banner.
        settings = wandb.Settings(console="off", silent=True, disable_git=True,
                                  x_disable_stats=True, save_code=False)
        self._run = wandb.init(id=self.job_id, name=self.job_id, resume="allow",
                               project=os.environ.get("WANDB_PROJECT") or "undying",
                               dir=str(self.folder), settings=settings)
        return {"run_id": self._run.id}

    def log(self, rows: Sequence[Row]) -> None:
        for step, values in rows:
            self._run.log(dict(values), step=step)

    def flush(self) -> None:
        """(W&B's service holds what was logged: nothing to push)"""

    def close(self, succeeded: bool) -> None:
        import wandb

        try:
            self._run.finish(exit_code=0 if succeeded else 1)
        finally:
            wandb.teardown()  # its service process ends with the job


class MLflow:
    """One MLflow run per job, tagged ``undying.job_id``, found again by its id or the tag.

    The tracking URI (``MLFLOW_TRACKING_URI``, e.g. ``file:/path/mlruns``) and
    the experiment (``MLFLOW_EXPERIMENT_NAME``, else ``undying``) are MLflow's
    own settings from the environment.
    """

    def __init__(self, job_id: str, job_dir: Path) -> None:
        self.job_id = job_id
        self._client: Any = None
        self.run_id = ""

    def open(self, facts: Mapping[str, Any], last_step: int) -> dict[str, Any]:
        from mlflow.tracking import MlflowClient

        client = self._client = MlflowClient()
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "undying"
        experiment = client.get_experiment_by_name(name)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else client.create_experiment(name))
        run_id = str(facts.get("run_id") or "")
        if run_id and not self._exists(run_id):
            run_id = ""
        if not run_id:
            found = client.search_runs([experiment_id],
                                       filter_string=f"tags.`{JOB_TAG}` = '{self.job_id}'",
                                       max_results=1)
            run_id = found[0].info.run_id if found else ""
        if not run_id:
            run_id = client.create_run(experiment_id, run_name=self.job_id,
                                       tags={JOB_TAG: self.job_id}).info.run_id
        else:
            client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        return {"run_id": run_id}

    def _exists(self, run_id: str) -> bool:
        try:
            run = self._client.get_run(run_id)
        except Exception:  # (MLflow's own error for an unknown or deleted run)
            return False
        return bool(run.data.tags.get(JOB_TAG) == self.job_id)

    def log(self, rows: Sequence[Row]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(name, value, now, step) for step, values in rows
                   for name, value in values.items()]
        for i in range(0, len(metrics), _MLFLOW_BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[i:i + _MLFLOW_BATCH])

    def flush(self) -> None:
        """(each log_batch is written when it returns)"""

    def close(self, succeeded: bool) -> None:
        self._client.set_terminated(self.run_id, status="FINISHED" if succeeded else "FAILED")


# (config.TRACKER_NAMES names the same three: the option is checked there)
TRACKERS: dict[str, Callable[[str, Path], Sink]] = {
    "tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow,
}
# The module each tracker needs, and the extra that installs it.
_NEEDS = {"tensorboard": ("tensorboard", "undying[tensorboard]"),
          "wandb": ("wandb", "undying[wandb]"), "mlflow": ("mlflow", "undying[mlflow]")}


def missing_library(name: str) -> str:
    """'' when tracker ``name``'s library is installed, else what to install."""
    import importlib.util

    module, extra = _NEEDS[name]
    if importlib.util.find_spec(module) is not None:
        return ""
    return f"--trackers {name} needs the {module} package: pip install '{extra}'"


def make_sink(name: str, job_id: str, job_dir: Path) -> Sink:
    return TRACKERS[name](job_id, job_dir)
