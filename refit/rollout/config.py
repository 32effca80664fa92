"""The rollout's config sections: ``Sampling`` (temperature, top-k, top-p, min-p, repetition penalty), shared by ``refit generate``, ``refit ppo``
and ``refit distill``, and the one place a job's :class:`SamplingParams` is made (the engine's request record,
defined here rather than in ``refit/rollout/types.py`` so that every config imports without torch: a wrong flag is
answered before the heavy imports); ``RolloutSection``, the jobs' engines (backend, threads, weight pushes and
the probe after each); and the lines of ``refit export`` and ``refit generate`` (``ExportConfig``, ``GenerateConfig``),
parsed and checked here without torch (:func:`parse_export`, :func:`parse_generate`).

Every job holds ``Sampling`` as a :data:`refit.core.parsing.FLAT` section, so its fields are spelled without a prefix:
``--temperature 0.7 --top_k 20`` on the command line, ``temperature: 0.7`` in YAML and in a saved
``config.yaml``. (``rollout.temperature``, where PPO and distill kept it before, is read as a deprecated name.)
PPO's learner scores at the same ``temperature`` the engine sampled with; top-k/top-p/min-p and the repetition
penalty are the sampler's alone, as in TRL (the engine's ``rollout_logprobs`` are those of the processed
distribution; PPO corrects for the difference with ``mismatch_correction: tis``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import tyro

from refit.core.errors import RefitError
from refit.core.hf_folder import read_config
from refit.core.integrity import read_text
from refit.core.manifest import Manifest
from refit.core.parsing import FLAT, check, opt, parse


@dataclass(frozen=True)
class SamplingParams:
    """How to decode. Processing order follows HF: the repetition penalty, then temperature, top-k, top-p, min-p
    (refit.rollout.processors)."""

    max_new_tokens: int = 32  # response length cap (Tr <= max_new_tokens)
    temperature: float = 1.0  # logits / temperature before any truncation; > 0
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    top_p: float = 1.0  # nucleus: smallest set with cumulative prob >= top_p (top token always kept); 1 = off
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability (after top-k/top-p); 0 = off
    repetition_penalty: float = 1.0  # HF's: a seen token's logit x -> x / penalty (x > 0) or x * penalty; 1 = off
    greedy: bool = False  # argmax of the logits; rollout_logprobs are then 0.0 (a point mass)
    stop_ids: tuple[int, ...] = ()  # extra stop token ids besides the model's EOS
    n: int = 1  # samples per prompt; rows are prompt-major
    seed: int | None = None  # torch.Generator seed; None = nondeterministic
    return_topk: int = 0  # k > 0: also return the top-k plain log-probs/ids per generated position

    def __post_init__(self):
        object.__setattr__(self, "stop_ids", tuple(int(s) for s in self.stop_ids))
        problems = [
            (self.max_new_tokens < 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}"),
            (not self.temperature > 0, f"temperature must be > 0, got {self.temperature}"),
            (self.top_k < 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (not 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (not 0 <= self.min_p <= 1, f"min_p must be in [0, 1] (0 = off), got {self.min_p}"),
            (not self.repetition_penalty > 0, f"repetition_penalty must be > 0 (1 = off), got "
                                              f"{self.repetition_penalty}"),
            (self.n < 1, f"n (samples per prompt) must be >= 1, got {self.n}"),
            (self.return_topk < 0, f"return_topk must be >= 0, got {self.return_topk}"),
            (any(s < 0 for s in self.stop_ids), f"stop_ids must be token ids >= 0, got {self.stop_ids}"),
        ]
        for bad, msg in problems:
            if bad:
                raise ValueError(msg)

    @property
    def truncates(self) -> bool:
        """True when the sampled distribution differs from plain softmax(logits / temperature): greedy, or a logit
        processor on (top-k, top-p, min-p, a repetition penalty)."""
        return (self.greedy or self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0
                or self.repetition_penalty != 1.0)


Backend = Literal["onnxruntime", "torch", "tensorrt", "hf"]  # a job's engine backend


@dataclass(frozen=True)
class Sampling:
    """How the sampler draws tokens (HF's order: repetition penalty, temperature, top-k, top-p, min-p)."""

    temperature: float = opt(1.0, "divide the logits by this before sampling (> 0); PPO's learner scores at it too")
    top_k: int = opt(0, "sample among the k most likely tokens only (0: off); PPO corrects for the truncation "
                        "with mismatch_correction")
    top_p: float = opt(1.0, "nucleus sampling: the smallest set of tokens with this much probability (1: off)")
    min_p: float = opt(0.0, "drop tokens less likely than min_p x the most likely one, after top-k/top-p (0: off; "
                            "HF's MinPLogitsWarper)")
    repetition_penalty: float = opt(1.0, "a token already in the prompt or the completion has its logit x divided "
                                         "by this (x > 0) or multiplied by it (x < 0) before the temperature (1: off; "
                                         "HF's RepetitionPenaltyLogitsProcessor). Like top-k/top-p/min-p it is the "
                                         "sampler's alone: the learner scores at the temperature, as TRL")

    def params(self, max_new_tokens: int, **kw) -> SamplingParams:
        """The engine's :class:`SamplingParams` for this section; ``kw`` sets the call's own fields (``seed``,
        ``n``, ``stop_ids``, ``return_topk``, ``greedy``)."""
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature, top_k=self.top_k,
                              top_p=self.top_p, min_p=self.min_p, repetition_penalty=self.repetition_penalty, **kw)


