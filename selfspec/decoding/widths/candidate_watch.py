"""AR steps cannot measure what the plan would gain on a repetitive stretch, and a rare probe seldom
lands on one: a served JACOBI plan at C=4 ran AR through the loops its context candidate would
have copied (TPF 2.5 against 3.6 with the check off). So while AR steps serve a batch, each
sequence's `CandidateWatch` keeps the context candidate the plan's mode would verify and checks it
against the tokens AR then emits; when `watch_tokens` of them came true, the plan is probed at once.

"""

from __future__ import annotations

from selfspec.decoding.step import DecodeSequence, Mode


class CandidateWatch:
    """The context candidate a mode would verify for a sequence, kept while AR steps serve it:
    `came_true` says how many of its tokens the sequence has emitted since (a candidate that
    missed is replaced by the next one)."""

    def __init__(self, mode: Mode, seq: DecodeSequence):
        from selfspec.decoding.modes.ngram import context_index

        cfg = mode.config
        self.mode = mode
        self.tokens = cfg.context_tokens
        self.index = context_index(seq, cfg, mode.corpus)
        self.start = 0  # history length when the candidate was proposed
        self.candidate: list[int] = []

    @staticmethod
    def watches(mode: Mode) -> bool:
        """Whether `mode` verifies context candidates (ISD, RISD, SJD, JACOBI with context_tokens)."""
        return getattr(getattr(mode, "config", None), "context_tokens", 0) > 0 and hasattr(mode, "corpus")

    def forget(self, history: list[int]) -> None:
        """Drop the kept candidate (the next `came_true` proposes afresh from `history`)."""
        self.start, self.candidate = len(history), []

    def came_true(self, history: list[int]) -> int:
        """Tokens of the kept candidate the sequence emitted since it was proposed; once it
        missed or ran out, the next candidate is kept."""
        emitted = history[self.start :]
        n, most = 0, min(len(emitted), len(self.candidate))
        while n < most and emitted[n] == self.candidate[n]:
            n += 1
        if n < len(emitted) or n == len(self.candidate):
            self.start, self.candidate = len(history), self.index.propose(history, self.tokens)
        return n
