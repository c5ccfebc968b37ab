"""Greedy identity on the real SmolLM2-135M with prompts we did not write (Spec-Bench)."""

from __future__ import annotations

import json

import pytest
import torch

from hf_specdec.bench.suites import data_dir

from ..conftest import assert_greedy_match

# Where `hf-specdec bench --suite specbench` reads it: `$HF_SPECDEC_DATA`, else shared/data beside
# the checkout.
SPECBENCH = data_dir() / "specbench" / "question.jsonl"
CATEGORIES = ("summarization", "rag", "translation", "qa", "math_reasoning", "coding", "writing")


def _specbench_prompts(per_category: int = 1) -> list[tuple[str, str]]:
    if not SPECBENCH.exists():
        return []
    taken: dict[str, int] = {}
    prompts = []
    for line in SPECBENCH.read_text().splitlines():
        item = json.loads(line)
        category = item["category"]
        if category in CATEGORIES and taken.get(category, 0) < per_category:
            taken[category] = taken.get(category, 0) + 1
            prompts.append((category, item["turns"][0]))
    return prompts


PROMPTS = _specbench_prompts()


def _chat(tokenizer, text: str, limit: int = 256):
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    # Long RAG/summarization articles are cut from the front to keep CI quick; the tail keeps the question.
    return {k: v[:, -limit:] for k, v in ids.items()}


@pytest.mark.skipif(not PROMPTS, reason=f"Spec-Bench prompts not found at {SPECBENCH}")
@pytest.mark.parametrize(("category", "text"), PROMPTS, ids=[c for c, _ in PROMPTS])
def test_ngram_greedy_matches_plain_on_specbench(smollm2, category, text):
    model, tokenizer = smollm2
    inputs = _chat(tokenizer, text)
    plain = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    spec = model.generate(**inputs, max_new_tokens=32, do_sample=False, speculative="ngram")
    assert_greedy_match(model, plain, spec)


@pytest.mark.skipif(len(PROMPTS) < 4, reason=f"Spec-Bench prompts not found at {SPECBENCH}")
def test_batched_ngram_matches_plain_batched_on_specbench(smollm2):
    model, tokenizer = smollm2
    tokenizer.padding_side = "left"
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": t[-600:]}], add_generation_prompt=True, tokenize=False
        )
        for _, t in PROMPTS[:4]
    ]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    plain = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    spec = model.generate(**inputs, max_new_tokens=32, do_sample=False, speculative="ngram")
    assert spec.shape == plain.shape
    assert_greedy_match(model, plain, spec, attention_mask=inputs["attention_mask"])


def test_draft_model_greedy_matches_plain(smollm2):
    """A bf16 copy of the target is a real (cheaper, 99%-agreeing) draft model."""
    model, tokenizer = smollm2
    draft = type(model).from_pretrained(model.name_or_path, dtype=torch.bfloat16).eval()
    inputs = _chat(tokenizer, "Write a short poem about the sea.")
    plain = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    out = model.generate(
        **inputs,
        max_new_tokens=32,
        do_sample=False,
        tokenizer=tokenizer,
        speculative=dict(method="draft_model", draft=draft, draft_tokenizer=tokenizer, num_draft_tokens=4),
        return_dict_in_generate=True,
    )
    assert_greedy_match(model, plain, out.sequences)
    assert out.speculative_stats.acceptance_rate > 0.8
