"""``refit build-model``: a small random-weight HF checkpoint folder (a named geometry), written safely.

The geometries, the tokenizer and the builder itself live in :mod:`refit.learner.builtin.models`; this is
the command: it writes only into a folder that is missing, empty, or (with ``--overwrite``) an HF model, and
through ``.OUT.tmp-PID`` renamed into place, so a failure (a full disk) leaves no half-written folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from refit.core.errors import RefitError
from refit.core.integrity import HOLDS, atomic_folder, clean_stale_temps, folder_holds
from refit.learner.builtin.models import GEOMETRIES, build_chat_tokenizer, build_model


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    print(build_model_cli(a.geometry, Path(a.out), a.seed, a.chat, a.overwrite))
    return 0


def parser() -> argparse.ArgumentParser:
    """``refit build-model``'s flags (tests/test_readme_tour.py parses the tour's lines with it)."""
    p = argparse.ArgumentParser(prog="refit build-model", description=build_model.__doc__)
    p.add_argument("geometry", choices=sorted(GEOMETRIES), help="named model geometry")
    p.add_argument("-o", "--out", required=True, help="output checkpoint folder")
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    p.add_argument("--chat", action="store_true", help="tokenizer with a ChatML-style chat template (<|im_start|>, "
                                                       "<|im_end|> added as special tokens)")
    p.add_argument("--overwrite", action="store_true", help="replace an HF model already in OUT (an engine or a run "
                                                            "folder is never written over)")
    return p


def build_model_cli(geometry: str, out: Path, seed: int, chat: bool, overwrite: bool) -> Path:
    """Build ``geometry`` into ``out`` only when it is missing, empty, or an HF model with ``overwrite``;
    written into ``.OUT.tmp-PID`` and renamed, so a failure (a full disk) leaves no half-written folder."""
    holds = folder_holds(out)
    if holds not in ("missing", "empty") and not (holds == "model" and overwrite):
        hint = "; pass --overwrite to replace it" if holds == "model" else ""
        raise RefitError(f"{out} holds {HOLDS[holds]}; refusing to write a model into it (choose another -o{hint})")
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_temps(out.parent, prefix=out.name + ".")
    with atomic_folder(out) as tmp:
        build_model(geometry, tmp, seed=seed, tokenizer=build_chat_tokenizer() if chat else None)
    return out