@dataclass(frozen=True)
class RolloutSection:
    """The rollout engines: backend, threads, weight pushes and the probe after each (sampling: :class:`Sampling`)."""

    backend: Backend = opt("onnxruntime", "engine backend ('hf': transformers generate(), the PPO baseline)")
    engine_threads: int = opt(0, "engine intra-op threads (0 = runtime default)")
    engine_shards: int = opt(0, "onnxruntime: a generate call's rows cut at prompt boundaries into this many shards, "
                                "each decoded on a thread of its own over the same sessions (engine_threads shared "
                                "out among them, at least one each; rows unchanged); the reference engine scores "
                                "in as many row ranges. 0 = auto: one per engine thread for a small model at 16+ "
                                "rows a shard, else 1 (refit.rollout.decode.auto_shards; its data: "
                                "docs/engine-step.md)")
    sync_every: int = opt(1, "push weights into the engine every N steps (on-policy batches lag by at most N-1 "
                             "updates)")
    probe_tol: float = opt(1e-3, "max |logprob diff| engine vs learner on the probe batch after a push")
    quantize: Literal["auto", "none", "int8"] = opt(
        "auto", "rollout engine precision: auto is int8 for a LoRA run (the frozen base quantized once at export, the "
                "adapter fp32 on top) on the onnxruntime backend where the CPU has int8 dot-product units (VNNI, "
                "AMX-int8, arm64 dotprod), else none; run.precision fp32 makes auto none (refit.learner.run.precision). "
                "int8 runs the engine's linear layers in int8 (export --quantize int8; "
                "onnxruntime: int8 matmuls; tensorrt: int8 weights through Q/DQ, fp32 matmuls), pushes re-quantized; the probe then compares the engine with the learner's "
                "weights quantized the same way, the reference and KL stay fp32, and PPO's mismatch_correction "
                "'auto' becomes tis")
    push_via: Literal["memory", "file"] = opt(
        "memory", "onnxruntime: how a weight push reaches the engine. memory: the mapped weights handed to ONNX "
                  "Runtime, which copies them (fastest; the push briefly holds ~2x the model more); file: written "
                  "one tensor at a time to a scratch graph beside the engine folder, which ONNX Runtime maps (a "
                  "write of the model per push, and far less memory: docs/families.md)")
    probe_size: int = opt(4, "rows in the fixed probe batch")
    probe_tokens: int = opt(16, "response tokens per probe row (0: the full response length). The probe's learner "
                                "forward is most of a push's cost; a short probe still runs every weight and checks "
                                "every push")
    max_staleness: int = opt(
        0, "PPO: 0 = generate, then update (synchronous); k >= 1 = generate the next batch on a background thread "
           "while the learner updates on this one (one batch in flight, so a batch is one weight push behind the "
           "learner); a batch more than k pushes older than the learner's weights is refused in one line. The "
           "engine gets rollout.engine_threads intra-op threads (0: half of torch's), the learner the rest; every "
           "push waits for the generation in flight and is checked on the probe batch; mismatch_correction 'auto' "
           "becomes tis (the engine's log-probs are the behaviour policy)")

    def __post_init__(self):
        check([(self.engine_shards > 1 and self.backend != "onnxruntime",  # (0, auto: 1 on other backends)
                f"rollout.engine_shards = {self.engine_shards} needs rollout.backend onnxruntime (the {self.backend} "
                "backend decodes a call's rows in one loop)")])


# ------------------------------------------------------------------ the commands' lines, checked without torch
# The front door (refit/cli.py) parses and checks a command line here before the command's module imports torch,
# transformers or onnxruntime: a wrong flag, bad YAML or a missing folder is answered in well under a second.

