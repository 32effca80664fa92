"""``refit demo``: the embedded default run, on CPU, with nothing downloaded.

1. Build a byte-level BPE tokenizer and a small GPT-2-geometry policy locally (random weights).
2. Supervised warm-up on digit addition ("17+25=" -> "42"), stopped early so the policy is
   right only sometimes.
3. Export it to an ONNX engine folder (parity-gated) and run the PPO-KL cycle through the
   ``onnxruntime`` engine with an exact-match reward, pushing weights into the live engine every
   step and checking a probe batch after each push.
4. Print the reward at the start and the end, the smallest exact KL seen, and the run folder
   (metrics.jsonl, TensorBoard events, curves.png, checkpoints).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import torch
import tyro

from refit.core.contract import weights_hash
from refit.core.errors import RefitError
from refit.core.hf_folder import load_model
from refit.core.integrity import atomic_folder, clean_stale_temps, folder_holds, read_json
from refit.core.parsing import opt, parse
from refit.learner.builtin.models import Geometry, build_chat_tokenizer, build_model, build_tokenizer
from refit.learner.builtin.sft import sft
from refit.learner.builtin.tasks import addition
from refit.learner.ppo.cli import summary
from refit.learner.ppo.config import PPOConfig
from refit.learner.ppo.cycle import run_ppo
from refit.learner.run.chat import render
from refit.learner.run.config import (CheckpointSection, DataSection, LogSection, LoraSection, ModelSection,
                                      OptimSection, RunSection)
from refit.rollout.config import RolloutSection, Sampling

DEMO_POLICY = Geometry("gpt2", n_layer=2, d_model=128, n_head=4, d_ff=512, max_positions=64)


WARMUP_RECORD = "refit_demo.json"  # inside the policy folder: the warm-up's settings and the weights' sha256


def build_policy(out: Path, sft_steps: int, max_operand: int, seed: int, log=print, chat: bool = False) -> Path:
    """Random tiny GPT-2 + supervised warm-up on addition, saved as the HF folder ``out/policy`` (written into a
    temporary folder and renamed). ``chat``: the tokenizer has a chat template and the warm-up sees each "a+b=" as a
    user message rendered by it (the answer follows the generation prompt, then EOS). A policy this function made
    with the same settings is reused as it is; a folder it did not make is never written over."""
    policy = out / "policy"
    recipe = {"geometry": repr(DEMO_POLICY), "sft_steps": sft_steps, "max_operand": max_operand, "seed": seed, "chat": chat}
    made = read_json(policy / WARMUP_RECORD)
    if isinstance(made, dict) and made.get("recipe") == recipe and made.get("weights_sha256") == weights_hash(policy):
        log(f"refit demo: reusing the warmed-up policy in {policy} (same warm-up settings; delete it to warm up again)")
        return policy
    if folder_holds(policy) not in ("missing", "empty") and not isinstance(made, dict):
        raise RefitError(f"{policy} holds files refit demo did not write; choose another demo folder (-o)")
    tok = build_chat_tokenizer() if chat else build_tokenizer()
    out.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(out, log, prefix="policy.")
    with atomic_folder(policy) as tmp:
        model = load_model(build_model(DEMO_POLICY, tmp / "init", seed=seed, tokenizer=tok))
        user = (lambda p: render(tok, [{"role": "user", "content": p}])) if chat else (lambda p: p)  # noqa: E731
        pairs = [(user(e.prompt), e.answer) for e in addition(2000, max_operand=max_operand, seed=seed + 1)]
        sft(model, tok, pairs, steps=sft_steps, batch_size=64, lr=2e-3, seed=seed, log=log)
        shutil.rmtree(tmp / "init")
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        (tmp / WARMUP_RECORD).write_text(json.dumps({"recipe": recipe, "weights_sha256": weights_hash(tmp)}, indent=1))
    return policy


@dataclass(frozen=True)
class DemoConfig:
    """The embedded default: a small verifiable task trained with PPO on CPU (nothing downloaded)."""

    out: Annotated[str, tyro.conf.arg(aliases=["-o"])] = opt("runs/demo", "run folder")
    steps: int = opt(80, "PPO iterations")
    batch_size: int = opt(32, "prompts per iteration")
    num_generations: int = opt(4, "samples per prompt")
    sft_steps: int = opt(150, "supervised warm-up steps before PPO")
    max_operand: int = opt(9, "addition operands are drawn from [0, N]")
    backend: Literal["onnxruntime", "torch"] = opt("onnxruntime", "rollout engine")
    threads: int = opt(2, "torch and engine threads")
    seed: int = opt(0, "seed for everything")
    progress: bool = opt(True, "show a progress bar (--no_progress or --no-progress: none)")
    policy_only: bool = opt(False, "only build the warmed-up policy (OUT/policy, an HF folder) and print its path")
    quantize: Literal["auto", "none", "int8"] = opt(
        "auto", "rollout engine precision (rollout.quantize): int8 linear layers; auto: int8 with --lora where the CPU "
                "has int8 dot-product units, else none (refit.learner.run.precision)")
    precision: Literal["auto", "fp32", "bf16"] = opt(
        "auto", "the learner's precision (run.precision): auto bf16 where the hardware has bf16 units, else fp32; "
                "fp32 also keeps --quantize auto at none (the defaults before)")
    mismatch_correction: Literal["auto", "none", "tis", "seq_mask"] = opt(
        "auto", "PPO's rollout/learner mismatch correction (auto: tis with an int8 engine or a bf16 learner, else none)")
    chat: bool = opt(False, "a chat policy: the tokenizer has a chat template and the warm-up sees templated user "
                            "turns (with --policy_only, e.g. for examples/trl_chat)")
    lora: int = opt(0, "LoRA rank: train a LoRA adapter (alpha 2r) over the frozen warmed-up policy instead of "
                       "every weight; the engine takes only the adapter on each push; 0 = full fine-tuning")
    lora_targets: tuple[str, ...] = opt(("all-linear", "lm_head"), "with --lora, the adapter's target_modules: every "
                                        "linear layer and the output head (PEFT's all-linear alone leaves the head "
                                        "frozen, and learns this task slower: docs/lora.md)")
    overwrite: bool = opt(False, "run again over this variant's earlier demo run (OUT/ppo, OUT/ppo-lora16, ...): "
                                 "deletes that run's metrics and checkpoints; the warm-up is reused either way")
    learning_rate: float = opt(0.0, "with --lora, the adapter's learning rate (lora.learning_rate; 0: 1e-3, ~3x full "
                                    "fine-tuning's 3e-4, the best of a sweep in docs/lora.md); the value head keeps "
                                    "3e-4")


def run_folder(a: DemoConfig) -> Path:
    """The PPO run's folder in OUT, one per variant, so a variant never replaces another's run: OUT/ppo,
    OUT/ppo-lora16, OUT/ppo-int8 (OUT/ppo-fp32engine: --quantize none), OUT/ppo-fp32 / OUT/ppo-bf16 (--precision),
    OUT/ppo-torch, OUT/ppo-chat (combined in that order)."""
    engine = {"auto": [], "int8": ["int8"], "none": ["fp32engine"]}[a.quantize]
    learner = [] if a.precision == "auto" else [a.precision]
    parts = ["ppo"] + ([f"lora{a.lora}"] if a.lora else []) + engine + learner + (
        ["torch"] if a.backend != "onnxruntime" else []) + (["chat"] if a.chat else [])
    return Path(a.out) / "-".join(parts)


def ppo_config(a: DemoConfig, policy: Path) -> PPOConfig:
    """The demo's PPO run: the demo's settings on top of PPOConfig's defaults."""
    return PPOConfig(
        run=RunSection(output_dir=str(run_folder(a)), seed=a.seed, steps=a.steps, batch_size=a.batch_size,
                       precision=a.precision),
        model=ModelSection(model_dir=str(policy)), data=DataSection(max_operand=a.max_operand),
        rollout=RolloutSection(backend=a.backend, engine_threads=a.threads, quantize=a.quantize),
        optim=OptimSection(learning_rate=3e-4),
        ckpt=CheckpointSection(save_steps=10),
        lora=LoraSection(r=a.lora, alpha=2.0 * a.lora, target_modules=tuple(a.lora_targets),
                         learning_rate=a.learning_rate or 1e-3) if a.lora
        else LoraSection(),
        log=LogSection(progress=a.progress), sampling=Sampling(temperature=1.0, top_k=0),
        num_generations=a.num_generations, advantage_estimator="gae", num_ppo_epochs=2, num_mini_batches=2,
        kl_coef=0.01, response_length=6, mismatch_correction=a.mismatch_correction)


