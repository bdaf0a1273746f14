"""The run-time check of a width plan (`width_plan.py`), per batch-size class.

The plan is a prediction; `OnlineCheck` verifies it while serving. The serving engine reports
each step's wall-clock period (`PlannedMode.observe`; the offline engine does not, so its
choices stay a function of the batch alone); per batch-size class the check keeps the
measured rate (tokens per second per request, over the last ~100 steps of the class) of the
bucket's mode, of plain AR steps and, where the bucket runs the mode's own step with a context
candidate, of that candidate alone (a lookup step: whether the mode's own proposals pay for
their query tokens depends on the model), runs the fastest and now and then probes another for
a few steps, the more rarely the further the running one leads. A plan whose speculation does not
pay on the machine it runs on (the cost model mispredicted, the load is not the tuner's) then
falls back to AR steps by measurement, at the price of the probes.
"""

from __future__ import annotations

import math
from typing import Any

from selfspec.decoding.widths.width_plan import OnlineCheckConfig


def size_class(batch_size: int) -> int:
    """Batch sizes grouped at ratio sqrt(2): 1, 2, 3, 4, 5-6, 7-9, 10-13, 14-18, 19-26, 27-36, ..."""
    return round(2 * math.log2(max(batch_size, 1)))


_MAX_PROBE_STRETCH = 4.0


class _Arm:
    __slots__ = ("tokens", "seconds", "last")

    def __init__(self) -> None:
        self.tokens = self.seconds = 0.0
        self.last = 0  # the key's observation count when this arm was last observed

    @property
    def known(self) -> bool:
        return self.seconds > 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


#: the arms a key may run: the plan's bucket, the lookup step of the bucket's own candidate
#: (where the bucket runs the mode's own step with one), plain AR steps
ARMS = ("plan", "lookup", "ar")


class OnlineCheck:
    """For each key (sampled or not, batch-size class): which arm runs, from their measured
    rates (see module doc): the plan's mode ("plan"), plain AR steps ("ar") and, where the plan
    runs the mode's own step with a context candidate, that candidate alone ("lookup": whether
    the mode's own proposals pay for their query tokens depends on the model, which a policy
    written without measuring cannot know). Starts with the plan and probes the other arms
    early, so a wrong plan is left within a few dozen steps."""

    def __init__(self, config: OnlineCheckConfig):
        self.config = config
        self._arms: dict[Any, dict[str, _Arm]] = {}
        self._best: dict[Any, str] = {}
        self._since_probe: dict[Any, int] = {}
        self._probing: dict[Any, tuple[str, int]] = {}  # the arm being probed and its steps left
        self._observed: dict[Any, int] = {}  # observations per key
        self.switches = 0  # times the faster arm changed
        self.observations = 0
        self.watch_probes = 0  # plan probes a `CandidateWatch` started

    def arm(self, key: Any, arms: tuple[str, ...] = ("plan", "ar")) -> str:
        """The arm the next step of this key runs among `arms` (and the probe schedule advanced)."""
        cfg = self.config
        best = self._best.setdefault(key, "plan")
        stats = self._arms.setdefault(key, {})
        for a in arms:
            stats.setdefault(a, _Arm())
        probing, left = self._probing.get(key, ("", 0))
        if left > 0 and probing in arms:
            self._probing[key] = (probing, left - 1)
            return probing
        others = [a for a in arms if a != best]
        if best not in arms or not others:
            return best if best in arms else arms[0]
        # the arm to probe next: one never measured, else the one measured longest ago
        target = min(others, key=lambda a: (stats[a].known, stats[a].last))
        since = self._since_probe.get(key, 0) + 1
        if stats[target].known:
            # the further ahead the running arm, the less a probe can find and the more it costs:
            # probe every probe_every steps at parity, up to 4x as rarely
            other = stats[target].rate
            lead = stats[best].rate / other if other > 0 else _MAX_PROBE_STRETCH
            wait = int(cfg.probe_every * min(max(lead, 1.0), _MAX_PROBE_STRETCH))
        else:
            wait = 2 * cfg.probe_steps
        if since > wait:
            self._since_probe[key] = 0
            self._probing[key] = (target, cfg.probe_steps - 1)
            return target
        self._since_probe[key] = since
        return best

    def probe_plan(self, key: Any) -> str:
        """Run the plan from this step on: a probe of it now where another arm is the faster
        (its usual length), the end of a probe otherwise."""
        if self._best.get(key, "plan") != "plan":
            self._probing[key] = ("plan", self.config.probe_steps - 1)
            self._since_probe[key] = 0
        else:
            self._probing[key] = ("", 0)
        self.watch_probes += 1
        return "plan"

    def observe(self, key: Any, arm: str, tokens_per_request: float, seconds: float) -> None:
        self.observations += 1
        count = self._observed[key] = self._observed.get(key, 0) + 1
        stats = self._arms.setdefault(key, {})
        a = stats.setdefault(arm, _Arm())
        # the past fades per step of the key, not per step of the arm: a probe's fresh steps
        # outweigh what the arm measured dozens of steps ago (the text has changed since)
        d = self.config.decay ** (count - a.last)
        a.tokens = d * a.tokens + tokens_per_request
        a.seconds = d * a.seconds + seconds
        a.last = count
        best = self._best.get(key, "plan")
        known = {name: s.rate for name, s in stats.items() if s.known}
        if best not in known or len(known) < 2:
            return
        fastest = max(known, key=known.__getitem__)
        if fastest != best and known[fastest] > known[best] * (1 + self.config.margin):
            self._best[key] = fastest
            self.switches += 1

    def summary(self) -> dict[str, Any]:
        """Per key, the arm it runs and each arm's measured rate (tokens / s / request)."""
        return {f"{'sampled' if k[0] else 'greedy'}-{k[1]}": {"runs": self._best.get(k, "plan"),
                                                                 **{f"{a}_rate": round(v[a].rate, 2) for a in v}}
                for k, v in self._arms.items()}
