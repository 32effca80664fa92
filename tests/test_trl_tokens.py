"""GKDConfig's tokenizer fields from TRL's SFTConfig (``eos_token``, ``chat_template_path``, ``pad_token``) on
the GKD facade, each against what TRL 1.16's SFTTrainer.__init__ computes, done here with transformers directly:
the run's copy of the student holds TRL's tokenizer, config and generation_config, a new EOS ends the student's
completions, a .jinja template encodes the prompts as apply_chat_template with it does, and the folder the script
named is never written."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch

from refit.core.errors import RefitError

JINJA = ("{% for m in messages %}<bos>{{ m['role'] }}: {{ m['content'] }}<eos>{% endfor %}"
         "{% if add_generation_prompt %}<bos>assistant: {% endif %}")


def _hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _trainer(student, out: Path, teacher=None, rows=None, processing_class=None, **kw):
    import datasets

    from refit.learner.trl import GKDConfig, GKDTrainer

    rows = rows or [{"prompt": f"{a}+{a}=", "completion": str(2 * a)} for a in range(4)]
    args = GKDConfig(output_dir=str(out), per_device_train_batch_size=2, max_steps=1, max_new_tokens=4, lmbda=1.0,
                     use_cpu=True, disable_tqdm=True, **kw,
                     refit={"rollout.backend": "torch", "eval_size": 2, "export_final": False, "log.plots": False,
                            "rollout.probe_size": 2})
    return GKDTrainer(model=student, teacher_model=teacher or student, args=args, processing_class=processing_class,
                      train_dataset=datasets.Dataset.from_list(rows))


def test_eos_token_is_set_as_trl_sets_it_in_a_copy_of_the_student(model_dirs, tmp_path):
    """TRL: tokenizer.eos_token, config.eos_token_id, the id prepended to generation_config.eos_token_id; a
    processing_class passed in is changed in place; the named folder is untouched; pad_token is taken and changes
    nothing (TRL 1.16's GKDTrainer never reaches SFTTrainer's pad_token step)."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from refit.learner.run.chat import stop_ids_of

    src = model_dirs["tiny-gpt2"]
    before = _hashes(src)
    want_tok, want_cfg, want_gen = (AutoTokenizer.from_pretrained(src), AutoConfig.from_pretrained(src),
                                    GenerationConfig.from_pretrained(src))
    old = want_gen.eos_token_id
    want_tok.eos_token = "+"  # TRL's steps, by hand
    want_cfg.eos_token_id = want_tok.eos_token_id
    want_gen.eos_token_id = [want_tok.eos_token_id, *([old] if isinstance(old, int) else old)]
    given = AutoTokenizer.from_pretrained(src)
    trainer = _trainer(str(src), tmp_path / "o", processing_class=given, eos_token="+", pad_token="<nope>")
    copy = Path(trainer.config.student.model_dir)
    assert copy == tmp_path / "o" / "model" and trainer.config.teacher.model_dir == str(src)
    tok, cfg, gen = (AutoTokenizer.from_pretrained(copy), AutoConfig.from_pretrained(copy),
                     GenerationConfig.from_pretrained(copy))
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token) == (want_tok.eos_token, want_tok.eos_token_id, "<pad>")
    assert tok.get_vocab() == want_tok.get_vocab() and cfg.eos_token_id == want_cfg.eos_token_id
    assert gen.eos_token_id == want_gen.eos_token_id == [want_tok.eos_token_id, 1]
    assert stop_ids_of(tok, copy, cfg.eos_token_id) == (1,)  # the job stops at the new EOS and the old, as TRL
    assert (given.eos_token, given.pad_token) == ("+", "<pad>")  # in place, as TRL
    assert (copy / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert _hashes(src) == before


def test_eos_token_on_a_model_object_changes_its_config_in_place(model_dirs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    src = model_dirs["tiny-gpt2"]
    model, tok = AutoModelForCausalLM.from_pretrained(src), AutoTokenizer.from_pretrained(src)
    trainer = _trainer(model, tmp_path / "o", teacher=str(src), processing_class=tok, eos_token="+")
    plus = tok.convert_tokens_to_ids("+")
    assert (tok.eos_token, model.config.eos_token_id, model.generation_config.eos_token_id) == ("+", plus, [plus, 1])
    assert GenerationConfig.from_pretrained(trainer.config.student.model_dir).eos_token_id == [plus, 1]


def test_an_eos_token_outside_the_vocabulary_is_one_line(model_dirs, tmp_path):
    src = model_dirs["tiny-gpt2"]
    before = _hashes(src)
    with pytest.raises(RefitError, match=r"^GKDConfig: eos_token='<nope>' is not in the vocabulary of the student's "
                                         r"tokenizer [^\n]*$"):
        _trainer(str(src), tmp_path / "o", eos_token="<nope>")
    assert _hashes(src) == before and not (tmp_path / "o" / "model").exists()


def _plus_everywhere(src: Path, out: Path) -> Path:
    """A copy of ``src`` (tiny GPT-2) whose final norm's bias points along the embedding of '+' (id 14 here): every
    next token is '+' by a wide margin, so a completion runs to max_new_tokens unless '+' stops it."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    w = load_file(out / "model.safetensors")
    plus = 14
    w["transformer.ln_f.bias"] = 1000.0 * w["transformer.wte.weight"][plus]
    save_file(w, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_an_eos_token_in_the_vocabulary_ends_the_students_completions(model_dirs, tmp_path):
    """On-policy GKD (lmbda 1) with eos_token='+' on a student that always says '+': TRL's generate with its
    generation_config (eos [14, 1]) stops after one token, and so does every completion of the Refit run; without
    the option the same model runs to max_new_tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    student = _plus_everywhere(model_dirs["tiny-gpt2"], tmp_path / "student")
    tok = AutoTokenizer.from_pretrained(student)
    assert tok.convert_ids_to_tokens(14) == "+"
    model = AutoModelForCausalLM.from_pretrained(student)
    ids = tok("3+3=", return_tensors="pt").input_ids
    for eos, want in ((None, 4), ("+", 1)):  # TRL: model.generate with the model's generation_config, eos set or not
        gen = GenerationConfig.from_pretrained(student)
        if eos is not None:
            gen.eos_token_id = [14, gen.eos_token_id]
        gen.update(max_new_tokens=4, do_sample=False)
        with torch.no_grad():
            assert model.generate(ids, generation_config=gen).shape[1] - ids.shape[1] == want
    before = _hashes(student)
    trainer = _trainer(str(student), tmp_path / "o", teacher=str(model_dirs["tiny-gpt2"]), eos_token="+")
    trainer.train()
    assert trainer.state.log_history[0]["completions/mean_length"] == 1.0  # the stop token itself, as TRL's mask
    assert _hashes(student) == before


def test_a_jinja_template_encodes_the_prompts_as_apply_chat_template_with_it(chat_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from refit.learner.distill.batch import check_teacher_student
    from refit.learner.run.chat import encode_prompts

    before = _hashes(chat_model_dir)
    (tmp_path / "t.jinja").write_text(JINJA)
    rows = [{"messages": [{"role": "user", "content": f"{a}+{a}="}, {"role": "assistant", "content": str(2 * a)}]}
            for a in range(4)]
    trainer = _trainer(str(chat_model_dir), tmp_path / "o", rows=rows, chat_template_path=str(tmp_path / "t.jinja"))
    _, info, tok = check_teacher_student(trainer.config.teacher.model_dir, trainer.config.student.model_dir)
    assert tok.chat_template == JINJA
    prompts = [r["messages"][:1] for r in rows]
    got = encode_prompts(tok, prompts, info.max_positions, 4, "test", ())
    ref = AutoTokenizer.from_pretrained(chat_model_dir)
    want = [ref.apply_chat_template(p, chat_template=JINJA, add_generation_prompt=True, tokenize=True,
                                    return_dict=True)["input_ids"] for p in prompts]
    assert got == want and got != encode_prompts(ref, prompts, info.max_positions, 4, "test", ())
    assert ref.decode(got[0]) == "<bos>user: 0+0=<eos><bos>assistant: "
    assert _hashes(chat_model_dir) == before


def test_a_tokenizer_folders_template_is_cloned_when_the_vocabulary_stays(model_dirs, chat_model_dir, tmp_path):
    """TRL's clone_chat_template: the source's template and EOS (config and generation_config set to it alone); a
    source that would add tokens and resize the embeddings (384 -> 448 rows) is one line."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    src = model_dirs["tiny-gpt2"]
    source = AutoTokenizer.from_pretrained(src)
    source.chat_template, source.eos_token = JINJA, "<bos>"
    source.save_pretrained(tmp_path / "source")
    trainer = _trainer(str(src), tmp_path / "o", chat_template_path=str(tmp_path / "source"))
    copy = trainer.config.student.model_dir
    tok = AutoTokenizer.from_pretrained(copy)
    assert (tok.chat_template, tok.eos_token, AutoConfig.from_pretrained(copy).eos_token_id,
            GenerationConfig.from_pretrained(copy).eos_token_id) == (JINJA, "<bos>", 2, 2)
    with pytest.raises(RefitError, match=r"chat_template_path='.*': TRL's clone_chat_template adds 2 tokens "
                                         r"\(<\|im_end\|>, <\|im_start\|>\) and resizes the student's embeddings from "
                                         r"384 to 448 rows"):
        _trainer(str(src), tmp_path / "o2", chat_template_path=str(chat_model_dir))
