"""Early stopping (run.callbacks=[early_stopping], the `early_stopping` section): the run ends
when early_stopping.patience evaluations in a row have not bettered the best value of the metric
by more than early_stopping.min_delta. The run's summary and log say why; it exits 0, as a run
that ended. The decision is in every checkpoint: a requeue or a rerun of the stopped run ends
at once, saying so, instead of training on (a new run.name starts afresh).
"""

from __future__ import annotations

from .callbacks import Callback, Run, metric_goal, metric_value

SECTION = "early_stopping"


class EarlyStopping(Callback):
    section = SECTION

    def __init__(self, metric: str, mode: str, patience: int, min_delta: float = 0.0):
        (self.metric, self.goal), self.patience, self.min_delta = (
            metric_goal(SECTION, metric, mode),
            patience,
            min_delta,
        )
        self.best: float | None = None
        self.since_best = 0  # evaluations since the best
        self.reason: str | None = None  # why the run stopped, once it did

    def on_start(self, run: Run) -> None:
        if self.reason:
            run.stop(self.reason)

    def after_evaluation(self, run: Run, metrics: dict[str, float]) -> None:
        value = metric_value(SECTION, self.metric, metrics)
        better = value + self.min_delta if self.goal == "min" else value - self.min_delta  # by more than min_delta
        if self.best is None or (better < self.best if self.goal == "min" else better > self.best):
            self.best, self.since_best = value, 0
            return
        self.since_best += 1
        if self.since_best >= self.patience:
            self.reason = (
                f"early stopping: eval {self.metric} has not bettered {self.best:.4g} (by more than "
                f"{self.min_delta:g}) in {self.since_best} evaluations, at step {run.state.step}"
            )
            run.stop(self.reason)

    def state_dict(self) -> dict:
        return {"best": self.best, "since_best": self.since_best, "reason": self.reason, "metric": self.metric}

    def load_state_dict(self, state: dict) -> None:
        if state["metric"] == self.metric:
            self.best, self.since_best, self.reason = state["best"], state["since_best"], state["reason"]
