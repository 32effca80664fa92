"""The learner's forward and backward on torch's BLAS and on oneDNN (``run.cpu_matmul``), in ONE process, interleaved.

First each distinct linear shape of the model alone (forward and input gradient at the micro-batch's positions,
GFLOPS, BLAS vs oneDNN), so a user on another CPU can see which route ``auto`` should be for them. Then the learner's
own work, :func:`refit.learner.run.policy.response_forward` and the backward of the response log-probs over
``--rows`` rows of a ``--prompt_tokens``-token prompt with ``--response_tokens``-token
responses (a LoRA adapter over the frozen base with ``--lora_r`` > 0, else every weight trained), the two routes
taking turns ``--rounds`` times on the same weights and batch, with the largest log-prob difference between them.
Ends with one JSON line.

    PYTHONPATH=. python scripts/learner_forward_ab.py --geometry "Qwen2.5 0.5B" --layers 4
    PYTHONPATH=. python scripts/learner_forward_ab.py --model_dir /path/to/hf-folder --lora_r 16 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _best(f, n: int) -> float:
    f()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def shapes_table(model, tokens: int, reps: int) -> list[dict]:
    """GFLOPS of each distinct (in, out) linear shape of ``model``: forward and input gradient, BLAS vs oneDNN."""
    from transformers.pytorch_utils import Conv1D

    from refit.learner.run.matmul import _dnn

    seen = []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            shape = (m.in_features, m.out_features)
        elif isinstance(m, Conv1D):
            shape = tuple(m.weight.shape)
        else:
            continue
        if shape not in seen:
            seen.append(shape)
    rows = []
    for k, n in seen:
        x, w, g = torch.randn(tokens, k), torch.randn(n, k), torch.randn(tokens, n)
        gf = 2 * tokens * k * n / 1e9
        row = {"in": k, "out": n,
               "fwd_blas": gf / _best(lambda: torch.nn.functional.linear(x, w), reps),
               "fwd_onednn": gf / _best(lambda: _dnn(x, w, None), reps),
               "dx_blas": gf / _best(lambda: g @ w, reps),
               "dx_onednn": gf / _best(lambda: _dnn(g, w.t(), None), reps)}
        rows.append({key: (round(v, 1) if isinstance(v, float) else v) for key, v in row.items()})
        print(f"    {k:>6} -> {n:<7} GFLOPS  forward {row['fwd_blas']:7.1f} blas {row['fwd_onednn']:7.1f} onednn"
              f"   input grad {row['dx_blas']:7.1f} blas {row['dx_onednn']:7.1f} onednn", flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model_dir", help="an HF checkpoint folder")
    src.add_argument("--geometry", help="a published geometry (refit.learner.builtin.published), random weights")
    p.add_argument("--layers", type=int, default=2, help="--geometry: the depth to build (0: as published)")
    p.add_argument("--rows", type=int, default=2, help="rows in the forward (a learner micro-batch)")
    p.add_argument("--prompt_tokens", type=int, default=20)
    p.add_argument("--response_tokens", type=int, default=64)
    p.add_argument("--lora_r", type=int, default=16, help="LoRA rank over the frozen base (0: full fine-tuning)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5, help="timed calls per shape in the shape table")
    a = p.parse_args(argv)

    from transformers import AutoModelForCausalLM

    import refit.learner.run.policy as policy
    from refit.learner.builtin.published import published_config
    from refit.learner.run.matmul import restore, use_cpu_matmul

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    if a.model_dir:
        model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(published_config(a.geometry, a.layers or None))
    model.eval()
    if a.lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=a.lora_r, lora_alpha=2 * a.lora_r, target_modules="all-linear"))
    print(f"learner_forward_ab: {a.model_dir or a.geometry}, {a.threads} threads, {a.rows} rows of a "
          f"{a.prompt_tokens}-token prompt + {a.response_tokens} tokens, "
          f"{'LoRA r ' + str(a.lora_r) if a.lora_r else 'full fine-tuning'}", flush=True)
    table = shapes_table(model, a.rows * (a.prompt_tokens + a.response_tokens), a.reps)

    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, a.prompt_tokens)).expand(a.rows, -1).contiguous()
    prompt_mask = torch.ones_like(prompt)
    response = torch.randint(0, vocab, (a.rows, a.response_tokens))

    def step(way: str):
        if way == "blas":
            restore(model)
        else:
            use_cpu_matmul(model, "onednn")
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        logits = policy.response_forward(model, prompt, prompt_mask, response, is_seq2seq=False).logits
        lp = torch.log_softmax(logits, -1).gather(-1, response[..., None]).squeeze(-1)
        lp.sum().backward()
        return time.perf_counter() - t, lp.detach()

    ways = ("blas", "onednn")
    for way in ways:  # first calls (oneDNN's kernels, the allocator) out of the rounds
        step(way)
    times: dict[str, list[float]] = {w: [] for w in ways}
    lps = {}
    for r in range(a.rounds):
        for way in ways:
            s, lps[way] = step(way)
            times[way].append(s)
            print(f"    round {r} {way:6} forward+backward {s:.3f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"bench": "learner_forward_ab", "source": a.model_dir or a.geometry, "layers": a.layers, "rows": a.rows,
           "prompt_tokens": a.prompt_tokens, "response_tokens": a.response_tokens, "lora_r": a.lora_r,
           "threads": a.threads, "step_blas_s": round(med["blas"], 4), "step_onednn_s": round(med["onednn"], 4),
           "onednn_vs_blas": round(med["blas"] / med["onednn"], 3),
           "max_dlogprob": float((lps["onednn"] - lps["blas"]).abs().max()), "shapes": table}
    print(f"forward+backward: blas {med['blas']:.3f} s, onednn {med['onednn']:.3f} s: {out['onednn_vs_blas']}x; "
          f"max |d log-prob| {out['max_dlogprob']:.2e}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
