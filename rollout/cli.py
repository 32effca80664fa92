"""``refit generate ENGINE_DIR --prompt TEXT``: sample completions from an engine folder.

Tokenises with the tokenizer saved in ``ENGINE_DIR/tokenizer`` (the engine itself takes token
ids), generates with the chosen backend and prints each completion with its mean log-prob
under the policy at the given temperature (``rollout_plain_logprobs``). ``--json`` prints one
JSON document on one line instead.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from export.errors import RefitError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="refit generate",
        description="Sample completions from an engine folder (padded batch, per-token log-probs); prints each "
                    "completion with its mean log-prob under the policy at --temperature.")
    p.add_argument("engine_dir", help="engine folder written by `refit export` (manifest.json, graphs, tokenizer/)")
    p.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                   help="a prompt; repeat the flag for a padded batch of several prompts")
    p.add_argument("--prompts-file", metavar="F", help="a text file with one prompt per line (blank lines skipped)")
    p.add_argument("--backend", choices=["onnxruntime", "torch", "tensorrt"], default="onnxruntime",
                   help="generation backend: onnxruntime (the engine's ONNX graphs), torch (reference: the HF source "
                        "model of the engine), tensorrt (NVIDIA only)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="onnxruntime execution device")
    p.add_argument("--max-new-tokens", type=int, default=32, help="most tokens generated per completion")
    p.add_argument("--temperature", type=float, default=1.0, help="divide the logits by this before sampling (> 0)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens only (0: off)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: the smallest set of tokens with this much probability (1: off)")
    p.add_argument("--greedy", action="store_true", help="take the most likely token at every step (no sampling)")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (same seed, same tokens); default: random")
    p.add_argument("--json", action="store_true", help="print one JSON line with every completion instead of text")
    return p


def _prompts(a) -> list[str]:
    texts = list(a.prompt)
    if a.prompts_file:
        f = Path(a.prompts_file)
        if not f.is_file():
            raise RefitError(f"prompts file {f} does not exist")
        texts += [line.rstrip("\n") for line in f.read_text().splitlines() if line.strip()]
    if not texts:
        raise RefitError("no prompts: give --prompt TEXT (repeatable) or --prompts-file F")
    return texts


def _tokenizer(engine_dir: Path):
    from transformers import AutoTokenizer

    path = engine_dir / "tokenizer"
    if not path.is_dir():
        raise RefitError(f"{engine_dir} has no tokenizer/ folder (was it written by `refit export`?)")
    return AutoTokenizer.from_pretrained(str(path))


def _records(batch, texts: list[str], tok) -> list[dict]:
    out = []
    stops = batch.stop_set()
    for r in range(batch.num_rows):
        m = batch.response_mask[r] > 0
        ids = batch.response_ids[r][m].tolist()
        n = max(1, len(ids))
        out.append({
            "prompt_index": int(batch.prompt_index[r]), "sample": r % batch.sampling.n,
            "prompt": texts[int(batch.prompt_index[r])], "completion": tok.decode(ids, skip_special_tokens=True),
            "token_ids": ids, "num_tokens": len(ids), "stopped": bool(ids and ids[-1] in stops),
            "mean_logprob": float(batch.rollout_plain_logprobs[r][m].sum()) / n,
            "mean_rollout_logprob": float(batch.rollout_logprobs[r][m].sum()) / n,
        })
    return out


def main(argv: list[str] | None = None) -> int:
    from rollout.engine import create_engine
    from rollout.types import SamplingParams

    a = parser().parse_args(argv)
    engine_dir = Path(a.engine_dir)
    try:
        sampling = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_k=a.top_k,
                                  top_p=a.top_p, greedy=a.greedy, n=a.n, seed=a.seed)
    except ValueError as e:
        raise RefitError(str(e)) from None
    texts = _prompts(a)
    from export.manifest import Manifest

    Manifest.read(engine_dir)  # one clear line when the folder is not an engine
    tok = _tokenizer(engine_dir)
    kw = {"device": a.device} if a.backend == "onnxruntime" else {}
    engine = create_engine(a.backend, engine_dir, **kw)
    try:
        batch = engine.generate([tok(t).input_ids for t in texts], sampling)
    finally:
        engine.close()
    recs = _records(batch, texts, tok)
    if a.json:
        print(json.dumps({"engine": str(engine_dir), "backend": a.backend, "weights_version": batch.weights_version,
                          "sampling": {k: v for k, v in vars(sampling).items()}, "completions": recs}))
        return 0
    for r in recs:
        tag = f"[{r['prompt_index']}.{r['sample']}]" if sampling.n > 1 else f"[{r['prompt_index']}]"
        print(f"{tag} {r['prompt']!r} -> {r['completion']!r}  (mean log-prob {r['mean_logprob']:.3f}, "
              f"{r['num_tokens']} tokens{', stopped' if r['stopped'] else ''})")
    return 0
