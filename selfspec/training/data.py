"""Training data for I-DLM conversion: the stdlib corpus, text / JSONL files, chat data.

Every source becomes a list of documents (token ids + a per-token loss code, two bits:
LOSS_MASK = 1 the MASK half learns the target, LOSS_CLEAN = 2 the clean half learns it;
0 no loss, LOSS_MASK alone the MASK half only (on-policy rows), LOSS_BOTH = 3 both halves):
- the default `stdlib`: the train split of the standard-library corpus of tiny-base (held-out
  split for evaluation), each file followed by EOS, exactly as tiny-base saw it;
- text files (any extension; directories are walked): one document per file;
- JSONL files: a record with `text` is a text document; a record with `prompt` / `response`
  or with `messages` (role / content) is a chat document, rendered with the tokenizer's chat
  template, with the loss on the assistant responses only; a record with `ids` (token ids,
  optionally after `prefix_ids` that carry no loss) is used as given — `clean_loss: false`
  restricts its loss to the MASK half (on-policy data: see `selfspec.training.selfgen`).
Text-only data is packed into one token stream and cut into random windows; chat data is one
example per row (truncated, right-padded; padding and prompts carry no loss).

Several sources mix by weights: each micro-batch takes a fixed number of rows from each
(`Mixture`). Held-out evaluation uses the first source's held-out split.

Batches are a pure function of (seed, step, micro-batch, rank): resuming a run reproduces the
batches of an uninterrupted one without saving sampler state.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from selfspec.errors import UsageError
from selfspec.corpus import is_heldout, load_stdlib_split
from selfspec.training.tokenizer import EOS_TOKEN


LOSS_MASK = 1  # bit 0: the MASK half learns this target
LOSS_CLEAN = 2  # bit 1: the clean half learns it
LOSS_BOTH = LOSS_MASK | LOSS_CLEAN


@dataclass
class Document:
    ids: list[int]
    loss: list[int]  # per token: 0, LOSS_MASK (MASK half only) or LOSS_BOTH


@dataclass
class Dataset:
    """Documents of one split, with the batching rule that suits them."""

    docs: list[Document]
    chat: bool
    pad_id: int
    stream: torch.Tensor = field(init=False)
    stream_loss: torch.Tensor = field(init=False)

    def __post_init__(self):
        ids = [t for d in self.docs for t in d.ids]
        loss = [m for d in self.docs for m in d.loss]
        self.stream = torch.tensor(ids, dtype=torch.long)
        self.stream_loss = torch.tensor(loss, dtype=torch.uint8)

    @property
    def num_tokens(self) -> int:
        return int(self.stream.numel())

    def sample(self, generator: torch.Generator, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, L+1] ids and [B, L+1] loss codes (uint8, see LOSS_*)."""
        if not self.chat:
            hi = self.num_tokens - seq_len - 1
            if hi <= 0:
                raise UsageError(f"data has {self.num_tokens} tokens: too few for windows of {seq_len + 1}")
            starts = torch.randint(0, hi, (batch_size,), generator=generator).tolist()
            ids = torch.stack([self.stream[s : s + seq_len + 1] for s in starts])
            loss = torch.stack([self.stream_loss[s : s + seq_len + 1] for s in starts])
            return ids, loss
        picks = torch.randint(0, len(self.docs), (batch_size,), generator=generator).tolist()
        ids = torch.full((batch_size, seq_len + 1), self.pad_id, dtype=torch.long)
        loss = torch.zeros((batch_size, seq_len + 1), dtype=torch.uint8)
        for row, i in enumerate(picks):
            d = self.docs[i]
            n = min(len(d.ids), seq_len + 1)
            ids[row, :n] = torch.tensor(d.ids[:n])
            loss[row, :n] = torch.tensor(d.loss[:n], dtype=torch.uint8)
        return ids, loss

    def eval_batches(self, seq_len: int, batch_size: int, max_tokens: int):
        """Deterministic evaluation rows: consecutive windows of the stream (text) or the first
        documents (chat), covering about `max_tokens` target tokens."""
        if not self.chat:
            usable = min(self.num_tokens - 1, max_tokens)
            n = max(1, usable // seq_len)
            rows = [(self.stream[r * seq_len : r * seq_len + seq_len + 1],
                     self.stream_loss[r * seq_len : r * seq_len + seq_len + 1]) for r in range(n)]
            rows = [r for r in rows if r[0].numel() == seq_len + 1]
        else:
            rows, seen = [], 0
            for d in self.docs:
                if seen >= max_tokens:
                    break
                n = min(len(d.ids), seq_len + 1)
                ids = torch.full((seq_len + 1,), self.pad_id, dtype=torch.long)
                loss = torch.zeros(seq_len + 1, dtype=torch.uint8)
                ids[:n] = torch.tensor(d.ids[:n])
                loss[:n] = torch.tensor(d.loss[:n], dtype=torch.uint8)
                rows.append((ids, loss))
                seen += n
        for i in range(0, len(rows), batch_size):
            chunk = rows[i : i + batch_size]
            yield torch.stack([c[0] for c in chunk]), torch.stack([c[1] for c in chunk])


def batch_generator(seed: int, step: int, micro: int) -> torch.Generator:
    """The generator of one global micro-batch (every process draws the same one and keeps its
    rows: `selfspec.training.distributed`): a hash of (seed, step, micro). The trailing 0 in the
    hashed text is where a per-process stream was once numbered; kept, one-process runs draw the
    batches they always drew."""
    h = hashlib.sha256(f"idlm-batch:{seed}:{step}:{micro}:0".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(h[:8], "little") & ((1 << 63) - 1))


# ---------------------------------------------------------------------------------- sources
def _text_doc(tokenizer, text: str, eos_id: int) -> Document:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos_id]
    return Document(ids, [LOSS_BOTH] * len(ids))


