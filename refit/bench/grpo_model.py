"""The model of ``refit bench grpo``: a decoder-only chat model built locally (random weights, the chat tokenizer),
a local geometry or a published one by name, with EOS and the template's end-of-turn in its generation config; and
the ids that stop a completion on each side.

Built in a child process (``python -m refit.bench.grpo_model WORK GEOMETRY LAYERS``), so that the bench's own process
does not keep the model's memory during the runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from functools import partial
from pathlib import Path

from refit.core.errors import RefitError
from refit.learner.builtin.models import GEOMETRIES, build_chat_tokenizer, build_model
from refit.learner.builtin.published import PUBLISHED, build_published
from refit.learner.run.chat import end_of_turn_ids

ENCODER_DECODER = ("t5", "bart", "marian")


def slug(name: str) -> str:
    """'Qwen2.5 0.5B' -> 'qwen2.5-0.5b': a published geometry's name as a flag value."""
    return name.lower().replace(" ", "-")


def _recipe(work: Path, geometry: str, layers: int):
    """(the model's folder under ``work``, the function that builds it there)."""
    published = {slug(n): n for n, p in PUBLISHED.items() if p.decoder_start is None}
    tok = build_chat_tokenizer()
    if geometry in GEOMETRIES and GEOMETRIES[geometry].arch not in ENCODER_DECODER:
        return work / f"{geometry}-chat", partial(build_model, geometry, tokenizer=tok)
    if geometry in published:
        folder = work / f"{geometry}-{f'{layers}layers' if layers else 'full'}-chat"
        return folder, partial(build_published, published[geometry], n_layers=layers or None, tokenizer=tok)
    local = [g for g, v in GEOMETRIES.items() if v.arch not in ENCODER_DECODER]
    raise RefitError(f"unknown decoder-only geometry {geometry!r}; local: {', '.join(local)}; published: "
                     f"{', '.join(published)}")


def prepare_model(work: Path, geometry: str, layers: int, log=print) -> Path:
    """A decoder-only model with the chat tokenizer, built locally (random weights) unless already there: a local
    geometry (refit.learner.builtin.models) or a published one by :func:`slug` (depth ``layers``, 0: published).
    Built in a child process, so that the bench's own process does not keep the model's memory during the runs."""
    folder, _ = _recipe(work, geometry, layers)
    if not (folder / "config.json").exists():
        log(f"building {geometry} (random weights, chat tokenizer) in {folder}")
        r = subprocess.run([sys.executable, "-m", "refit.bench.grpo_model", str(work), geometry, str(layers)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise RefitError(f"building {geometry} failed: {' | '.join(r.stderr.strip().splitlines()[-2:])}")
    return folder


def build_into(work: Path, geometry: str, layers: int) -> Path:
    """Build the model of :func:`prepare_model` (written beside, then renamed into place)."""
    folder, make = _recipe(work, geometry, layers)
    tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    make(tmp)
    stop_at_end_of_turn(tmp)
    tmp.rename(folder)
    return folder


def stop_at_end_of_turn(folder: Path) -> None:
    """Write EOS and the template's end-of-turn into the folder's generation config, as released chat models do,
    so that transformers ``generate()`` (TRL's side) stops where Refit's engine does."""
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(folder)
    gen = GenerationConfig.from_pretrained(folder)
    gen.eos_token_id = [tok.eos_token_id, *end_of_turn_ids(tok)]
    gen.save_pretrained(folder)


def stops(model: Path) -> dict:
    """The token ids that end a completion on each side: Refit's (EOS and the template's end-of-turn) and TRL's
    (the tokenizer's EOS and the generation config's ``eos_token_id``)."""
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(model)
    eos = GenerationConfig.from_pretrained(model).eos_token_id if (model / "generation_config.json").exists() else None
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return {"refit": sorted({tok.eos_token_id, *end_of_turn_ids(tok)}), "trl": sorted({tok.eos_token_id, *eos})}



if __name__ == "__main__":  # prepare_model's child: python -m refit.bench.grpo_model WORK GEOMETRY LAYERS
    build_into(Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]))
