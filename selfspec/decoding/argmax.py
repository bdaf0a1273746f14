"""The greedy rule's argmax: the first maximum along the last dim, as torch.argmax picks it."""

from __future__ import annotations

import numpy
import torch


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """The index of the first maximum along the last dim (torch.argmax's tie rule), long.
    On the CPU numpy computes it: torch's CPU argmax over a row of a few thousand logits measured
    ~8x slower than numpy's (12 us vs 1.4 us a row here), and a greedy step takes one per verified
    row. numpy also returns the first maximum (and the first NaN, as torch does)."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64) and x.dim() > 0:
        return torch.from_numpy(numpy.asarray(x.detach().numpy().argmax(-1)))
    return x.argmax(dim=-1)
