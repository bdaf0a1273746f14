"""SGLang's grammar objects (xgrammar, outlines, llguidance: `constrained/base_grammar_backend.py`)
as the decoding core's `TokenConstraint`.

The scheduler compiles a request's grammar before it is scheduled and advances the grammar's
matcher over the tokens each step commits (`BatchResultProcessor.advance_grammar_fsm`, which
also stops the run where the grammar terminates), so the grammar's state is the committed
output; each row's mask walks the row's drafts on it and rolls back
(`decoding.requests.logits_rules.GrammarWalk`).
"""

from __future__ import annotations

from selfspec.decoding.requests.logits_rules import GrammarWalk


def request_constraint(req, mask_token_id: int | None = None) -> GrammarWalk:
    return GrammarWalk(lambda: req.grammar, skip_token=mask_token_id)
