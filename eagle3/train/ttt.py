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

Parallel drafting (P-EAGLE, ``parallel`` = K >= 2 depths): after the sequential steps, depths
d = 1..K-1 of ONE draft pass. Depth d at row t is vLLM's mask slot d after the bonus token at t:
the placeholder (the embedding of ``parallel_token_id`` and ``fc(mask_hidden)``) instead of a
token and a hidden state, RoPE position t + d, the same target and count as TTT step d, and the
same attention as TTT step d with the parallel blocks as its diagonals: step 0's keys <= t, then
depths 1..d at row t (what vLLM's causal attention over [context, bonus, mask 1..d] sees:
../shared/docs/PARALLEL_DRAFTING.md, section a). Step 0 is shared by both chains, so a draft
trained with ``ttt_steps`` S and ``parallel`` K has S + K - 1 loss columns and serves either way.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from eagle3.draft import DraftModel
from eagle3.draft.common import extend_prefix
from eagle3.train.batch import Batch, shift_left, step_inputs

KV = tuple[torch.Tensor, torch.Tensor]


def ttt_mask(t: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Boolean [T, (step+1)*T]: causal over the step-0 block, the diagonal over blocks 1..step."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)


def loss_offsets(ttt_steps: int, parallel: int = 0) -> list[int]:
    """Each loss column's chain position i (its target is step 0's shifted by i + 1 rows): the
    sequential steps 0..S-1, then the parallel depths 1..K-1 (module docstring)."""
    return list(range(ttt_steps)) + list(range(1, parallel))


def column_names(ttt_steps: int, parallel: int = 0) -> list[str]:
    """The loss columns' names in metrics.json and TensorBoard: ``step i``, ``parallel d``."""
    return [f"step {i}" for i in range(ttt_steps)] + [f"parallel {d}" for d in range(1, parallel)]


def ttt_unroll(
    model: DraftModel, batch: Batch, ttt_steps: int, parallel: int = 0
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Yield (chain position i, out [B, L, H], logits [B, L, D]) of each loss column in order.

    Step i gets ``past_kv`` = keys/values of steps 0..i-1 (with grad), the boolean
    :func:`ttt_mask`, RoPE positions ``t + i`` and the ids of :func:`step_inputs`; parallel depth
    d the placeholder, step 0's keys and depths 1..d-1's, the same mask and positions ``t + d``."""
    L = batch.input_ids.shape[1]
    device = batch.input_ids.device
    pos = torch.arange(L, device=device)
    hidden: torch.Tensor = batch.aux
    past: KV | None = None
    kv0: KV | None = None
    for i in range(ttt_steps):
        ids = shift_left(batch.input_ids, 1 + i)
        mask = None if i == 0 else ttt_mask(L, i, device)
        out, logits, kv = model(
            ids, hidden, position_ids=pos + i, attn_mask=mask, past_kv=past, use_cache=True
        )
        yield i, out, logits
        kv0 = kv if kv0 is None else kv0
        past = extend_prefix(past, kv)
        hidden = out
    if parallel > 1:
        embeds, mask_h = model.placeholder(*batch.input_ids.shape)
        past = kv0
        for d in range(1, parallel):
            out, logits, kv = model(
                batch.input_ids,
                mask_h,
                position_ids=pos + d,
                attn_mask=ttt_mask(L, d, device),
                past_kv=past,
                use_cache=True,
                inputs_embeds=embeds,
            )
            yield d, out, logits
            past = extend_prefix(past, kv)


def step_counts(batch: Batch, ttt_steps: int, parallel: int = 0) -> torch.Tensor:
    """Counted positions of each loss column, int64 on the batch's device (known before the
    forward; views, no shifted copies)."""
    ok = batch.target_ok
    return torch.stack([ok[:, 1 + i :].sum() for i in loss_offsets(ttt_steps, parallel)])


def ttt_loss(
    model: DraftModel,
    batch: Batch,
    ttt_steps: int,
    ttt_decay: float,
    denom: torch.Tensor | None = None,
    parallel: int = 0,
) -> tuple[torch.Tensor, list[dict]]:
    """Unrolled loss (weighted sum over steps) and per-step {loss, sum, correct, count}.

    Step i's loss is its summed soft CE over counted positions divided by ``denom[i]``, by default
    this batch's count; accumulation and distributed steps pass the count of the whole global
    batch so that the micro-batches' losses add up to the global batch's loss."""
    total = torch.zeros((), device=batch.input_ids.device)
    stats = []
    for col, (i, _out, logits) in enumerate(ttt_unroll(model, batch, ttt_steps, parallel)):
        _, probs, arg, ok = step_inputs(batch, i)
        logp = torch.log_softmax(logits.float(), dim=-1)
        ce = -(probs * logp).sum(-1)  # [B, L]
        count = int(ok.sum())
        ce_sum = (ce * ok.float()).sum()
        loss_i = ce_sum / (max(count, 1) if denom is None else denom[col])
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

    The unroll calls the draft ``ttt_steps`` (+ ``parallel`` - 1) times; DDP and FSDP expect their
    root module to run once per backward, so they wrap this instead of the draft (the draft is
    ``.draft``). ``impl``: ``eager`` (:func:`ttt_loss`, per-column stats as dicts) or ``fast``
    (:func:`eagle3.train.ttt_fast.fast_ttt_loss`, stats as a [3, columns] device tensor). What
    the optimizer step needs of the loss's layout (its columns' counts and weights) is asked of
    this module, so the step and the loss cannot disagree."""

    def __init__(
        self,
        draft: DraftModel,
        ttt_steps: int,
        ttt_decay: float,
        impl: str = "eager",
        parallel: int = 0,
    ) -> None:
        super().__init__()
        if impl not in ("eager", "fast"):
            raise ValueError(f"train.step_impl must be eager or fast, got {impl!r}")
        if parallel > 1 and not hasattr(draft, "mask_hidden"):
            raise ValueError("parallel drafting needs a draft built with parallel_depths")
        self.draft = draft
        self.ttt_steps = ttt_steps
        self.ttt_decay = ttt_decay
        self.impl = impl
        self.parallel = parallel if parallel > 1 else 0
        self.offsets = loss_offsets(ttt_steps, self.parallel)

    def counts(self, batch: Batch) -> torch.Tensor:
        """Counted positions of each loss column of ``batch``, int64 on its device."""
        return step_counts(batch, self.ttt_steps, self.parallel)

    def weights(self, device: torch.device) -> torch.Tensor:
        """Each column's weight in the total loss: ``ttt_decay ** i`` at chain position i."""
        i = torch.tensor(self.offsets, dtype=torch.float64, device=device)
        return self.ttt_decay**i

    def forward(
        self, batch: Batch, denom: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[dict] | torch.Tensor]:
        args = (self.ttt_steps, self.ttt_decay, denom, self.parallel)
        if self.impl == "fast":
            from eagle3.train.ttt_fast import fast_ttt_loss

            return fast_ttt_loss(self.draft, batch, *args)
        return ttt_loss(self.draft, batch, *args)


def objective(net: nn.Module) -> TTTObjective:
    """The TTT objective inside ``net`` (itself, or DDP's ``.module``)."""
    return getattr(net, "module", net)