def main(argv: list[str] | None = None) -> int:
    a, _ = parse(DemoConfig, argv, "refit demo")
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    out = Path(a.out)
    t0 = time.perf_counter()
    if not a.policy_only and folder_holds(run_folder(a)) == "run" and not a.overwrite:  # before the warm-up
        raise RefitError(f"{run_folder(a)} already holds this demo's run; pass --overwrite to run it again (deletes "
                         "that run's metrics and checkpoints), or choose another folder (-o)")
    policy = build_policy(out, a.sft_steps, a.max_operand, a.seed, chat=a.chat)
    if a.policy_only:
        print(policy)
        return 0
    run_dir = run_ppo(ppo_config(a, policy), log=print, overwrite=a.overwrite)
    s = summary(run_dir)
    s["wall_s"] = round(time.perf_counter() - t0, 1)
    k = next(key for key in s if key.startswith("reward_first"))
    what = f"LoRA r {a.lora} " if a.lora else ""
    print(f"refit demo: {what}reward {s[k]:.3f} (mean of the first {k[12:-5]} steps) -> "
          f"{s[k.replace('first', 'last')]:.3f} (last {k[12:-5]}) over {s['steps']} PPO steps; "
          f"min exact KL {s['min_exact_kl']:.2e} (>= 0); run folder {run_dir.resolve()}")
    print(json.dumps(s))
    return 0
