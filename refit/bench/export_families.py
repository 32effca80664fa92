"""The model families Refit is tested on, one tiny locally built checkpoint each, and the export half
of the family table (docs/families.md).

The exporter does not read this list (it decides from the config and a probe what a model needs,
:mod:`refit.export.capabilities`); tests and ``scripts/family_table.sh`` (``python -m refit.bench.families``) do, so every family is
exported, parity-gated and checked for TensorRT the same way. :func:`export_family` builds one
checkpoint (random weights, the local tokenizer), exports it and runs the CPU-side TensorRT checks;
the learner half of the table (PPO and distillation smokes) is in the script, since ``export``
never imports ``learner``.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path

from refit.core.errors import RefitError
from refit.core.manifest import Manifest
from refit.export.options import ExportOptions
from refit.learner.builtin.models import build_model
from refit.rollout.build import build, plain_twin
from refit.rollout.tensorrt.check import check_engine_folder

# family table name (docs/families.md) -> geometry in refit.learner.builtin.models.GEOMETRIES (2 layers, d_model 32-64)
FAMILIES: dict[str, str] = {
    "GPT-2": "tiny-gpt2",
    "Llama": "tiny-llama",
    "Qwen2": "tiny-qwen2",
    "Mistral (sliding window, GQA)": "tiny-mistral",
    "GPT-NeoX (partial rotary)": "tiny-neox",
    "Phi": "tiny-phi",
    "OPT": "tiny-opt",
    "T5": "tiny-t5",
    "BART": "tiny-bart",
    "Marian": "tiny-marian",
}
SEQ2SEQ = ("tiny-t5", "tiny-bart", "tiny-marian")


def export_family(geometry: str, root: Path, tokenizer, log=print) -> dict:
    """Build ``geometry``'s checkpoint under ``root``, export it, run trt_check; one record for the table."""
    model_dir = build_model(geometry, root / "models" / geometry, seed=0, tokenizer=tokenizer)
    engine_dir = root / "engines" / geometry
    rec = {"geometry": geometry, "model_dir": str(model_dir), "engine_dir": str(engine_dir)}
    t0 = time.perf_counter()
    try:
        build(model_dir, engine_dir, opts=ExportOptions(max_batch=16, max_len=128), log=log)
    except RefitError as e:
        return {**rec, "export": f"refused: {e}"}
    export_s = round(time.perf_counter() - t0, 1)
    m = Manifest.read(engine_dir)
    problems = check_engine_folder(plain_twin(model_dir, engine_dir, log=log))  # what TensorRT builds from
    return {**rec, "export": "ok", "export_s": export_s,
            "parity": m.parity.max_abs_logprob_diff, "attention": m.attention or "plain",
            "capabilities": asdict(m.capabilities),
            "trt_check": "ok" if not problems else f"{len(problems)} problem(s): {problems[0]}"}
