"""`speculative=True` prefers the model's own draft heads: a checkpoint carrying MTP layers drafts
with them (`method="mtp"`, nothing downloaded), and says so in `speculative_stats.selection` and
in `hf-specdec select`; layers that do not load (as `method="mtp"` loads them) are not chosen:
the choice is what comes after, with a warning saying why, and generate drafts with it."""

from __future__ import annotations

import argparse
import copy
import warnings

import pytest
import torch

from hf_specdec import clear_cache
from hf_specdec.selection.choice import auto_method
from hf_specdec.selection.method import DRAFT_FREE_AUTO
from hf_specdec.selection.select import select_draft

from ..helpers import assistant, mtp
from ..helpers.hub import local_hub


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return mtp.checkpoint(tmp_path_factory.mktemp("own"), "glm4_moe", agree=0.002)


def test_a_checkpoint_with_mtp_layers_drafts_with_them(folder, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing is looked up, nothing downloaded
    target = mtp.model_class("glm4_moe").from_pretrained(folder).eval()
    for chosen in (select_draft(target), select_draft(str(folder))):
        assert (chosen.method, chosen.draft, chosen.source) == ("mtp", None, "checkpoint")
        assert "model.layers.46" in chosen.reason
    inputs = mtp.prompts(2)
    with torch.no_grad():
        plain = target.generate(**inputs, max_new_tokens=10, do_sample=False)
        out = target.generate(
            **inputs, max_new_tokens=10, do_sample=False, speculative=True, return_dict_in_generate=True
        )
    assert torch.equal(out.sequences, plain)
    assert out.speculative_stats.method == "mtp"
    assert "multi-token-prediction layers" in out.speculative_stats.selection
    assert out.speculative_stats.to_dict()["selection"] == out.speculative_stats.selection


def test_a_conversation_continued_from_its_cache_drafts_without_the_mtp_layers(folder):
    """The MTP layers read the target's hidden states of the whole context, which a filled cache=
    does not hold: `speculative=True` continues the conversation draft-free, as plain's
    continuation, and says why (it raised, naming method='mtp', which the user had not asked for);
    `method="mtp"` named is still refused."""
    target = mtp.model_class("glm4_moe").from_pretrained(folder).eval()
    inputs = mtp.prompts(1)
    with torch.no_grad():
        first = target.generate(**inputs, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
        turn = torch.cat([first.sequences, torch.tensor([[3, 9, 4]])], dim=1)
        kwargs = dict(max_new_tokens=10, do_sample=False)
        plain = target.generate(turn, cache=copy.deepcopy(first.cache), **kwargs)
        out = target.generate(
            turn, cache=copy.deepcopy(first.cache), speculative=True, return_dict_in_generate=True, **kwargs
        )
        assert torch.equal(out.sequences, plain)
        assert out.speculative_stats.method == DRAFT_FREE_AUTO
        assert "method='mtp' drafts from the target's hidden states" in out.speculative_stats.selection
        with pytest.raises(ValueError, match="method='mtp' drafts from the target's hidden states"):
            target.generate(turn, cache=copy.deepcopy(first.cache), speculative="mtp", **kwargs)


def test_without_mtp_weights_the_choice_is_todays_and_says_why(tmp_path):
    """A config that declares MTP layers its checkpoint lacks (converted or quantized without them)."""
    folder = mtp.checkpoint(tmp_path, "glm4_moe", mtp=False)
    target = mtp.model_class("glm4_moe").from_pretrained(folder)
    with pytest.warns(UserWarning, match="holds no MTP weights.*Choosing another draft"):
        chosen = select_draft(target)
    assert chosen.method == "ngram" and "own MTP layers are not used" in chosen.reason


WHY = {
    "misshapen": "do not load as Glm4MoeForCausalLM's MTP layers.*eh_proj.*MISMATCH",
    "missing": "do not load as Glm4MoeForCausalLM's MTP layers.*missing.*eh_proj",
}


@pytest.mark.parametrize("damage", list(WHY))
def test_layers_that_do_not_load_are_not_chosen(tmp_path, damage, capsys):
    """`select_draft` decides by loading the layers as method='mtp' does (a folder's onto the meta
    device): MTP keys that are there but do not load are not reported as the choice, the warning
    says why (once per model: generate, asking again, passes them over silently), and generate
    drafts with what was reported."""
    folder = mtp.damage(mtp.checkpoint(tmp_path, "glm4_moe"), damage)
    target = mtp.model_class("glm4_moe").from_pretrained(folder).eval()
    for given in (target, str(folder)):
        with pytest.warns(UserWarning, match=WHY[damage] + ".*Choosing another draft"):
            chosen = select_draft(given)
        assert (chosen.method, chosen.source) == ("ngram", "local")
        assert "own MTP layers are not used" in chosen.reason
    inputs = mtp.prompts(1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = target.generate(**inputs, max_new_tokens=6, speculative=True, return_dict_in_generate=True)
    assert not [w for w in caught if "Choosing another draft" in str(w.message)]
    assert out.speculative_stats.method == DRAFT_FREE_AUTO == auto_method(chosen.method)
    assert "own MTP layers are not used" in out.speculative_stats.selection
    assert torch.equal(out.sequences, target.generate(**inputs, max_new_tokens=6))

    capsys.readouterr()
    with pytest.warns(UserWarning, match=WHY[damage]):
        assert _select_command(str(folder)) == 0
    out = capsys.readouterr().out
    assert f"method:    {DRAFT_FREE_AUTO}" in out and "own MTP layers are not used" in out


def test_layers_our_masks_cannot_drive_leave_the_choice_to_the_next(folder):
    """A model loaded with an attention implementation other than sdpa or eager (flash attention on
    a GPU; here sdpa registered under another name) keeps that in its MTP layers' config, whose masks
    method='mtp' builds itself: speculative=True passes them over with a warning, as layers that do
    not load; once the model is switched to sdpa, it drafts with them (what they did is not
    remembered past a change of what it depended on)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("renamed_sdpa", sdpa_attention_forward)
    AttentionMaskInterface.register("renamed_sdpa", sdpa_mask)
    clear_cache()
    target = mtp.model_class("glm4_moe").from_pretrained(folder, attn_implementation="renamed_sdpa").eval()
    inputs = mtp.prompts(1)
    with pytest.warns(UserWarning, match="attn_implementation 'sdpa' or 'eager'.*Choosing another"):
        out = target.generate(**inputs, max_new_tokens=6, speculative=True, return_dict_in_generate=True)
    assert out.speculative_stats.method == DRAFT_FREE_AUTO
    assert torch.equal(out.sequences, target.generate(**inputs, max_new_tokens=6))
    target.set_attn_implementation("sdpa")
    out = target.generate(**inputs, max_new_tokens=6, speculative=True, return_dict_in_generate=True)
    assert out.speculative_stats.method == "mtp"


def _select_command(*argv: str) -> int:
    from hf_specdec_cli import select

    parser = argparse.ArgumentParser()
    select.register(parser.add_subparsers())
    args = parser.parse_args(["select", *argv])
    return args.func(args)


def test_select_command_names_the_own_layers(folder, capsys):
    assert _select_command(str(folder)) == 0
    out = capsys.readouterr().out
    assert "method:    mtp" in out and "source:    checkpoint" in out


# --- official assistants ------------------------------------------------------------------------

ASSISTANT_TARGET = "google/gemma-4-E2B-it"


def test_the_registry_names_the_official_assistants():
    from hf_specdec.selection.select import assistant_lookup

    chosen = select_draft(ASSISTANT_TARGET)
    assert (chosen.method, chosen.draft, chosen.source) == (
        "assistant",
        "google/gemma-4-E2B-it-assistant",
        "registry",
    )
    for size in ("E4B", "26B-A4B", "31B"):
        assert assistant_lookup(f"google/gemma-4-{size}-it").draft == f"google/gemma-4-{size}-it-assistant"
    assert assistant_lookup("google/gemma-3-4b-it") is None  # Gemma 3 keeps its draft model


@pytest.fixture
def hub_with_assistant(tmp_path, monkeypatch):
    """A local Hub serving a tiny assistant as the one the registry names for ASSISTANT_TARGET."""
    from hf_specdec.selection.select import assistant_lookup

    target, helper = assistant.pair()
    helper.save_pretrained(tmp_path / "assistant")
    server = local_hub(tmp_path, monkeypatch)
    server.add(assistant_lookup(ASSISTANT_TARGET).draft, tmp_path / "assistant")
    monkeypatch.setenv("HF_SPECDEC_CACHE", str(tmp_path / "specdec"))
    clear_cache()
    yield target
    server.stop()
    clear_cache()


def test_speculative_true_drafts_with_the_targets_official_assistant(hub_with_assistant):
    """The target says it is google/gemma-4-E2B-it: its assistant is fetched (safetensors only, no
    code run) and drafts through our loop, in a left-padded batch."""
    target = hub_with_assistant
    target.name_or_path = ASSISTANT_TARGET
    inputs = assistant.prompts(3)
    with torch.no_grad():
        plain = target.generate(**inputs, max_new_tokens=12, do_sample=False)
        out = target.generate(
            **inputs, max_new_tokens=12, do_sample=False, speculative=True, return_dict_in_generate=True
        )
    assert torch.equal(out.sequences, plain)
    stats = out.speculative_stats
    assert stats.method == "assistant" and stats.accepted > 0
    assert "official assistant" in stats.selection
