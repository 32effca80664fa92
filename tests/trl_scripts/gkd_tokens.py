"""GKD with the tokenizer fields GKDConfig takes from SFTConfig, as a TRL user writes them: eos_token (the chat
template's end of turn), chat_template_path (a .jinja file), pad_token.

    python gkd_tokens.py STUDENT_DIR TEACHER_DIR OUTPUT_DIR

The last stdout line is one JSON document: global_step, log_history, the tokenizer passed in, and the tokenizer,
config and generation_config the trained model is saved with.
"""

import json
import sys
from pathlib import Path

from datasets import Dataset
from transformers import AutoConfig, AutoTokenizer, GenerationConfig
from trl.experimental.gkd import GKDConfig, GKDTrainer

student_dir, teacher_dir, output_dir = sys.argv[1], sys.argv[2], sys.argv[3]
template = Path(f"{output_dir}.jinja")
template.write_text("{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
                    "{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}")
tokenizer = AutoTokenizer.from_pretrained(student_dir)
dataset = Dataset.from_list([{"messages": [{"role": "user", "content": f"{a}+{b}="},
                                           {"role": "assistant", "content": str(a + b)}]}
                             for a in range(5) for b in range(4)])
args = GKDConfig(output_dir=output_dir, per_device_train_batch_size=4, max_steps=2, learning_rate=1e-3, lmbda=0.5,
                 max_new_tokens=6, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                 disable_tqdm=True, seed=0, eos_token="<|im_end|>", chat_template_path=str(template),
                 pad_token="<eos>")
trainer = GKDTrainer(model=student_dir, teacher_model=teacher_dir, args=args, train_dataset=dataset,
                     processing_class=tokenizer)
trainer.train()
saved = f"{output_dir}-saved"
trainer.save_model(saved)
tok, config, gen = (AutoTokenizer.from_pretrained(saved), AutoConfig.from_pretrained(saved),
                    GenerationConfig.from_pretrained(saved))
print(json.dumps({"global_step": trainer.state.global_step, "log_history": trainer.state.log_history,
                  "given": [tokenizer.eos_token, tokenizer.pad_token, tokenizer.chat_template == template.read_text()],
                  "saved": [tok.eos_token, tok.pad_token, tok.chat_template == template.read_text()],
                  "eos_id": tok.eos_token_id, "config_eos": config.eos_token_id, "generation_eos": gen.eos_token_id}))
