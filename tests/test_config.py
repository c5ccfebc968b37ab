"""`SpeculativeConfig`: a field says one thing, the old spellings keep working for a release with a
warning that names the new one, and the docstring's list of tree-growing drafters is the registry's.

Refusals of bad values are cases of tests/security/test_bad_input.py.
"""

from __future__ import annotations

import dataclasses
import re
import warnings

import pytest
import torch

from hf_specdec import FixedDraftLength, SpeculativeConfig
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
