"""Train an EAGLE head for a model with no smaller sibling, then draft with it.

python examples/train_head.py [--minutes 30]

The head learns from the target's own greedy answers to the Spec-Bench prompts that
`hf-specdec bench --suite specbench-quick` does not use (needs ../shared/data, or HF_SPECDEC_DATA).
A second run with the same folder resumes, and reuses the generated answers and features.
"""

import argparse

from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_specdec
from hf_specdec.train import TrainConfig, train_draft

parser = argparse.ArgumentParser()
parser.add_argument("--minutes", type=float, default=30)
parser.add_argument("--out", default="smollm2-eagle-head")
args = parser.parse_args()

path = hf_specdec.demo_model_path()
log = train_draft(path, args.out, config=TrainConfig(method="eagle", minutes=args.minutes))
print("held-out estimate:", log["history"][-1])

tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)  # the checkpoint's dtype (bf16)
messages = [{"role": "user", "content": "Explain in three sentences why the sky is blue."}]
inputs = tokenizer.apply_chat_template(
    messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
)
out = model.generate(
    **inputs,
    max_new_tokens=96,
    do_sample=False,
    speculative=dict(method="eagle", draft=args.out),
    return_dict_in_generate=True,
)
print(tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
print(out.speculative_stats)
