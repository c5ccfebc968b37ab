"""A batched text-generation pipeline with speculative decoding and its acceptance statistics.

python examples/batched_pipeline.py
"""

from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

import hf_specdec

path = hf_specdec.demo_model_path()
tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
model = AutoModelForCausalLM.from_pretrained(path)  # the checkpoint's dtype (bf16)
pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)

chats = [
    [{"role": "user", "content": "Repeat after me: speculative decoding keeps outputs exact."}],
    [{"role": "user", "content": "List three colours of the rainbow."}],
    [{"role": "user", "content": "Correct the spelling: 'The wheather is nise today.'"}],
]
for result in pipe(chats, max_new_tokens=40, do_sample=False, batch_size=3, speculative=True):
    print(result[0]["generated_text"][-1]["content"], "\n---")

# The same batch through generate(), to read the statistics.
texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
out = model.generate(
    **batch, max_new_tokens=40, do_sample=False, speculative="ngram", return_dict_in_generate=True
)
print(out.speculative_stats)
