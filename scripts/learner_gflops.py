"""The learner's arithmetic rate against this machine's measured GEMM peak, per precision.

1. **Peak**: one large GEMM (``--peak_shape`` M,K,N) per route the learner can take on a CPU: fp32 through torch's
   BLAS (``F.linear``), fp32 through oneDNN (``run.cpu_matmul onednn``, the default on x86-64), bf16 (``F.linear`` on
   bf16 tensors: native where the CPU has AVX512-BF16/AMX, emulated elsewhere) and int8 (``torch._int_mm``, VNNI).
   Best of ``--reps`` calls after a warm-up; GFLOP/s (int8: GOP/s).
2. **Learner**: one learner micro-batch as the PPO update runs it (``response_forward`` at the engine's padding and
   positions, the chunked log-prob/entropy of ``token_stats``, their backward) on a published geometry
   (``--geometry``, random weights, ``--layers`` 0 = published depth) with LoRA r ``--lora_r`` over the frozen base
   (0: every weight trained), ``--rows`` rows of ``--prompt_tokens`` + ``--response_tokens`` tokens, in each
   ``--precisions`` (fp32: the fp32 base on the default route; bf16: the frozen base held in bf16 as
   ``lora.base_dtype bf16`` does, adapter fp32). Its FLOPs are counted by PyTorch itself
   (``torch.utils.flop_counter.FlopCounterMode``: every matmul/attention op the forward and backward ran), then
   the same step is timed without the counter (median of ``--rounds``): achieved GFLOP/s, and that rate as a
   fraction of the peak of its precision.
3. **Where the rest goes**: a ``torch.profiler`` pass over one step: the share of CPU time in matrix products
   (aten mm/addmm/bmm/linear, oneDNN linear, scaled-dot-product attention) against everything else (softmax,
   elementwise, copies, the optimizer's zeroing), with the ten largest non-GEMM ops.

Ends with one JSON line. Example (Qwen2.5-0.5B at full depth, the issue-44 update shape)::

    python scripts/learner_gflops.py --geometry "Qwen2.5 0.5B" --layers 0 --rows 2 --lora_r 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul",
            "mkldnn::_linear_pointwise", "aten::_scaled_dot_product_flash_attention_for_cpu",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "aten::_int_mm")


def _best(f, reps: int) -> float:
    f()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def peak_table(m: int, k: int, n: int, reps: int) -> dict[str, float]:
    """GFLOP/s (int8: GOP/s) of one (m, k) x (k, n) product per route; a route this torch lacks is left out."""
    from refit.learner.run.matmul import _dnn

    flops = 2 * m * k * n / 1e9
    x, w = torch.randn(m, k), torch.randn(n, k)
    routes = {"fp32_blas": lambda: torch.nn.functional.linear(x, w), "fp32_onednn": lambda: _dnn(x, w, None)}
    xb, wb = x.bfloat16(), w.bfloat16()
    routes["bf16"] = lambda: torch.nn.functional.linear(xb, wb)
    xi, wi = torch.randint(-127, 128, (m, k), dtype=torch.int8), torch.randint(-127, 128, (k, n), dtype=torch.int8)
    routes["int8"] = lambda: torch._int_mm(xi, wi)
    out = {}
    for name, f in routes.items():
        try:
            out[name] = round(flops / _best(f, reps), 1)
        except (RuntimeError, NotImplementedError) as e:  # an op this build or CPU does not have
            print(f"    {name}: not measured ({str(e).splitlines()[0][:100]})")
    return out


def build(geometry: str, layers: int, lora_r: int, precision: str, model_dir: str = ""):
    """The learner's model as ``refit ppo`` holds it: a published geometry with random weights (or the checkpoint
    in ``model_dir``), SDPA attention, eval mode (the learner applies no dropout), linear layers on the default route,
    the tanh GELU fused."""
    from transformers import AutoModelForCausalLM

    from refit.core.hf_folder import LEARNER_ATTN
    from refit.learner.builtin.published import published_config
    from refit.learner.run.activations import learner_kernels

    torch.manual_seed(0)
    model = (AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=LEARNER_ATTN) if model_dir else
             AutoModelForCausalLM.from_config(published_config(geometry, layers or None),
                                              attn_implementation=LEARNER_ATTN))
    if lora_r:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora_r, lora_alpha=2 * lora_r, target_modules="all-linear"))
        if precision == "bf16":
            from refit.learner.run.lora import hold_base

            hold_base(model, torch.bfloat16)
        elif precision == "int8":  # lora.base_dtype int8: the layers an int8 engine quantizes (every LoRA base
            hold_int8_like_engine(model)  # layer and the output head), held as refit.learner.run.lora.hold_int8 does
    elif precision == "bf16":
        model = model.bfloat16()  # full fine-tuning in bf16 here is the forward/backward's arithmetic only
    learner_kernels(model, "auto", torch.device("cpu"))
    return model.eval()


def hold_int8_like_engine(model) -> None:
    """Without an engine's manifest: every LoRA base layer and the output head replaced by an Int8Linear over its
    int8 twin (the set an int8 export of these geometries quantizes; tests/test_int8_base.py checks hold_int8's set
    against a real manifest)."""
    from peft.tuners.lora import LoraLayer

    from refit.core.int8 import Int8Linear

    base = model.get_base_model()
    for layer in [m for m in base.modules() if isinstance(m, LoraLayer)]:
        b = layer.base_layer
        layer.base_layer = Int8Linear(b.weight.detach().t(), b.bias)
    head = base.get_output_embeddings()
    base.set_output_embeddings(Int8Linear(head.weight.detach().t(), head.bias))


def learner_step(model, prompt, prompt_mask, response, entropy_coef: float = 0.0):
    """One micro-batch's forward, chunked token statistics and backward, as the PPO update computes them (the
    entropy in the loss only with ``entropy_coef``: GRPO's default logs it and leaves it out)."""
    from refit.learner.losses.chunked import token_stats
    from refit.learner.run.policy import response_forward

    model.zero_grad(set_to_none=True)
    logits = response_forward(model, prompt, prompt_mask, response, is_seq2seq=False).logits
    st = token_stats(logits, response)
    loss = st.logprobs.sum() + entropy_coef * st.entropy.sum() if entropy_coef else st.logprobs.sum()
    loss.backward()


