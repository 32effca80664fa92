"""The trained model out of a run, as a user loads it elsewhere:

    OUTPUT_DIR/final/                         save_pretrained folder: config, weights, generation config,
                                              tokenizer (with its chat template); AutoModelForCausalLM /
                                              AutoModelForSeq2SeqLM.from_pretrained loads it as is
    OUTPUT_DIR/final/adapter/                 a LoRA run's adapter, a PEFT folder (PeftModel.from_pretrained over
                                              the base); final/ itself then holds the base with it merged in
    OUTPUT_DIR/final_engine/                  a fresh engine folder exported from final/ (parity-gated)
    OUTPUT_DIR/final_value_head.safetensors   PPO's value head (``summary.weight``, ``summary.bias``), beside
                                              the HF folder, never inside its weights

``final/`` is written into a temporary folder and renamed, so a crash never leaves half a folder under that
name. When the chat template ends turns with its own token, the generation config lists it as an EOS too,
so ``model.generate`` stops where the engine stopped.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from pathlib import Path

from refit.core.contract import ENGINE_BACKENDS
from refit.core.errors import RefitError
from refit.core.integrity import HOLDS, atomic_folder, folder_holds
from refit.core.manifest import MANIFEST, Manifest
from refit.learner.run.folder import read_record
from refit.learner.run.lora import adapts_tied_head, holds_low_precision, is_lora, merged_state, save_adapter, untied
from refit.rollout.build import ExportOptions, build, guard_engine  # engine folders' one entry point

FINAL, FINAL_ENGINE, VALUE_HEAD = "final", "final_engine", "final_value_head.safetensors"
ADAPTER = "adapter"  # final/adapter: a LoRA run's adapter as a PEFT folder (PeftModel.from_pretrained)


def save_final_model(run_dir: Path, model, tok, stop_ids: tuple[int, ...] = ()) -> Path:
    """``model`` and ``tok`` as ``run_dir/final`` (atomic rename); the path."""
    run_dir = Path(run_dir)
    final = run_dir / FINAL
    with atomic_folder(final) as tmp:
        if is_lora(model):  # final/adapter: the PEFT folder; final/: the base with the adapter merged in
            save_adapter(model, tmp / ADAPTER)
            tok.save_pretrained(str(tmp / ADAPTER))
            base = model.get_base_model()
            with untied(base.config) if adapts_tied_head(model) else nullcontext():
                base.save_pretrained(str(tmp), state_dict=merged_state(model))
                if holds_low_precision(base):  # a bf16 base (lora.base_dtype): merged_state wrote fp32, as says the
                    held, base.config.dtype = base.config.dtype, "float32"  # config (save_pretrained wrote bf16)
                    base.config.save_pretrained(str(tmp))
                    base.config.dtype = held
            model = base
        else:
            model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
        gen = getattr(model, "generation_config", None)
        if gen is not None and stop_ids:  # the saved generation config gets the end-of-turn token as an EOS too
            gen = copy.deepcopy(gen)
            eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
            gen.eos_token_id = [e for e in eos if e is not None] + [s for s in stop_ids if s not in eos]
            gen.save_pretrained(str(tmp))
    return final


def write_final(run_dir: Path, model, tok, value_head=None, backend: str = "onnxruntime", rows: int = 64,
                max_len: int = 128, stop_ids: tuple[int, ...] = (), log=print) -> Path:
    """final/, final_engine/ (``backend``'s engine; ONNX for the PyTorch backends) and the value head; final/."""
    from safetensors.torch import save_file

    run_dir = Path(run_dir)
    final = save_final_model(run_dir, model, tok, stop_ids)
    if value_head is not None:
        save_file({k: v.detach().cpu().contiguous() for k, v in value_head.state_dict().items()},
                  str(run_dir / VALUE_HEAD))
    engine_backend = backend if backend in ENGINE_BACKENDS else "onnxruntime"
    opts = ExportOptions(max_batch=max(rows, 64), max_len=max(max_len, 128))
    _clear_own_engine(run_dir, final, log)
    build(final, run_dir / FINAL_ENGINE, engine_backend, opts, log=log)
    log(f"refit: final model {final} (from_pretrained), engine {run_dir / FINAL_ENGINE}"
        + (f", value head {run_dir / VALUE_HEAD}" if value_head is not None else ""))
    return final



def export_final_again(run_dir: Path, log=print) -> Path | None:
    """``run_dir/final_engine`` exported again from ``run_dir/final`` after final/'s weights changed (the TRL
    facade's load_best_model_at_end), with the options its manifest records: never left holding other weights
    than final/. None when the run wrote no final engine."""
    run_dir = Path(run_dir)
    engine = run_dir / FINAL_ENGINE
    if not (engine / MANIFEST).is_file():
        return None
    opts = dict(Manifest.read(engine).options)
    opts["lora"] = tuple(opts.get("lora") or ())
    opts = ExportOptions(**{k: v for k, v in opts.items() if k in ExportOptions.__dataclass_fields__})
    _clear_own_engine(run_dir, run_dir / FINAL, log)
    return build(run_dir / FINAL, engine, opts.backend, opts, log=log)

def _clear_own_engine(run_dir: Path, final: Path, log) -> None:
    """An extended run (--resume with more steps) ends again: the final_engine its earlier end exported holds that
    end's weights. It is the run's own (its record does not list it as found there), so it is removed to be
    exported afresh from this end's final/; one the run did not write is never touched."""
    engine = run_dir / FINAL_ENGINE
    holds = folder_holds(engine)
    if holds in ("missing", "empty"):
        return
    record = read_record(run_dir) or {}
    if holds != "engine" or FINAL_ENGINE in record.get("foreign", []):
        raise RefitError(f"{engine} holds {HOLDS.get(holds, 'an engine')} that this run did not write; the final "
                         f"model is in {final}: move {engine} away, then export it (refit export {final} -o "
                         f"{engine})")
    guard_engine(final, engine, overwrite=True, log=lambda *_: None)  # removed under its lock when not final/'s
    if not engine.exists():
        log(f"refit: replacing {engine} (exported at the run's earlier end) with an export of this end's model")
