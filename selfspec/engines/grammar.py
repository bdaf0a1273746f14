"""Grammar-constrained decoding on the reference engine: an xgrammar matcher in the grammar-object
shape the decoding core walks (`decoding.requests.logits_rules.GrammarWalk`; the methods of SGLang's
`BaseGrammarObject`), plus `commit`, which the generate loop calls with each step's emitted
tokens (in SGLang the scheduler advances the grammar instead).

    g = XGrammar.compile(tokenizer, vocab_size, regex=r"[0-9]+")
    engine.generate([ids], 32, grammars=[g], ...)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class XGrammar:
    def __init__(self, compiled, max_rollback_tokens: int = 256):
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=max_rollback_tokens)

    @classmethod
    def compile(cls, tokenizer, vocab_size: int, *, regex: str | None = None, json_schema: str | None = None,
                ebnf: str | None = None, stop_token_ids: list[int] | None = None) -> XGrammar:
        """One of regex / json_schema (a JSON string) / ebnf, for a Hugging Face tokenizer; the
        tokens that may end the grammar are `stop_token_ids` (default: the tokenizer's EOS), as a
        server passes the model's stop tokens to its grammar backend."""
        import xgrammar as xgr

        if sum(x is not None for x in (regex, json_schema, ebnf)) != 1:
            raise ValueError("give exactly one of regex, json_schema, ebnf")
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        compiler = xgr.GrammarCompiler(info)
        if regex is not None:
            return cls(compiler.compile_regex(regex))
        if json_schema is not None:
            return cls(compiler.compile_json_schema(json_schema))
        return cls(compiler.compile_grammar(ebnf))

    # ---- the grammar-object methods GrammarWalk uses
    def accept_token(self, token: int) -> None:
        if not self.matcher.accept_token(int(token)):
            raise ValueError(f"token {token} not accepted by the grammar")

    def rollback(self, k: int) -> None:
        self.matcher.rollback(k)

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device) -> torch.Tensor:
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(batch_size, vocab_size)

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        self.matcher.fill_next_token_bitmask(vocab_mask, idx)

    # ---- what the generate loop calls
    def commit(self, tokens: Sequence[int]) -> int:
        """Advance over committed tokens up to where the grammar terminates; returns how many it
        took (the terminating token included)."""
        for n, t in enumerate(tokens):
            if self.matcher.is_terminated():
                return n
            self.accept_token(t)
        return len(tokens)
