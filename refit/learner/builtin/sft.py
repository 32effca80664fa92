"""Supervised warm-up: cross-entropy on the answer tokens of (prompt, answer) pairs.

Used by the embedded defaults to make a starting policy (PPO demo) or a teacher (distillation
demo) from a random-weight local model. Decoder-only models see ``prompt + answer + EOS``
left-padded with positions from the mask; an encoder-decoder model sees the prompt as encoder
input, padded on its tokenizer's side (right for T5, BART, Marian), and ``answer + EOS`` as labels.
"""

from __future__ import annotations

import random

import torch

from refit.core.padding import pad_batch, position_ids_from_mask


def sft_batch(tok, pairs: list[tuple[str, str]], seq2seq: bool):
    """Tensors for one batch; ``labels`` are -100 outside the answer."""
    eos, pad = tok.eos_token_id, tok.pad_token_id
    if seq2seq:
        ids, mask = pad_batch([tok(p, add_special_tokens=False).input_ids for p, _ in pairs], pad, tok.padding_side)
        lab, lmask = pad_batch([tok(a, add_special_tokens=False).input_ids + [eos] for _, a in pairs], pad, "right")
        labels = torch.from_numpy(lab).masked_fill(torch.from_numpy(lmask) == 0, -100)
        return {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask), "labels": labels}
    seqs, n_prompt = [], []
    for p, a in pairs:
        pi = tok(p, add_special_tokens=False).input_ids
        seqs.append(pi + tok(a, add_special_tokens=False).input_ids + [eos])
        n_prompt.append(len(pi))
    ids, mask = pad_batch(seqs, pad, "left")
    labels = torch.from_numpy(ids).clone()
    t = ids.shape[1]
    for i, (s, n) in enumerate(zip(seqs, n_prompt)):
        labels[i, : t - len(s) + n] = -100
    mask_t = torch.from_numpy(mask)
    return {"input_ids": torch.from_numpy(ids), "attention_mask": mask_t, "position_ids": position_ids_from_mask(mask_t),
            "labels": labels}


def sft(model, tok, pairs: list[tuple[str, str]], steps: int, batch_size: int = 32, lr: float = 1e-3,
        seed: int = 0, log=None) -> list[float]:
    """Train ``model`` in place for ``steps`` AdamW steps; return the loss curve."""
    seq2seq = bool(getattr(model.config, "is_encoder_decoder", False))
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps))
    losses = []
    model.train()
    for step in range(steps):
        b = sft_batch(tok, rng.sample(pairs, min(batch_size, len(pairs))), seq2seq)
        loss = model(**b).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log is not None and (step + 1) % max(1, steps // 5) == 0:
            log(f"sft step {step + 1}/{steps}: loss {loss.item():.3f}")
    model.eval()
    return losses
