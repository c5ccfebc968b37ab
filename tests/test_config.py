"""`SpeculativeConfig`: a field says one thing, the old spellings keep working for a release with a
warning that names the new one, and the docstring's list of tree-growing drafters is the registry's.

Refusals of bad values are cases of tests/security/test_bad_input.py; here, the warning for settings
a call does not read (a tree setting where it drafts chains, ...), and its silence where it reads them.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import pytest
import torch

from hf_specdec import FixedDraftLength, SpeculativeConfig
from hf_specdec.config import DRAFT_CODE
from hf_specdec.drafters import DRAFTERS

from .conftest import assert_greedy_match

# Repeats, so that prompt lookup finds matches and grows tries.
PROMPT = torch.tensor([[6, 7, 8, 9, 10, 6, 7, 8, 9, 10, 6, 7]])


class _CountingPolicy(FixedDraftLength):
    """Drafts 2 tokens and counts how often it was asked."""

    def __init__(self) -> None:
        super().__init__(2)
        self.asked = 0

    def draft_length(self, batch_size: int) -> int:
        self.asked += 1
        return super().draft_length(batch_size)


def _generate(target, speculative):
    plain = target.generate(PROMPT, max_new_tokens=12, do_sample=False)
    out = target.generate(
        PROMPT, max_new_tokens=12, do_sample=False, speculative=speculative, return_dict_in_generate=True
    )
    assert_greedy_match(target, plain, out.sequences, input_ids=PROMPT)
    return out.speculative_stats


@pytest.mark.parametrize(
    "sentence, named_if",
    [
        (r"Drafters that grow trees:(.*?)\.(?: |$)", lambda cls: cls.supports_tree),
        (r"Drafters that take none \((.*?)\) refuse one given", lambda cls: not cls.takes_draft),
    ],
    ids=["tree", "draft"],
)
def test_the_docstring_names_exactly_the_drafters_it_says(sentence, named_if):
    """config.py sits below the drafters and cannot ask the registry, so it names them in prose."""
    doc = " ".join(SpeculativeConfig.__doc__.split())
    named = set(re.findall(r"`(\w+)`", re.search(sentence, doc).group(1)))
    builtin = {
        name
        for name, cls in DRAFTERS.items()
        if named_if(cls) and cls.__module__.startswith("hf_specdec.drafters.")
    }
    assert named == builtin, f"the docstring of SpeculativeConfig names {sorted(named)}"


def test_a_policy_object_goes_in_policy_and_is_used(target):
    policy = _CountingPolicy()
    stats = _generate(target, SpeculativeConfig(method="ngram", policy=policy))
    assert policy.asked == stats.target_forwards - 1  # every step after the prompt's
    assert max(stats.draft_lengths) == 2


def test_a_policy_as_num_draft_tokens_still_works_with_a_warning(target):
    policy = _CountingPolicy()
    with pytest.warns(
        DeprecationWarning, match=r"pass SpeculativeConfig\(policy=_CountingPolicy\(\.\.\.\)\)"
    ) as w:
        config = SpeculativeConfig(method="ngram", num_draft_tokens=policy)
    assert w[0].filename == __file__  # the warning points at the caller's line
    assert config.policy is policy and config.num_draft_tokens == "auto"
    _generate(target, config)
    assert policy.asked > 0


def test_tree_given_a_number_still_caps_the_nodes_with_a_warning():
    with pytest.warns(DeprecationWarning, match=r"pass tree=True, max_tree_nodes=5") as w:
        config = SpeculativeConfig(method="ngram", tree=5)
    assert w[0].filename == __file__
    assert config.tree is True and config.max_tree_nodes == 5


@pytest.mark.parametrize("tree", [True, "auto"])
def test_max_tree_nodes_caps_every_tree(target, tree):
    config = SpeculativeConfig(
        method="ngram", tree=tree, num_draft_tokens=6, max_tree_nodes=2, options={"min_ngram": 1}
    )
    stats = _generate(target, config)
    assert stats.tree_steps > 0
    assert max(stats.draft_lengths) == 2


def test_a_config_rebuilt_from_old_spellings_warns_once():
    """`dataclasses.replace` (as method resolution does) rebuilds from the fields as they now are."""
    policy = FixedDraftLength(3)
    with pytest.warns(DeprecationWarning):
        config = SpeculativeConfig(tree=4, num_draft_tokens=policy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = dataclasses.replace(config, method="ngram")
    assert (again.tree, again.max_tree_nodes, again.policy, again.num_draft_tokens) == (
        True,
        4,
        policy,
        "auto",
    )


def test_the_new_fields_come_last():
    """Fields given by position keep their meaning: the new ones were added at the end."""
    names = [f.name for f in dataclasses.fields(SpeculativeConfig)]
    assert names[:7] == [
        "method",
        "draft",
        "draft_tokenizer",
        "num_draft_tokens",
        "options",
        "tree",
        "trust_remote_code",
    ]


# A setting given that the call does not read draws one warning naming it and what to do
# (`SpeculativeConfig.warn_unused`, as transformers' `GenerationConfig.validate` warns about sampling
# flags under greedy decoding); where the call reads it, nothing is said.
UNREAD = "speculative= settings"


def _draft_model(draft, **fields):
    return dict(method="draft_model", draft=draft, num_draft_tokens=3, **fields)


# name -> (speculative= given the weak draft, generate's own arguments, the warning's line)
UNREAD_CASES = {
    "tree_top_k, chains": (
        lambda d: _draft_model(d, options={"tree_top_k": 2}),
        {},
        r"- options tree_top_k=2 shapes tree drafts, and this call drafts chains: pass tree=True",
    ),
    "tree_top_k, tree='auto' over a static cache": (
        lambda d: _draft_model(d, tree="auto", options={"tree_top_k": 2}),
        {"cache_implementation": "static"},
        r"- options tree_top_k=2 shapes tree drafts, and this call drafts chains",
    ),
    "max_tree_nodes, chains": (
        lambda d: dict(method="ngram", max_tree_nodes=4),
        {},
        r"- max_tree_nodes=4 shapes tree drafts, and this call drafts chains: pass tree=True",
    ),
    "min_confidence, sampled chains": (
        lambda d: _draft_model(d, options={"min_confidence": 0.3}),
        {"do_sample": True},
        r"- options min_confidence=0.3 stops greedy chain drafts .*this call samples chains.*: drop it, "
        r"or decode greedily \(do_sample=False\)",
    ),
    "trust_remote_code, prompt lookup": (
        lambda d: dict(method="ngram", trust_remote_code=True),
        {},
        r"method='ngram'.*\n- trust_remote_code=True lets a draft named by folder or repo .*this call loads "
        r"none.*: drop it",
    ),
    "trust_remote_code, a loaded draft": (
        lambda d: _draft_model(d, trust_remote_code=True),
        {},
        r"- trust_remote_code=True .*a loaded draft is used as it is",
    ),
    "suffix options, no corpus": (
        lambda d: dict(method="suffix", options={"max_corpus_tokens": 0, "min_match": 3}),
        {},
        r"- options min_match=3 tunes drafting from the corpus of earlier calls, and max_corpus_tokens=0 "
        r"keeps none",
    ),
    "compile_with_target, an eager target": (
        lambda d: _draft_model(d, options={"compile_with_target": False}),
        {},
        r"- options compile_with_target=False applies where the target decodes on a compiled static cache",
    ),
    "translation, one tokenizer": (
        lambda d: _draft_model(d, options={"translation": "text"}),
        {},
        r"- options translation='text' chooses how a draft of another tokenizer is translated, and this "
        r"draft's tokens are the target's: drop it",
    ),
}


def _call(target, speculative, **kwargs):
    torch.manual_seed(0)
    kwargs.setdefault("do_sample", False)
    return target.generate(PROMPT, max_new_tokens=4, speculative=speculative, **kwargs)


@pytest.mark.parametrize("case", list(UNREAD_CASES))
def test_a_setting_the_call_does_not_read_is_named_with_what_to_do(target, weak_draft, case):
    speculative, kwargs, line = UNREAD_CASES[case]
    with pytest.warns(UserWarning, match=UNREAD) as caught:
        _call(target, speculative(weak_draft), **kwargs)
    (warning,) = [w for w in caught if UNREAD in str(w.message)]
    assert re.search(line, str(warning.message)), str(warning.message)


# The same settings where the call reads them (or left at their defaults): not a word.
READ_CASES = {
    "tree_top_k, trees": (lambda d: _draft_model(d, tree=True, options={"tree_top_k": 2}), {}),
    "tree_top_k at its default, chains": (lambda d: _draft_model(d, options={"tree_top_k": 4}), {}),
    "max_tree_nodes, trees": (lambda d: dict(method="ngram", tree=True, max_tree_nodes=4), {}),
    "min_confidence, greedy chains": (lambda d: _draft_model(d, options={"min_confidence": 0.3}), {}),
    "min_confidence, sampled trees": (
        lambda d: _draft_model(d, tree=True, options={"min_confidence": 0.3}),
        {"do_sample": True},
    ),
    "suffix options, a corpus": (lambda d: dict(method="suffix", options={"min_match": 3}), {}),
}


@pytest.mark.parametrize("case", list(READ_CASES))
def test_a_setting_the_call_reads_draws_no_warning(target, weak_draft, case):
    speculative, kwargs = READ_CASES[case]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=UNREAD)
        _call(target, speculative(weak_draft), **kwargs)


def test_trust_remote_code_for_a_draft_named_by_folder_draws_no_warning(target, weak_draft, tmp_path):
    weak_draft.save_pretrained(tmp_path / "draft")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=UNREAD)
        _call(target, _draft_model(str(tmp_path / "draft"), trust_remote_code=True))


def test_every_unread_setting_of_a_call_is_in_one_warning(target, weak_draft):
    spec = _draft_model(weak_draft, trust_remote_code=True, options={"tree_top_k": 2, "min_confidence": 0.3})
    with pytest.warns(UserWarning, match=UNREAD) as caught:
        _call(target, spec, do_sample=True)
    (warning,) = [w for w in caught if UNREAD in str(w.message)]
    named = re.findall(r"^- (?:options )?(\w+)=", str(warning.message), flags=re.MULTILINE)
    assert named == ["trust_remote_code", "min_confidence", "tree_top_k"]


def test_the_drafters_named_as_reading_trust_remote_code_are_those_that_do():
    """config.py sits below the drafters and cannot ask the registry, so it names them in prose."""
    named = set(re.findall(r"'(\w+)'", DRAFT_CODE.unread)) - {"auto"}
    builtin = {
        name
        for name, cls in DRAFTERS.items()
        if cls.takes_trust_remote_code and cls.__module__.startswith("hf_specdec.drafters.")
    }
    assert named == builtin
