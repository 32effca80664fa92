"""The learner's PyTorch side of the log-prob contract: recompute what the engine sampled with.

``response_forward`` rebuilds the exact inputs the engine saw for a :class:`RolloutBatch`:
decoder-only prompts left-padded with positions from the attention mask, then the response;
encoder-decoder prompts as the encoder input on its native padding side (its tokenizer's: right for
T5, BART, Marian) and the decoder fed ``[decoder_start] + response[:-1]`` (the exporter's rule,
:func:`refit.core.contract.decoder_start_id`: Marian starts from the pad id). Family details
(final_logits_bias, scaled embeddings, position offsets) are in the HF forward, as in the engine.
Logits are divided by the same temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refit.core.contract import decoder_start_id
from refit.core.padding import position_ids_from_mask
from refit.learner import losses as L


class ValueHead(torch.nn.Module):
    """Scalar value per position from the last hidden state (zero-initialised: V=0 at start)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.summary = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.summary.weight)
        torch.nn.init.zeros_(self.summary.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:  # (B, T, H) -> (B, T)
        return self.summary(h.to(self.summary.weight.dtype)).squeeze(-1)


def hidden_size(model) -> int:
    c = model.config
    return getattr(c, "n_embd", None) or getattr(c, "hidden_size", None) or c.d_model


@dataclass
class ForwardOut:
    logits: torch.Tensor  # (B, Tr, V) float32, already divided by temperature
    values: torch.Tensor | None  # (B, Tr) value of the state before each response token
    aux_loss: torch.Tensor | None = None  # a Mixture-of-Experts model's load-balancing loss (router_aux)


def _unwrap(model):
    """The HF model inside a DDP wrapper (which has no ``config``) or a PEFT model (a LoRA policy, whose forward
    passes every keyword on to it)."""
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def response_forward(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                     is_seq2seq: bool, temperature: float = 1.0, value_head: ValueHead | None = None,
                     router_aux: torch.Tensor | None = None) -> ForwardOut:
    """Logits (and values) at every response position, with the engine's padding and positions.

    ``router_aux`` (B, Tr), the response's loss mask, for a decoder-only Mixture-of-Experts model: its
    load-balancing loss too (``output_router_logits``), over the prompt's and these response tokens (the attention
    mask TRL's GRPO passes; the logits of the tokens in the loss are the same either way: the masked ones follow
    them)."""
    dev = next(model.parameters()).device
    prompt_ids, prompt_mask, response_ids = prompt_ids.to(dev), prompt_mask.to(dev), response_ids.to(dev)
    want_hidden = value_head is not None
    tr = response_ids.shape[1]
    if is_seq2seq:
        start = torch.full_like(response_ids[:, :1], decoder_start_id(_unwrap(model)))
        out = model(input_ids=prompt_ids, attention_mask=prompt_mask,
                    decoder_input_ids=torch.cat([start, response_ids[:, :-1]], 1), output_hidden_states=want_hidden)
        logits, hidden = out.logits, (out.decoder_hidden_states[-1] if want_hidden else None)
    else:
        tp = prompt_ids.shape[1]
        ids = torch.cat([prompt_ids, response_ids], 1)
        resp = torch.ones_like(response_ids) if router_aux is None else (router_aux.to(dev) != 0).to(prompt_mask.dtype)
        mask = torch.cat([prompt_mask, resp], 1)
        # logits at the tr positions that predict the response only (the prompt's would be (B, Tp, V) of nothing
        # used), kept by index: HF gathers those hidden states into a contiguous block, so the output layer and its
        # backward are one matrix multiply each (a trailing slice of a longer sequence multiplies batch by batch)
        kept = torch.arange(tp - 1, tp - 1 + tr, device=dev)
        extra = {"logits_to_keep": kept} if _keeps_logits(model) else {}
        if router_aux is not None:
            extra["output_router_logits"] = True
        out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                    output_hidden_states=want_hidden, **extra)
        logits = out.logits if out.logits.shape[1] == tr else out.logits[:, tp - 1: tp - 1 + tr]
        hidden = out.hidden_states[-1][:, tp - 1: tp - 1 + tr] if want_hidden else None
    values = value_head(hidden) if (value_head is not None and hidden is not None) else None
    logits = logits.float()  # no copy for an fp32 model; a (B, Tr, V) copy only to divide by a temperature
    return ForwardOut(logits=logits / temperature if temperature != 1.0 else logits, values=values,
                      aux_loss=getattr(out, "aux_loss", None) if router_aux is not None else None)


def vocab_size(model) -> int:
    """Rows of the model's output layer: the V of its logits."""
    head = _unwrap(model).get_output_embeddings()
    rows = getattr(head, "out_features", None)  # an int8 head's weight would be dequantized to be read
    return int(rows) if rows is not None else head.weight.shape[0]


def _keeps_logits(model) -> bool:
    """The HF causal LM takes ``logits_to_keep`` (transformers >= 4.50: every decoder-only family here)."""
    import inspect

    return "logits_to_keep" in inspect.signature(_unwrap(model).forward).parameters


@torch.no_grad()
def learner_view(model, value_head: ValueHead | None, batch, temperature: float, chunk: int = 16):
    """Log-probs (B, Tr), values (B, Tr) and entropy (B, Tr) of ``model`` on a RolloutBatch."""
    lps, vals, ents = [], [], []
    for i in range(0, batch.num_rows, chunk):
        s = slice(i, i + chunk)
        out = response_forward(model, batch.prompt_ids[s], batch.prompt_mask[s], batch.response_ids[s],
                               batch.is_seq2seq, temperature, value_head)
        st = L.token_stats(out.logits, batch.response_ids[s].to(out.logits.device))  # the update's own formulas
        lps.append(st.logprobs.cpu())
        ents.append(st.entropy.cpu())
        if out.values is not None:
            vals.append(out.values.float().cpu())
    return torch.cat(lps), (torch.cat(vals) if vals else None), torch.cat(ents)
