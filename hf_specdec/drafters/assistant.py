"""An official assistant drafts: a small model trained to read its target's own state, with no cache
of its own (Gemma 4's `*-assistant` checkpoints, transformers' `Gemma4AssistantForCausalLM`).

Each draft token is one assistant forward at the position of the row's last token: it reads the
embedding of the token before (the row's last, then its own previous draft) next to a hidden
state (the target's last one there, then its own projected output), and attends, at every one of
its layers, to the keys and values of the target's last layer of that layer's kind (full or
sliding attention) as the target's cache holds them now. So the whole ragged batch drafts in one
forward per token, each row under a mask of its real cached tokens (the sliding window counted in
them, as plain decoding counts it), and a tree is a level of queries per forward, each node
reading its parent's output. transformers' `SinglePositionMultiTokenCandidateGenerator` does the
same at batch 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ..core.devices import check_placed, execution_device
from ..core.draft import Draft, DraftCost, DraftRequest
from ..core.kv import RaggedKV, Slots
from ..core.masks import cache_places, in_attention_format
from .base import Drafter, options_to_config
from .chain import chain
from .draft_model import load_draft
from .kind import ASSISTANT_TYPES, is_assistant
from .registry import register_drafter
from .tree import ChainTreeConfig, Level, grow_tree

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import SpeculativeConfig


def stored_layers(text: Any) -> dict[str, int]:
    """The target's layer (text config) whose keys and values each kind of assistant layer reads: its
    last layer of that kind that stores them ("store" in `kv_sharing_modes`)."""
    return {text.layer_types[i]: i for i, mode in enumerate(text.kv_sharing_modes) if mode == "store"}


def kv_mismatch(assistant: Any, target: Any) -> str | None:
    """Why the assistant's layers (its text config) cannot attend to the target's shared keys and
    values: a kind of layer the target stores none of, or keys and values of another shape; None
    where they fit."""
    stored = stored_layers(target)
    for j, kind in enumerate(assistant.layer_types):
        if kind not in stored:
            return (
                f"has {kind} layers, and the target keeps no such layer's keys and values (it keeps "
                f"{', '.join(sorted(stored))})"
            )
        ours, theirs = assistant.per_layer_config[j], target.per_layer_config[stored[kind]]
        if (ours.num_key_value_heads, ours.head_dim) != (theirs.num_key_value_heads, theirs.head_dim):
            return (
                f"attends in its {kind} layers to {ours.num_key_value_heads} key-value heads of size "
                f"{ours.head_dim}; the target's are {theirs.num_key_value_heads} of size {theirs.head_dim}"
            )
    return None


@register_drafter
class AssistantDrafter(Drafter):
    """Drafts with an official assistant (`draft=` a loaded one, its folder or Hub repo id)."""

    name: ClassVar[str] = "assistant"
    supports_sampling: ClassVar[bool] = True
    supports_tree: ClassVar[bool] = True
    reads_target_kv: ClassVar[bool] = True
    takes_draft_tokenizer: ClassVar[bool] = False  # an assistant shares the target's vocabulary
    takes_trust_remote_code: ClassVar[bool] = True  # an assistant named by folder or repo
    options_class: ClassVar[type] = ChainTreeConfig
    draft_cost: ClassVar[DraftCost] = DraftCost.PER_TOKEN
    hidden_state_layers: tuple[int, ...] = (
        -1,
    )  # the target's last hidden state, as the assistant was trained

    def __init__(self, assistant: nn.Module, target: PreTrainedModel, config: ChainTreeConfig) -> None:
        self.assistant = assistant
        self.config = config
        text = target.config.get_text_config()
        self.vocab_size = text.vocab_size
        self.embed = target.get_input_embeddings()
        self.layers = stored_layers(text)
        self.window = text.sliding_window
        self.attention = assistant.config.get_text_config()._attn_implementation
        self.hidden: list[torch.Tensor] = []  # per row: the target's last hidden state, [H]

    @classmethod
    def from_config(cls, config: SpeculativeConfig, target: PreTrainedModel, tokenizer: Any) -> Drafter:
        draft = config.draft
        if draft is None:
            raise ValueError(
                "method='assistant' drafts with an official assistant of the target: pass it as draft= (a "
                "loaded Gemma4AssistantForCausalLM, its folder or Hub repo id, e.g. "
                "'google/gemma-4-E2B-it-assistant'), or speculative=True to choose a known one."
            )
        if not isinstance(draft, nn.Module):  # loaded where the target computes
            draft = load_draft(str(draft), target, trust_remote_code=config.trust_remote_code)[0]
        if not is_assistant(draft):
            raise ValueError(
                f"method='assistant' needs an assistant that reads its target's KV cache (model types "
                f"{', '.join(ASSISTANT_TYPES)}); {type(draft).__name__} is not one: use method='draft_model'."
            )
        text = target.config.get_text_config()
        if "store" not in (getattr(text, "kv_sharing_modes", None) or ()):
            raise ValueError(
                f"The assistant {type(draft).__name__} reads its target's shared KV states, which "
                f"{type(target).__name__} does not keep (only Gemma 4 targets do): use method='draft_model'."
            )
        backbone = draft.config.backbone_hidden_size
        if backbone != text.hidden_size:
            raise ValueError(
                f"The assistant was trained on a target of hidden size {backbone}; this target's is "
                f"{text.hidden_size}: it is another model's assistant."
            )
        problem = kv_mismatch(draft.config.get_text_config(), text)
        if problem:
            kind = type(draft).__name__
            raise ValueError(f"The assistant {kind} {problem}: it is another model's assistant.")
        # It reads the target's cache, embedding and hidden states at every draft token: moving them
        # to it each time would cost more than the draft saves (transformers moves nothing either).
        device = execution_device(target)
        check_placed(
            draft,
            device,
            f"The assistant {type(draft).__name__}",
            "it reads the target's KV cache and hidden states at every draft token. Move it there "
            f"(assistant.to({str(device)!r})), or pass its folder or repo id, which is loaded there.",
        )
        options = options_to_config(cls.options_class, config.options)
        return cls(draft, target, options)

    @torch.no_grad()
    def propose(self, request: DraftRequest) -> Draft:
        kv = request.target_kv
        if not isinstance(kv, RaggedKV):
            raise ValueError(
                "method='assistant' reads the target's dynamic cache; a static cache "
                "(cache_implementation='static') is not supported yet: drop it."
            )
        context = self._context(kv, Slots(request.target_rows, kv.mask.shape[0], kv.mask.device))
        self.hidden = [states[-1] for states in request.hidden_states]  # each row's last cached token's
        lengths = torch.tensor(request.lengths, device=request.tokens.device)
        last = request.tokens.gather(1, lengths[:, None] - 1)  # [B, 1] the row's last token, not cached yet
        hidden = torch.stack(self.hidden)[:, None]  # [B, 1, H]
        logits, hidden = self._forward(last, hidden, context)
        max_tokens = list(request.max_tokens)
        if request.tree:
            return self._tree(request, max_tokens, logits, hidden, context)

        def logits_at(i: int, previous: torch.Tensor | None, active: list[bool]) -> torch.Tensor:
            nonlocal logits, hidden
            if i > 0:  # the same position again: its previous draft, and its own projected output
                logits, hidden = self._forward(previous[:, None], hidden, context)
            return logits[:, -1]

        return chain(request, max_tokens, self.config.min_confidence, logits_at)

    def _context(self, kv: RaggedKV, rows: Slots) -> dict[str, Any]:
        """The target's keys and values the assistant reads (views of the cache where the step's rows
        are its whole batch, not copies), the masks of each row's real cached tokens (a sliding
        window counted in the places plain decoding's cache gives them), and the position of each
        row's last token, where every draft query sits."""
        mask = rows.gather(kv.mask)  # [B, W]
        places = cache_places(mask, kv.prompt_width)
        query = places[:, -1:] + 1  # the place the last token would take
        masks = {"full_attention": mask, "sliding_attention": mask & (query - places < self.window)}
        # In the assistant's dtype, which its queries have: an assistant loaded in another dtype than
        # its target (fp32 beside a bf16 target) reads a cast copy, one per step.
        dtype = self.assistant.pre_projection.weight.dtype
        states = {
            kind: (
                rows.gather(kv.cache.layers[i].keys).to(dtype),
                rows.gather(kv.cache.layers[i].values).to(dtype),
            )
            for kind, i in self.layers.items()
        }
        position = rows.gather(kv.lengths) + (0 if kv.offsets is None else rows.gather(kv.offsets))
        return {"masks": {kind: masks[kind] for kind in states}, "states": states, "position": position}

    def _forward(
        self, tokens: torch.Tensor, hidden: torch.Tensor, context: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One assistant forward over `tokens` [B, Q] with the hidden states they read [B, Q, H], every
        query at its row's position: full-vocabulary logits [B, Q, V] and projected outputs [B, Q, H]."""
        assistant = self.assistant
        queries = tokens.shape[1]
        embeds = torch.cat([self.embed(tokens), hidden.to(self.embed.weight.dtype)], dim=-1)
        embeds = assistant.pre_projection(embeds.to(assistant.pre_projection.weight.dtype))
        # Its keys are the target's cache only (`shared_kv_states`), and every query sits at its row's
        # one position: one row of the mask, the row's real cached tokens, serves all its queries.
        masks = {
            kind: in_attention_format(
                allowed[:, None, :].expand(-1, queries, -1), self.attention, embeds.dtype
            )
            for kind, allowed in context["masks"].items()
        }
        out = assistant.model(
            inputs_embeds=embeds,
            attention_mask=masks,
            position_ids=context["position"][:, None].expand(-1, queries),
            shared_kv_states=dict(context["states"]),
            use_cache=False,
        )
        last = out.last_hidden_state
        if assistant.config.use_ordered_embeddings:
            logits = assistant.masked_embedding(last, assistant.lm_head.weight)
        else:
            logits = assistant.lm_head(last)
        return logits[..., : self.vocab_size].float(), assistant.post_projection(last)

    def _tree(
        self,
        request: DraftRequest,
        max_tokens: list[int],
        logits: torch.Tensor,
        hidden: torch.Tensor,
        context: dict[str, Any],
    ) -> Draft:
        """EAGLE-2's dynamic tree: a level of nodes per forward, each reading its parent's output;
        nodes do not see one another (the assistant attends to the target's cache only)."""
        fed = [hidden]  # column 0: after the row's last token; tree column c at 1 + c

        def feed(level: Level) -> torch.Tensor:
            outputs = torch.cat(fed, dim=1)
            rows = torch.arange(len(max_tokens), device=outputs.device)[:, None]
            level_logits, level_hidden = self._forward(
                level.tokens, outputs[rows, level.parent_columns + 1], context
            )
            fed.append(level_hidden)
            return level_logits

        return grow_tree(
            request, max_tokens, self.config.tree_top_k, self.config.min_confidence, logits[:, -1], feed
        )
