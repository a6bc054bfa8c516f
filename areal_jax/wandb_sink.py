"""Weights & Biases as one more place a job's metrics go (config keys log.wandb_*; `pip install wandb`).

The run's W&B id is kept in ``run_dir/wandb_run_id``, so a resumed job logs into the same W&B run. Every number is
plotted against the job's step, logged as the metric ``step`` (``define_metric``'s custom x-axis), while W&B's own row
counter only ever grows: W&B drops a row logged at a lower step than one it already has, and a job resumed from a
checkpoint logs again the steps between that checkpoint and the crash. Those steps then appear twice on the step
axis, the second time as the resumed run trained them (metrics.jsonl, too, has both). Offline, the row counter is
kept in the W&B directory (``wandb_next_row``), so each resumed process's offline file continues the previous one's
rows and the files sync into one run in order (``wandb sync --append``).
W&B's own files go to ``run_dir/wandb`` (a local run directory) or to a local temporary directory (a run directory
on an object store; offline mode then keeps them only there, and says where).
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Mapping

from areal_jax import paths

ID_FILE = "wandb_run_id"
STEP_METRIC = "step"  # the job's step, the x-axis of every metric
ROW_FILE = "wandb_next_row"  # offline: W&B's next row counter, so a resumed process's file continues the last one's


def _new_id() -> str:
    import secrets

    return secrets.token_hex(4)


class WandbSink:
    """One W&B run for a job's run directory.

    Args:
      run_dir: the job's run directory (local, file:// or an object store).
      project, entity: where the run goes (entity "": the account's default).
      name: the run's display name ("": the run directory's last component).
      mode: "online" or "offline" (files only; upload later with `wandb sync DIR`).
      config: the job's config, shown with the run.
      log: where a line about the run goes (its local directory).
    """

    def __init__(self, run_dir: str, *, project: str, entity: str = "", name: str = "", mode: str = "online",
                 config: Mapping[str, Any] | None = None, log: Callable[[str], None] = print) -> None:
        import wandb

        id_path = paths.join(run_dir, ID_FILE)
        run_id = id_path.read_text().strip() if id_path.exists() else ""
        if not run_id:
            run_id = _new_id()
            paths.write_text(id_path, run_id + "\n")
        local = paths.local_path(run_dir)
        if local is None:
            local = tempfile.mkdtemp(prefix="areal_jax-wandb-")
        os.makedirs(local, exist_ok=True)
        try:
            self.run = wandb.init(
                project=project, entity=entity or None, name=name or os.path.basename(os.fspath(run_dir).rstrip("/")),
                id=run_id, resume="allow", dir=local, mode=mode, config=dict(config or {}),
                settings=wandb.Settings(console="off", silent=True),
            )
        except Exception as e:  # no login, no network, a project the account cannot write
            from areal_jax.knobs import ConfigError

            raise ConfigError(
                f"--config.log.wandb_project={project!r}: Weights & Biases could not start the run "
                f"({type(e).__name__}: {e}). Log in with `wandb login` (or set WANDB_API_KEY), log offline with "
                "--config.log.wandb_mode=offline, or leave the project empty.") from e
        # The x-axis of every metric is the job's step; W&B's internal step (one per log call) keeps growing across a
        # resume, so the steps trained again after it are kept rather than dropped as "lower than the latest".
        self.run.define_metric(STEP_METRIC)
        self.run.define_metric("*", step_metric=STEP_METRIC)
        # W&B's row counter: online, a resumed run continues the server's; offline, each process's file would start
        # again at 0, so the next row is kept beside the run (local run directories) and a resumed process's file
        # follows the last one's rows (the files then sync into one run in order: `wandb sync --append`).
        self._row_path = os.path.join(local, ROW_FILE) if mode == "offline" else None
        saved = 0
        if self._row_path is not None and os.path.exists(self._row_path):
            try:
                saved = int(open(self._row_path).read().strip() or 0)
            except ValueError:
                saved = 0
        self._row = max(int(self.run.step or 0), saved)
        self.id = run_id
        log(f"Weights & Biases: run {run_id} in project {project!r} ({mode}; files under {local}/wandb).")

    def log(self, step: int, flat: Mapping[str, Any]) -> None:
        """The numbers of one flattened metrics record at `step` (strings and arrays stay in metrics.jsonl)."""
        numbers = {k: float(v) for k, v in flat.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if numbers:
            numbers.pop(STEP_METRIC, None)
            self.run.log({STEP_METRIC: int(step), **numbers}, step=self._row)
            self._row += 1
            if self._row_path is not None:
                paths.write_text(self._row_path, f"{self._row}\n")

    def close(self) -> None:
        """Finish the run and stop W&B's service process, so every row is in its files (offline) or sent when this
        returns: finish() alone can leave the service still writing."""
        import wandb

        self.run.finish()
        wandb.teardown()