@dataclass(frozen=True)
class ExportConfig:
    """Export an HF checkpoint folder (any AutoModelForCausalLM or AutoModelForSeq2SeqLM whose forward keeps a
    transformers Cache: GPT-2, Llama, Qwen2, Mistral, GPT-NeoX, Phi, OPT, T5, BART, Marian, ...) to an engine
    folder: ONNX graphs with a KV cache, refittable external weights, and manifest.json (I/O names, shape
    profiles, HF->engine weight map, hashes, parity figures, what the probe found). A model without a capability
    the engines need is refused in one line, before anything is written. Re-exporting the same weights with the
    same options reuses the folder."""

    model_dir: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="MODEL_DIR")] = opt(
        help_="HF checkpoint folder (config.json + model.safetensors + tokenizer)")
    out: Annotated[str, tyro.conf.arg(aliases=["-o"])] = opt(
        "", "engine folder to write, required (atomically: temp folder, then rename)")
    backend: Literal["onnxruntime", "tensorrt", "onnx"] = opt(
        "onnxruntime", "onnxruntime: ONNX graphs for ONNX Runtime; tensorrt: also build refittable TensorRT engines "
                       "(needs TensorRT and an NVIDIA GPU); onnx: the old name of onnxruntime (deprecated)")
    dtype: Literal["bf16", "fp16", "fp32"] = opt("fp32", "engine weight/activation precision")
    max_batch: int = opt(64, "largest batch (rows) the engine accepts")
    max_len: int = opt(512, "largest prompt + response length the engine accepts")
    parity_tol: float | None = opt(None, "max |log-prob| difference engine vs PyTorch (unset: 1e-4 fp32, "
                                         "5e-2 fp16, 1e-1 bf16)")
    attention: Literal["auto", "fused", "plain"] = opt(
        "auto", "decoder attention: fused (ONNX Runtime GroupQueryAttention over one preallocated KV buffer per "
                "layer, written in place), plain (standard ops; what TensorRT builds from), auto (fused where it "
                "applies and passes the parity gate, else plain; recorded in the manifest)")
    lora: tuple[str, ...] = opt((), "LoRA-ready engine: the layers these PEFT target_modules name ('all-linear' or "
                                    "module names) take an adapter as bound inputs (off until pushed); empty: none")
    quantize: Literal["none", "int8"] = opt(
        "none", "int8: linear layers in int8 (ONNX Runtime CPU: MatMulInteger, per-column int8 weights, per-row int8 "
                "activations; --backend tensorrt: weight-only int8 through DequantizeLinear, fp32 matmuls), weight "
                "pushes re-quantized; parity-gated against PyTorch on the same quantized weights, the gap to fp32 "
                "recorded in the manifest")
    round_weights: Literal["none", "bf16"] = opt(
        "none", "bf16: the checkpoint's weights rounded to bf16 values before the export (graphs stay --dtype): the "
                "engine of a LoRA run with lora.base_dtype bf16, whose learner holds that base")
    overwrite: bool = opt(False, "replace an engine folder exported from other weights (without it: refused); an "
                                 "HF model or a run folder is never written over")


def parse_export(argv: list[str] | None) -> ExportConfig:
    """``refit export``'s flags, and its model folder read as a checkpoint (config.json, weights) with no torch."""
    a, _ = parse(ExportConfig, argv, "refit export")
    read_config(a.model_dir)  # missing, not a checkpoint, a Hub id: one line
    if not a.out:
        raise RefitError("give the engine folder to write: -o OUT_DIR")
    return a


@dataclass(frozen=True)
class GenerateConfig:
    """Sample completions from an engine folder (padded batch, per-token log-probs); prints each completion with
    its mean log-prob under the policy at --temperature."""

    engine_dir: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="ENGINE_DIR")] = opt(
        help_="engine folder written by `refit export` (manifest.json, graphs, tokenizer/)")
    prompt: Annotated[tuple[str, ...], tyro.conf.UseAppendAction, tyro.conf.arg(metavar="TEXT")] = opt(
        (), "a prompt; repeat the flag for a padded batch of several prompts")
    prompts_file: Annotated[str, tyro.conf.arg(metavar="F")] = opt(
        "", "a text file with one prompt per line (blank lines skipped)")
    backend: Literal["onnxruntime", "torch", "tensorrt"] = opt(
        "onnxruntime", "generation backend: onnxruntime (the engine's ONNX graphs), torch (reference: the HF source "
                       "model of the engine), tensorrt (NVIDIA only)")
    device: Literal["cpu", "cuda"] = opt("cpu", "onnxruntime execution device")
    max_new_tokens: int = opt(32, "most tokens generated per completion")
    sampling: Annotated[Sampling, FLAT] = opt(help_="", factory=Sampling)  # --temperature, --top_k, --top_p
    greedy: bool = opt(False, "take the most likely token at every step (no sampling)")
    n: int = opt(1, "completions per prompt")
    seed: int | None = opt(None, "sampling seed (same seed, same tokens); default: random")
    json: bool = opt(False, "print one JSON line with every completion instead of text")


def prompts(a: GenerateConfig) -> list[str]:
    texts = list(a.prompt)
    if a.prompts_file:
        f = Path(a.prompts_file)
        if not f.is_file():
            raise RefitError(f"prompts file {f} does not exist")
        texts += [line.rstrip("\n") for line in read_text(f, "prompts file").splitlines() if line.strip()]
    if not texts:
        raise RefitError("no prompts: give --prompt TEXT (repeatable) or --prompts-file F")
    return texts


def parse_generate(argv: list[str] | None) -> tuple[GenerateConfig, SamplingParams, list[str]]:
    """``refit generate``'s flags, its sampling and prompts, and its engine folder's manifest, with no torch."""
    a, _ = parse(GenerateConfig, argv, "refit generate")
    try:
        sampling = a.sampling.params(a.max_new_tokens, greedy=a.greedy, n=a.n, seed=a.seed)
    except ValueError as e:
        raise RefitError(str(e)) from None
    texts = prompts(a)
    Manifest.read(Path(a.engine_dir))  # one clear line when the folder is not an engine
    return a, sampling, texts
