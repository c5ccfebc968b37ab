"""A draft source of your own, in this one file: subclass `Drafter`, register it by name, and ask for it
with `SpeculativeConfig(method=<its name>)`. Nothing in hf_specdec changes.

python examples/custom_drafter.py [MODEL_FOLDER]   (default: the offline demo model, SmolLM2-135M)

The drafter guesses that the text keeps repeating its last few tokens ("go, go, go,"). It is right on
chants and rows of stars and wrong on most other text; the output is plain greedy decoding's either
way, since the target verifies every draft token.
"""

import sys
from typing import ClassVar

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_specdec
from hf_specdec import SpeculativeConfig
from hf_specdec.drafters import Draft, Drafter, DraftRequest, register_drafter
from hf_specdec.lossless import MISMATCH, check_greedy


@register_drafter
class RepeatDrafter(Drafter):
    """Continues the shortest cycle of up to 4 tokens that the row's text ends in twice, or repeats
    its last token."""

    name: ClassVar[str] = "repeat"  # SpeculativeConfig(method="repeat")
    takes_draft: ClassVar[bool] = False  # drafts from the text alone: a draft= given is refused
    max_period: ClassVar[int] = 4

    @classmethod
    def from_config(cls, config, target, tokenizer):
        # One drafter per generate call: what it learnt during the call would live in the instance.
        return cls()

    def propose(self, request: DraftRequest) -> Draft:
        drafts = []
        for b, budget in enumerate(request.max_tokens):
            row = request.row(b)[0].tolist()
            periods = range(1, self.max_period + 1)
            period = next((p for p in periods if len(row) >= 2 * p and row[-p:] == row[-2 * p : -p]), 1)
            drafts.append([row[-period + i % period] for i in range(budget)])
        # Row b proposes max_tokens[b] tokens; the columns past a row's length are padding (0).
        width = max(request.max_tokens, default=0)
        tokens = torch.tensor([d + [0] * (width - len(d)) for d in drafts], dtype=torch.long)
        return Draft(tokens.to(request.tokens.device), [len(d) for d in drafts])


path = sys.argv[1] if len(sys.argv) > 1 else hf_specdec.demo_model_path()
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # fast on any CPU
inputs = tokenizer("The crowd chanted: go, go, go, go, go,", return_tensors="pt")

plain = model.generate(**inputs, max_new_tokens=40, do_sample=False)
out = model.generate(
    **inputs,
    max_new_tokens=40,
    do_sample=False,
    # A fixed draft length: the default ("auto") may find that verifying wider never pays on a CPU.
    speculative=SpeculativeConfig(method="repeat", num_draft_tokens=4),
    return_dict_in_generate=True,
)
print(tokenizer.decode(out.sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))
print(out.speculative_stats)
check = check_greedy(model, inputs["input_ids"], plain, out.sequences, inputs["attention_mask"])[0]
print(f"vs plain greedy generate: {check.describe()}")
if check.kind == MISMATCH:
    sys.exit(1)
