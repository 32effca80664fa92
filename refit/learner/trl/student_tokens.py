"""The tokenizer options ``GKDConfig`` inherits from TRL's ``SFTConfig`` (``eos_token``, ``chat_template_path``),
applied as TRL 1.16's ``SFTTrainer.__init__`` applies them, and written into the run's copy of the student folder.

The engine is exported from the student folder and the learner reads its tokenizer from there, so the options live
in a folder: OUTPUT_DIR/model, a copy of the student (weight files hard-linked where the file system allows,
everything else copied, then the changed tokenizer, ``config.json`` and ``generation_config.json`` written over the
copies) made atomically; the folder the script named is never written. A model object is saved there first
(:func:`refit.learner.trl.common.resolve_model`); its config and ``generation_config``, and a ``processing_class``
passed in, are changed in place, as TRL changes them.

- ``eos_token``: must be in the vocabulary (else one line, TRL's ValueError); the tokenizer's EOS, the config's
  ``eos_token_id``, and prepended to ``generation_config.eos_token_id`` (the old ids kept). The distillation job
  stops generation at the config's EOS, the template's end of turn and every ``generation_config`` EOS id
  (:func:`refit.learner.run.chat.stop_ids_of`), as TRL's GKDTrainer generates with ``generation_config``'s.
- ``chat_template_path``: a ``.jinja`` / ``.j2`` file becomes ``tokenizer.chat_template``; any other path is a
  tokenizer folder whose template TRL's ``clone_chat_template`` copies, with its EOS (the config's and
  ``generation_config``'s, replaced), after adding its special tokens and resizing the embeddings to a multiple of
  64. That is taken when it leaves the vocabulary as it is; a clone that adds tokens or resizes is refused in one line
  (TRL's new rows are drawn at random, and a resized student no longer matches its teacher's vocabulary, which
  TRL's GKDTrainer refuses too).
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import Any

from refit.core.errors import RefitError
from refit.core.integrity import atomic_folder, link_or_copy

_WEIGHTS = (".safetensors", ".bin")  # hard-linked: never written in the copy (a link's file is the original's)
_PAD_TO = 64  # clone_chat_template's resize_to_multiple_of default in TRL 1.16


def student_with_tokens(args: Any, student_dir: str, out: Path, tok: Any = None, model: Any = None) -> str:
    """The student folder the run uses: ``student_dir`` itself when ``args`` sets neither ``eos_token`` nor
    ``chat_template_path``, else ``out`` holding its copy with them applied (TRL's order: the EOS, then the
    template). ``tok``: the script's ``processing_class`` (changed in place), else the folder's; ``model``: a model
    object the script passed (its config and generation_config changed in place)."""
    from transformers import AutoConfig, AutoTokenizer

    eos, template = getattr(args, "eos_token", None), getattr(args, "chat_template_path", None)
    if eos is None and template is None:
        return student_dir
    name = type(args).__name__
    if not student_dir:
        raise RefitError(f"{name}: eos_token / chat_template_path need the student as a folder or a PreTrainedModel "
                         "(the embedded pair is built by the job with its own tokenizer)")
    if model is None and Path(student_dir).resolve() == Path(out).resolve():
        raise RefitError(f"{name}: the student folder {student_dir} is where the run writes its copy with eos_token / "
                         "chat_template_path: move it, or use another output_dir")
    tok = tok if tok is not None else AutoTokenizer.from_pretrained(student_dir)
    own = model is not None and hasattr(model, "config") and getattr(model, "generation_config", None) is not None
    config = model.config if own else AutoConfig.from_pretrained(student_dir)
    gen = model.generation_config if own else generation_config_of(student_dir, config)
    if eos is not None:
        set_eos(eos, tok, config, gen, name)
    if template is not None:
        set_chat_template(str(template), tok, config, gen, name)
    write_student(Path(student_dir), Path(out), tok, config, gen)
    return str(out)


def generation_config_of(folder: str | Path, config: Any):
    """The folder's ``GenerationConfig`` as ``from_pretrained`` gives a model: its generation_config.json, else the
    one transformers derives from ``config``."""
    from transformers import GenerationConfig

    if (Path(folder) / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(str(folder))
    return GenerationConfig.from_model_config(config)


def set_eos(eos: str, tok: Any, config: Any, gen: Any, name: str) -> None:
    """TRL 1.16's ``eos_token`` (SFTTrainer.__init__): in the vocabulary, else one line; the tokenizer's EOS, the
    text config's ``eos_token_id``, and prepended to ``generation_config.eos_token_id`` unless already there."""
    if eos not in tok.get_vocab():
        raise RefitError(f"{name}: eos_token={eos!r} is not in the vocabulary of the student's tokenizer "
                         f"({type(tok).__name__}); as TRL, the eos_token must be a token the tokenizer has")
    tok.eos_token = eos
    config.get_text_config().eos_token_id = tok.eos_token_id
    ids = gen.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tok.eos_token_id not in ids:
        gen.eos_token_id = [tok.eos_token_id, *ids]


