"""A Medusa head scores with its target's LM head in the dtype its blocks compute in, whatever
dtype it ran in before."""

from __future__ import annotations

import torch

from ..conftest import assert_greedy_match, random_batch, tiny_llama
from ..helpers.heads import identity_medusa


def test_a_head_cast_to_another_dtype_after_use_drafts_in_it():
    """Used in fp32, then the target and its head cast to bf16 (`.to`, as users cast a model for
    speed): the LM head rows the head had kept in fp32 were multiplied with bf16 features and
    raised "expected m1 and m2 to have the same dtype"."""
    target = tiny_llama(30, layers=1)
    head = identity_medusa(target)
    input_ids, attention_mask = random_batch(seed=15, batch=2)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask)
    spec = dict(method="medusa", draft=head, num_draft_tokens=3)
    for dtype in (torch.float32, torch.bfloat16):
        target.to(dtype)
        head.to(dtype)
        with torch.no_grad():
            out = target.generate(**inputs, max_new_tokens=24, do_sample=False, speculative=spec)
            plain = target.generate(**inputs, max_new_tokens=24, do_sample=False)
        assert_greedy_match(target, plain, out, attention_mask)
