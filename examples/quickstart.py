"""Speculative decoding with an unchanged `generate` call: plain vs speculative=True, side by side.

python examples/quickstart.py
"""

from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_specdec  # adds `speculative=` to generate() and pipelines
from hf_specdec.core.timing import clock  # reads the clock once the device has done its work
from hf_specdec.lossless import check_greedy

path = hf_specdec.demo_model_path()  # SmolLM2-135M-Instruct, built offline on first use
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)  # the checkpoint's dtype, bf16, as transformers 5 loads it

article = (
    "The library opens at nine on weekdays and at ten on Saturdays. The library is closed on Sundays. "
    "Members can borrow five books at a time, and books are due back after three weeks."
)
messages = [{"role": "user", "content": f"Answer from the text: when does the library open?\n\n{article}"}]
inputs = tokenizer.apply_chat_template(
    messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
)

start = clock(model.device)
plain = model.generate(**inputs, max_new_tokens=64, do_sample=False)
plain_s = clock(model.device) - start

start = clock(model.device)
out = model.generate(
    **inputs, max_new_tokens=64, do_sample=False, speculative=True, return_dict_in_generate=True
)
spec_s = clock(model.device) - start

print(tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
print(out.speculative_stats)
check = check_greedy(model, inputs["input_ids"], plain, out.sequences, inputs["attention_mask"])[0]
print(f"vs plain greedy generate: {check.describe()}; {plain_s / spec_s:.2f}x faster")
