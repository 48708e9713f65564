"""Overfitting: the gap between the validation and the train loss widening while validation
flattens or rises. One rule (`widening_gap`), used at run time by the monitor (at each evaluation,
against the train loss the checks measured then) and after the run by the report's "Does
validation track training?" (against the logged train losses), with the run-time alarm demanding
larger moves: it acts on the run, and a few noisy evaluations must not stop a healthy one."""

from __future__ import annotations

from dataclasses import dataclass

# What validation must keep of the train loss's fall over the second half of the evaluations: less
# than a quarter is memorizing (a model that learns what carries over loses about as much on both).
CARRIED_OVER = 0.25


@dataclass(frozen=True)
class Widening:
    """What the rule saw over the second half of the evaluations."""

    mid_step: int
    last_step: int
    mid_val: float
    last_val: float
    mid_gap: float
    last_gap: float

    @property
    def train_fell(self) -> float:
        return (self.mid_val - self.mid_gap) - (self.last_val - self.last_gap)

    def text(self) -> str:
        return (f"from step {self.mid_step} to {self.last_step} the train loss fell {self.train_fell:.4f} while "
                f"validation moved {self.last_val - self.mid_val:+.4f} (from {self.mid_val:.4f} to "
                f"{self.last_val:.4f}), so the gap grew from {self.mid_gap:+.4f} to {self.last_gap:+.4f}")


def widening_gap(val: list[tuple[int, float]], gaps: list[tuple[int, float]], *, min_fall: float,
                 min_points: int = 3, min_growth: float = 0.0) -> Widening | None:
    """Validation flat (or nearly) while the train loss keeps falling by at least `min_fall` nats over
    the second half of the evaluations (at least `min_points`), the gap growing by more than
    `min_growth`, and validation ending above training; None otherwise. `gaps` are validation minus
    the train loss near the same step."""
    if len(val) < max(3, min_points):
        return None
    mid = len(val) // 2
    (mid_step, mid_val), (last_step, last_val) = val[mid - 1], val[-1]
    seen = Widening(mid_step, last_step, mid_val, last_val, gaps[mid - 1][1], gaps[-1][1])
    val_fell = mid_val - last_val
    # Validation must end above training too: early on, the mean of the last train losses lags a fast fall
    # and sits above validation, and that lag closing is no gap opening.
    if (seen.train_fell < min_fall or val_fell >= CARRIED_OVER * seen.train_fell
            or seen.last_gap - seen.mid_gap <= min_growth or seen.last_gap < max(0.02, 0.02 * abs(last_val))):
        return None
    return seen