def set_chat_template(path: str, tok: Any, config: Any, gen: Any, name: str) -> None:
    """TRL 1.16's ``chat_template_path``: a ``.jinja`` / ``.j2`` file's text becomes the template; a tokenizer folder's
    template is cloned (:func:`clone_template`)."""
    if os.path.isfile(path) and path.endswith((".jinja", ".j2")):
        tok.chat_template = Path(path).read_text(encoding="utf-8")
        return
    clone_template(path, tok, config, gen, name)


def clone_template(path: str, tok: Any, config: Any, gen: Any, name: str) -> None:
    """TRL's ``clone_chat_template(model, tok, path)`` where it leaves the vocabulary as it is: the source's template
    and EOS (the config's ``eos_token_id`` and ``generation_config.eos_token_id`` set to it alone). A clone that
    would add tokens, resize the embeddings or add TRL's ``<extra_id_N>`` fillers is one line."""
    from transformers import AutoTokenizer

    what = f"{name}: chat_template_path={path!r}"
    if not (Path(path) / "tokenizer_config.json").is_file():
        raise RefitError(f"{what}: neither a .jinja / .j2 file nor a local tokenizer folder (Refit downloads nothing)")
    src = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not getattr(src, "chat_template", None):
        raise RefitError(f"{what}: that tokenizer has no chat template to clone (TRL fails there too)")
    vocab = tok.get_vocab()
    added = sorted({t.content for t in src.added_tokens_decoder.values() if t.content not in vocab})
    n = len(vocab) + len(added)
    size = math.ceil(n / _PAD_TO) * _PAD_TO  # clone_chat_template resizes to this, then fills the tokenizer to it
    rows = config.get_text_config().vocab_size
    if added or size != rows or size != n:
        why = (f"adds {len(added)} tokens ({', '.join(added[:3])}{', ...' if len(added) > 3 else ''}) and " if added
               else "") + (f"resizes the student's embeddings from {rows} to {size} rows (a multiple of {_PAD_TO})"
                           if size != rows else f"adds {size - n} <extra_id_N> tokens to fill {size} rows")
        raise RefitError(f"{what}: TRL's clone_chat_template {why}; Refit clones a template only when the vocabulary "
                         "stays as it is: save that template as a .jinja file (tokenizer.chat_template) and pass its "
                         "path")
    if src.eos_token not in vocab:
        raise RefitError(f"{what}: its eos_token {src.eos_token!r} is not in the student's vocabulary")
    tok.chat_template = src.get_chat_template()
    tok.eos_token = src.eos_token
    config.get_text_config().eos_token_id = tok.eos_token_id
    gen.eos_token_id = tok.eos_token_id


def write_student(src: Path, out: Path, tok: Any, config: Any, gen: Any) -> None:
    """``src``'s copy at ``out`` (may be ``src`` itself: a saved model object) with ``tok``, ``config`` and ``gen``
    saved over it, in one rename; weight files hard-linked (copied across file systems), the rest copied, so writing
    the copy never writes ``src``'s files; the tokenizer is read back to check it is the one set."""
    from transformers import AutoTokenizer

    with atomic_folder(out) as tmp:
        tmp.mkdir(parents=True)
        for f in sorted(src.iterdir()):
            if f.is_dir():
                shutil.copytree(f, tmp / f.name)
            elif f.suffix in _WEIGHTS:
                link_or_copy(f, tmp / f.name)
            else:
                shutil.copy2(f, tmp / f.name)
        tok.save_pretrained(str(tmp))
        config.save_pretrained(str(tmp))
        gen.save_pretrained(str(tmp))
        back = AutoTokenizer.from_pretrained(str(tmp))
        if (back.eos_token, back.chat_template, back.get_vocab()) != (tok.eos_token, tok.chat_template,
                                                                       tok.get_vocab()):
            raise RefitError(f"the student's tokenizer written to {out} loads back otherwise (EOS, chat template or "
                             "vocabulary): report this")
