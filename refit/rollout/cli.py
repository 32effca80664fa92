"""``refit generate ENGINE_DIR --prompt TEXT``: sample completions from an engine folder.

Tokenises with the tokenizer saved in ``ENGINE_DIR/tokenizer`` (the engine itself takes token
ids), generates with the chosen backend and prints each completion with its mean log-prob
under the policy at the given temperature (``rollout_plain_logprobs``). ``--json`` prints one
JSON document on one line instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from refit.core.errors import RefitError
from refit.core.manifest import Manifest
from refit.export.guard import require_intact
from refit.export.onnx_export import weights_hash
from refit.rollout.config import GenerateConfig, SamplingParams, parse_generate
from refit.rollout.engine import create_engine


def _tokenizer(engine_dir: Path):
    from transformers import AutoTokenizer

    path = engine_dir / "tokenizer"
    if not path.is_dir():
        raise RefitError(f"{engine_dir} has no tokenizer/ folder (was it written by `refit export`?)")
    return AutoTokenizer.from_pretrained(str(path))


def check_engine_for_generate(engine_dir: Path, m, backend: str) -> None:
    """Refuse, in one line, an engine folder whose files no longer match its manifest; for ``--backend torch``
    (which runs the engine's source HF folder) refuse a source whose weights changed since the export: the
    completions would not be the engine's."""
    require_intact(engine_dir, m.source_model)
    if backend == "torch":
        src = Path(m.source_model)
        if src.is_dir() and weights_hash(src) != m.hashes.hf_weights_sha256:
            raise RefitError(f"--backend torch runs the source model {src}, whose weights changed since {engine_dir} "
                             f"was exported from it; re-export (refit export {src} -o {engine_dir} --overwrite) or "
                             "use --backend onnxruntime for the engine as exported")


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
    return run_generate(*parse_generate(argv))


def run_generate(a: GenerateConfig, sampling: SamplingParams, texts: list[str]) -> int:
    """``refit generate`` after :func:`~refit.rollout.config.parse_generate` checked its command line (no torch)."""
    engine_dir = Path(a.engine_dir)
    m = Manifest.read(engine_dir)
    check_engine_for_generate(engine_dir, m, a.backend)
    tok = _tokenizer(engine_dir)
    kw = {"device": a.device} if a.backend == "onnxruntime" else {}
    engine = create_engine(a.backend, engine_dir, **kw)
    ids = [tok(t).input_ids for t in texts]
    limit = m.dims.max_positions
    for i, p in enumerate(ids):  # the model's own limit, before the engine's max_len (a re-export cannot lift it)
        if limit is not None and len(p) + a.max_new_tokens > limit:
            engine.close()
            raise RefitError(f"prompt {i} is {len(p)} tokens; with --max_new_tokens {a.max_new_tokens} that exceeds "
                             f"the model's {limit} positions (a limit of the model, not of the engine): shorten the "
                             "prompt or lower --max_new_tokens")
    try:
        batch = engine.generate(ids, sampling)
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