def _chat_doc(tokenizer, messages: list[dict]) -> Document:
    """Loss on assistant turns only: each assistant turn's tokens are the difference between the
    rendering up to and including it and the rendering of what precedes it (+ generation prompt)."""
    ids: list[int] = []
    loss: list[bool] = []
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        upto = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        before_ids = tokenizer(before, add_special_tokens=False)["input_ids"]
        upto_ids = tokenizer(upto, add_special_tokens=False)["input_ids"]
        if upto_ids[: len(before_ids)] != before_ids:
            raise ValueError("the chat template does not render conversations as prefixes of each other")
        prompt_part = before_ids[len(ids):]
        ids += prompt_part
        loss += [0] * len(prompt_part)
        reply = upto_ids[len(before_ids):]
        ids += reply
        loss += [LOSS_BOTH] * len(reply)
    if not ids:
        raise UsageError("chat record without an assistant turn")
    return Document(ids, loss)


def _record_to_doc(tokenizer, rec: dict, eos_id: int) -> tuple[Document, bool]:
    if "ids" in rec:
        code = LOSS_BOTH if rec.get("clean_loss", True) else LOSS_MASK
        prefix = [int(t) for t in rec.get("prefix_ids", [])]
        body = [int(t) for t in rec["ids"]]
        return Document(prefix + body, [0] * len(prefix) + [code] * len(body)), True
    if "messages" in rec:
        return _chat_doc(tokenizer, rec["messages"]), True
    if "prompt" in rec and ("response" in rec or "completion" in rec):
        reply = rec.get("response", rec.get("completion"))
        msgs = [{"role": "user", "content": rec["prompt"]}, {"role": "assistant", "content": reply}]
        if rec.get("system"):
            msgs.insert(0, {"role": "system", "content": rec["system"]})
        return _chat_doc(tokenizer, msgs), True
    if "text" in rec:
        return _text_doc(tokenizer, rec["text"], eos_id), False
    raise UsageError(f"JSONL record has none of text / ids / prompt+response / messages: keys {sorted(rec)}")


