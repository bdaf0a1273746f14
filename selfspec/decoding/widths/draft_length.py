"""How long a request's next lookup draft may be, from what its recent drafts had accepted.

Where the forward is ragged (the CPU worker) each drafted token is a query token the whole batch
pays for; at batch 16 one costs about a third of what a committed token is worth, so a token
past the point the request's drafts usually break is a loss there, and free at batch 1 (the
width plan picks per batch whether a lookup bucket adapts). A request copying a loop accepts
whole drafts and keeps the full length; one writing new text falls back to short drafts after
a miss or two and grows back geometrically once its drafts are accepted whole again.

The rule: draft at most `2·m + 2` tokens, m a moving mean of the draft tokens accepted per step
(the latest step weighted `LATEST_WEIGHT`, steps with no draft counting 0), starting at half
the full length so the first step drafts it all. Tuned offline on the held-out prompts' greedy
outputs (`bench/context_lookup.py` replays the lookups against AR's text).
"""

from __future__ import annotations

from dataclasses import dataclass

#: the weight of the latest step in the moving mean (0.7: after a full miss a 16-token limit
#: drops to 6 in one step; after a loop is entered it is back at 16 within three)
LATEST_WEIGHT = 0.7


@dataclass
class RecentAcceptance:
    """One request's recent draft acceptance; `limit` caps its next draft."""

    full: int  # the configured draft length, never exceeded
    mean: float = -1.0  # moving mean of draft tokens accepted per step; < 0 until the first step

    def __post_init__(self) -> None:
        if self.mean < 0:
            self.mean = self.full / 2

    def limit(self) -> int:
        """The longest draft the request's next step may carry (at least 1)."""
        return max(1, min(self.full, int(2 * self.mean) + 2))

    def record(self, accepted: int) -> None:
        """A step of this request verified `accepted` draft tokens (0 when it had none)."""
        self.mean = LATEST_WEIGHT * accepted + (1.0 - LATEST_WEIGHT) * self.mean