def count_flops(model, step) -> int:
    """The step's FLOPs as PyTorch's counter sees them, on torch's own linear (the counter knows aten's matmuls,
    not oneDNN's linear op; the products are the same), the model's matmul route put back afterwards."""
    from torch.utils.flop_counter import FlopCounterMode

    from refit.learner.run.matmul import restore, use_cpu_matmul

    restore(model)
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    use_cpu_matmul(model, "auto", torch.device("cpu"))
    return counter.get_total_flops()


def profile_shares(step) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    rows = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in rows)
    gemm = sum(e.self_cpu_time_total for e in rows if e.key in GEMM_OPS)
    rest = sorted((e for e in rows if e.key not in GEMM_OPS), key=lambda e: -e.self_cpu_time_total)[:10]
    return {"gemm_share": round(gemm / total, 3),
            "top_other": [{"op": e.key, "share": round(e.self_cpu_time_total / total, 3), "calls": e.count}
                          for e in rest]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--geometry", default="Qwen2.5 0.5B", help="a published geometry (learner.builtin.published)")
    p.add_argument("--layers", type=int, default=0, help="the depth built (0: as published)")
    p.add_argument("--model_dir", default="", help="a checkpoint folder to load instead of --geometry (e.g. the "
                                                   "bench's small-gpt2 chat model)")
    p.add_argument("--lora_r", type=int, default=16, help="LoRA rank over the frozen base (0: full fine-tuning)")
    p.add_argument("--rows", type=int, default=2, help="rows in the micro-batch")
    p.add_argument("--prompt_tokens", type=int, default=20)
    p.add_argument("--response_tokens", type=int, default=64)
    p.add_argument("--precisions", default="fp32,bf16,int8", help="comma list of fp32, bf16, int8 (the LoRA base held "
                                                                   "in int8: lora.base_dtype int8)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5, help="timed calls of each peak GEMM")
    p.add_argument("--peak_shape", default="512,2048,2048", help="M,K,N of the peak GEMM")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no_profile", action="store_true", help="skip the profiler pass")
    p.add_argument("--entropy_coef", type=float, default=0.0, help="an entropy bonus in the loss (0: GRPO's default)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    # as in a refit ppo process, whose ONNX Runtime engine asks glibc once to keep freed memory
    # (refit.export.graph.keep_freed_memory): each (rows, chunk, vocab) temporary reuses the heap instead of a fresh,
    # page-faulted mmap, which tripled the time of an elementwise op over the 152k vocabulary
    from refit.export.graph import keep_freed_memory

    keep_freed_memory()

    from refit.learner.run.lora import bf16_is_fast

    m, k, n = (int(v) for v in a.peak_shape.split(","))
    print(f"learner_gflops: {a.threads} threads; bf16 units: {bf16_is_fast('cpu')}; peak GEMM {m}x{k}x{n}", flush=True)
    peak = peak_table(m, k, n, a.reps)
    print("    peak " + ", ".join(f"{r} {v:.1f}" for r, v in peak.items()) + " GFLOP/s (int8: GOP/s)", flush=True)
    out = {"bench": "learner_gflops", "geometry": a.model_dir or a.geometry, "layers": a.layers, "lora_r": a.lora_r, "rows": a.rows,
           "prompt_tokens": a.prompt_tokens, "response_tokens": a.response_tokens, "threads": a.threads,
           "entropy_coef": a.entropy_coef,
           "bf16_units": bf16_is_fast("cpu"), "peak_gflops": peak, "learner": {}}
    counted: dict[str, int] = {}
    for precision in a.precisions.split(","):
        model = build(a.geometry, a.layers, a.lora_r, precision, a.model_dir)
        vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, vocab, (a.rows, a.prompt_tokens), generator=g)
        response = torch.randint(0, vocab, (a.rows, a.response_tokens), generator=g)
        step = lambda: learner_step(model, prompt, torch.ones_like(prompt), response, a.entropy_coef)  # noqa: E731
        step()  # warm-up: oneDNN's kernels, the allocator
        # int8: the same products as fp32's (torch's counter has no formula for torch._int_mm)
        flops = counted.get("fp32") if precision == "int8" else None
        flops = flops or count_flops(model, step)
        counted[precision] = flops
        times = []
        for _ in range(a.rounds):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        s = statistics.median(times)
        rate = flops / s / 1e9
        ref = peak.get(precision if precision in ("bf16", "int8") else "fp32_onednn") or peak.get("fp32_blas")
        row = {"seconds": round(s, 3), "gflop": round(flops / 1e9, 1), "gflops": round(rate, 1),
               "of_peak": round(rate / ref, 3) if ref else None}
        if not a.no_profile:
            row.update(profile_shares(step))
        out["learner"][precision] = row
        print(f"    learner {precision}: {row['gflop']} GFLOP in {row['seconds']} s = {row['gflops']} GFLOP/s, "
              f"{row['of_peak']} of the {precision} peak" + (f"; GEMM share {row['gemm_share']}" if "gemm_share" in row
                                                            else ""), flush=True)
        del model
    print(json.dumps(out))


if __name__ == "__main__":
    main()