def _expand(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for p in paths:
        path = Path(p).expanduser()
        if path.is_dir():
            files += sorted(f for f in path.rglob("*") if f.is_file())
        elif path.is_file():
            files.append(path)
        else:
            raise UsageError(f"--data {p}: no such file or directory (give text / JSONL files, directories of them, or 'stdlib')")
    return files


@dataclass
class Mixture:
    """Several training datasets; each micro-batch takes round(B * weight) rows from each."""

    parts: list[Dataset]
    weights: list[float]

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.parts)

    def rows_per_part(self, batch_size: int) -> list[int]:
        total = sum(self.weights)
        counts = [int(batch_size * w / total) for w in self.weights]
        for i in sorted(range(len(counts)), key=lambda i: -self.weights[i])[: batch_size - sum(counts)]:
            counts[i] += 1
        return counts

    def sample(self, generator: torch.Generator, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, loss = [], []
        for part, n in zip(self.parts, self.rows_per_part(batch_size)):
            if n:
                i, m = part.sample(generator, n, seq_len)
                ids.append(i)
                loss.append(m)
        return torch.cat(ids), torch.cat(loss)


@dataclass
class DataSplits:
    train: Dataset | Mixture
    heldout: Dataset
    description: dict


def load_data(tokenizer, sources: list[str] | None, weights: list[float] | None = None) -> DataSplits:
    """`sources`: None or ["stdlib"] for the default corpus; otherwise "stdlib", files or
    directories. Several sources are separate datasets mixed by `weights` (default: equal
    rows); a source is either "stdlib" or one file / directory."""
    sources = list(sources) if sources else ["stdlib"]
    if len(sources) == 1:
        return _load_one(tokenizer, sources[0])
    splits = [_load_one(tokenizer, src) for src in sources]
    weights = list(weights) if weights else [1.0] * len(splits)
    if len(weights) != len(splits):
        raise UsageError(f"{len(weights)} data weights for {len(splits)} sources")
    desc = {"mixture": [{**sp.description, "weight": w} for sp, w in zip(splits, weights)],
            "heldout": "first source"}
    return DataSplits(Mixture([sp.train for sp in splits], weights), splits[0].heldout, desc)


def _load_one(tokenizer, source: str) -> DataSplits:
    """Held-out split for file data: records / files whose key hashes into the 5% bucket of the
    corpus rule (`corpus.is_heldout`); if that leaves either side empty, the last 5% of the
    documents are held out."""
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN) if EOS_TOKEN in tokenizer.get_vocab() else tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    if source == "stdlib":
        split = load_stdlib_split()
        train = [_text_doc(tokenizer, f.text, eos_id) for f in split.train]
        held = [_text_doc(tokenizer, f.text, eos_id) for f in split.heldout]
        desc = {"source": "stdlib", "sha256": split.digest(), "train_files": len(split.train),
                "heldout_files": len(split.heldout)}
        return DataSplits(Dataset(train, False, pad_id), Dataset(held, False, pad_id), desc)

    keyed: list[tuple[str, Document, bool]] = []
    h = hashlib.sha256()
    for path in _expand([source]):
        raw = path.read_bytes()
        h.update(path.name.encode() + b"\0" + raw + b"\0")
        if path.suffix == ".jsonl":
            for n, line in enumerate(raw.decode("utf-8").splitlines()):
                if line.strip():
                    doc, chat = _record_to_doc(tokenizer, json.loads(line), eos_id)
                    keyed.append((f"{path.name}:{n}", doc, chat))
        else:
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                continue
            if text.strip():
                keyed.append((path.name, _text_doc(tokenizer, text, eos_id), False))
    if not keyed:
        raise UsageError(f"no usable data in {source}")
    chat = any(c for _, _, c in keyed)
    held = [d for k, d, _ in keyed if is_heldout(k)]
    train = [d for k, d, _ in keyed if not is_heldout(k)]
    if not held or not train:
        cut = max(1, len(keyed) // 20) if len(keyed) > 1 else 0
        docs = [d for _, d, _ in keyed]
        train, held = (docs[:-cut], docs[-cut:]) if cut else (docs, docs)
    desc = {"source": str(source), "sha256": h.hexdigest(), "chat": chat,
            "train_docs": len(train), "heldout_docs": len(held)}
    return DataSplits(Dataset(train, chat, pad_id), Dataset(held, chat, pad_id), desc)
