"""The training-time test (TTT): the draft unrolled over ``ttt_steps`` of its own guesses; its loss.

Alignment (the exact shift; ``x`` = input_ids, ``a`` = aux, ``f`` = final, ``m`` = loss_mask of
one sample of length T; ``P(f_u)`` = target distribution from ``f_u``, i.e. over token u+1)::

    TTT step i (i = 0..K-1), draft position t (t = 0..T-1):
        hidden input   step 0: fc(a_t);  step i>0: out_{i-1}[t]   (the previous step's pre-norm out)
        input token    x_{t+1+i}                                   (0 when t+1+i >= T, masked)
        RoPE position  t + i                                       (as vLLM's proposer: +1 per step)
        target         P(f_{t+1+i})                                (the distribution of token t+2+i)
        counted iff    t+2+i < T  and  m[t+2+i]  and  argmax P_full(f_{t+1+i}) in the draft vocab

So at step 0 the draft pairs the state at t with the token the target emitted after it (t+1) and
predicts the target's next-token distribution at t+1; each further step moves one position
further along the ground-truth tokens (SpecForge-style) while feeding its own hidden state.

TTT attention at step i (keys = [step-0 block, step-1 block, ..., step-i block], T each):
query t sees step-0 keys s <= t (causal) and, in each block 1..i, only key t (the diagonal),
which is what the draft sees at inference (the prefix, then its own chain of guesses).

Loss per step: soft cross-entropy ``-sum_d P_d log q_d`` averaged over the counted positions of the
batch; total = ``sum_i ttt_decay**i * loss_i``. Top-1 per step: draft argmax == target argmax
over the same positions (the acceptance proxy).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from eagle3.draft import DraftModel
from eagle3.train.batch import Batch, shift_left, step_inputs


def ttt_mask(t: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean [T, (step+1)*T]: causal over the step-0 block, the diagonal over blocks 1..step."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)


def ttt_unroll(
    model: DraftModel, batch: Batch, ttt_steps: int
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield (step i, out [B, L, H], logits [B, L, D]) of the unrolled draft, step by step.

    Step i gets ``past_kv`` = keys/values of steps 0..i-1 (with grad), the boolean
    :func:`ttt_mask`, RoPE positions ``t + i`` and the ids of :func:`step_inputs`."""
    L = batch.input_ids.shape[1]
    device = batch.input_ids.device
    pos = torch.arange(L, device=device)
    hidden: torch.Tensor = batch.aux
    past: tuple[torch.Tensor, torch.Tensor] | None = None
    for i in range(ttt_steps):
        ids = shift_left(batch.input_ids, 1 + i)
        mask = None if i == 0 else ttt_mask(L, i, device)
        out, logits, kv = model(
            ids, hidden, position_ids=pos + i, attn_mask=mask, past_kv=past, use_cache=True
        )
        yield i, out, logits
        past = (
            kv if past is None else (torch.cat([past[0], kv[0]], 2), torch.cat([past[1], kv[1]], 2))
        )
        hidden = out


def step_counts(batch: Batch, ttt_steps: int) -> torch.Tensor:
    """Counted positions of each TTT step, int64 [ttt_steps] (known before the forward)."""
    return torch.stack([shift_left(batch.target_ok, 1 + i, False).sum() for i in range(ttt_steps)])


def ttt_loss(
    model: DraftModel,
    batch: Batch,
    ttt_steps: int,
    ttt_decay: float,
    denom: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[dict]]:
    """Unrolled loss (weighted sum over steps) and per-step {loss, sum, correct, count}.

    Step i's loss is its summed soft CE over counted positions divided by ``denom[i]``, by default
    this batch's count; accumulation and distributed steps pass the count of the whole global
    batch so that the micro-batches' losses add up to the global batch's loss."""
    total = torch.zeros((), device=batch.input_ids.device)
    stats = []
    for i, _out, logits in ttt_unroll(model, batch, ttt_steps):
        _, probs, arg, ok = step_inputs(batch, i)
        logp = torch.log_softmax(logits.float(), dim=-1)
        ce = -(probs * logp).sum(-1)  # [B, L]
        count = int(ok.sum())
        ce_sum = (ce * ok.float()).sum()
        loss_i = ce_sum / (max(count, 1) if denom is None else denom[i])
        total = total + (ttt_decay**i) * loss_i
        with torch.no_grad():
            correct = int(((logits.argmax(-1) == arg) & ok).sum())
        stats.append(
            {
                "loss": float(loss_i.detach()),
                "sum": float(ce_sum.detach()),
                "correct": correct,
                "count": count,
            }
        )
    return total, stats


class TTTObjective(nn.Module):
    """The draft and its TTT loss as one module, so that one ``forward`` is one training forward.

    The unroll calls the draft ``ttt_steps`` times; DDP and FSDP expect their root module to run
    once per backward, so they wrap this instead of the draft (the draft is ``.draft``).
    ``impl``: ``eager`` (:func:`ttt_loss`, per-step stats as dicts) or ``fast``
    (:func:`eagle3.train.ttt_fast.fast_ttt_loss`, stats as a [3, K] device tensor)."""

    def __init__(
        self, draft: DraftModel, ttt_steps: int, ttt_decay: float, impl: str = "eager"
    ) -> None:
        super().__init__()
        if impl not in ("eager", "fast"):
            raise ValueError(f"train.step_impl must be eager or fast, got {impl!r}")
        self.draft = draft
        self.ttt_steps = ttt_steps
        self.ttt_decay = ttt_decay
        self.impl = impl

    def forward(
        self, batch: Batch, denom: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[dict] | torch.Tensor]:
        if self.impl == "fast":
            from eagle3.train.ttt_fast import fast_ttt_loss

            return fast_ttt_loss(self.draft, batch, self.ttt_steps, self.ttt_decay, denom)
        return ttt_loss(self.draft, batch, self.ttt_steps, self.ttt_decay, denom)
