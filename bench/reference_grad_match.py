"""Does one training step of ours compute the gradient that speculators' computes? (issue 14)

Same weights (a speculators checkpoint, converted into our draft by
``bench/reference_speculators.py``'s ``to_eagle3_draft``), same sample, float32 on the CPU, no
autocast: speculators' ``Eagle3DraftModel.forward`` (its shift, its KL loss, its TTT unroll; eager
SDPA) and our fast TTT loss (``eagle3.train.ttt_fast``), each backpropagated; then the relative
difference of every trainable weight's gradient. The loss positions are set to speculators'
(the input token's loss mask, ``--positions input``) so that both count the same positions, or
left as ours (``--positions ours``) to see what that difference alone does to the gradient.
KL and soft CE differ by the target's entropy, a constant: the gradients are the same function.

    .venv-ref/bin/python bench/reference_grad_match.py --ckpt REF/checkpoints/0 --extract EXTRACT \\
        --vocab VOCAB --target TARGET [--positions input|ours] [--ttt 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", type=Path, required=True)
    ap.add_argument("--extract", type=Path, required=True)
    ap.add_argument("--vocab", type=Path, required=True)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--positions", choices=["input", "ours"], default="input")
    ap.add_argument("--ttt", type=int, default=3)
    ap.add_argument("--samples", type=int, default=4)
    a = ap.parse_args()

    from reference_speculators import extract_aux_layers, to_eagle3_draft
    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel

    from eagle3.extract.storage import HiddenStateDataset
    from eagle3.train.batch import make_batch
    from eagle3.train.target import load_target_head
    from eagle3.train.ttt_fast import fast_ttt_loss
    from eagle3.vocab import load_vocab

    config = Eagle3DraftModel.config_class.from_pretrained(str(a.ckpt))
    config.transformer_layer_config._attn_implementation = "sdpa"  # noqa: SLF001
    ref = Eagle3DraftModel.from_pretrained(str(a.ckpt), config=config).float()
    forward = getattr(type(ref).forward, "__wrapped__", type(ref).forward)  # no torch.compile
    ours, _, vocab, _ = to_eagle3_draft(a.ckpt, a.target, a.vocab, extract_aux_layers(a.extract))
    ours = ours.float()
    ours.load_embeddings(a.target)
    ours.lm_head.weight.requires_grad_(False)  # frozen in speculators
    head = load_target_head(a.target, load_vocab(a.vocab).draft_ids, ours.config.rms_norm_eps)
    ds = HiddenStateDataset(a.extract, dtype=torch.float32)
    loss_config = resolve_loss_config("kl_div", "eager")
    worst = 0.0
    for j in range(min(a.samples, len(ds))):
        s = ds[j]
        n = len(s)
        ref.zero_grad(set_to_none=True)
        ours.zero_grad(set_to_none=True)
        mask = s.loss_mask.bool()
        _, ref_loss, _ = forward(
            ref,
            hidden_states=s.aux[:-1][None],
            input_ids=s.input_ids[1:][None].long(),
            document_ids=torch.zeros(1, n - 1, dtype=torch.long),
            loss_mask=mask[1:][None],
            position_ids=torch.arange(1, n)[None],
            verifier_last_hidden_states=s.final[1:][None],
            ttt_steps=a.ttt,
            ttt_step_loss_decay=1.0,
            loss_config=loss_config,
        )
        ref_loss.backward()
        positions = "input" if a.positions == "input" else "predicted"  # train.loss_positions
        batch = make_batch([s], head, torch.device("cpu"), n, positions=positions)
        loss, _ = fast_ttt_loss(ours, batch, a.ttt, 1.0)
        loss.backward()
        print(
            f"sample {j}: {n} tokens, {int(mask.sum())} with loss; loss ours {float(loss):.5f} "
            f"speculators {float(ref_loss):.5f} (KL = CE - entropy)"
        )
        theirs = dict(ref.named_parameters())
        for name, p in ours.named_parameters():
            if p.grad is None:
                continue
            q = theirs[name.replace("midlayer.", "layers.0.")]
            rel = float((p.grad - q.grad).norm() / q.grad.norm().clamp(min=1e-12))
            worst = max(worst, rel)
            print(f"  {name:45s} |g| {float(q.grad.norm()):.3e}  rel diff {rel:.2e}")
    print(f"worst relative gradient difference: {worst:.2e}")


if __name__ == "__main__":
    main()
