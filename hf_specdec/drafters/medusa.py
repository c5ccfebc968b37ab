"""Medusa drafting: k heads read the target's last feature and guess k tokens at once; asked for a
tree, the heads' top-k guesses combine into a cartesian-product tree pruned by probability."""

from __future__ import annotations

import heapq
import itertools
from typing import Any, ClassVar

import torch

from ..core.draft import Draft, DraftCost, DraftRequest
from .chain import chain
from .head_drafter import HeadDrafter
from .registry import register_drafter
from .tree import ChainTreeConfig


@register_drafter
class MedusaDrafter(HeadDrafter):
    """Head i reads the feature that predicted the row's last token and guesses the i-th after it.

    Asked for a tree, it proposes the budget's most probable nodes of the cartesian product of each
    head's `tree_top_k` guesses (`cartesian_tree`), chosen without draws like every tree here.
    """

    name: ClassVar[str] = "medusa"
    # Every head reads the same feature, in one pass: a draft (or a tree) of any length costs one.
    draft_cost: ClassVar[DraftCost] = DraftCost.PER_BLOCK
    # Its heads run once per step on the target's features, with nothing per token to compile.
    options_class: ClassVar[type] = ChainTreeConfig

    def __init__(self, head: Any, config: ChainTreeConfig, vocab_size: int, device: torch.device) -> None:
        super().__init__(head, config, vocab_size, device)
        self.last_feature: dict[int, torch.Tensor] = {}  # per user row: the newest target feature

    @torch.no_grad()
    def propose(self, request: DraftRequest) -> Draft:
        batch = len(request.row_ids)
        for b, row in enumerate(request.row_ids):
            new = request.hidden_states[b]
            if new is not None and len(new):
                self.last_feature[row] = new[-1]
        known = [row in self.last_feature for row in request.row_ids]
        # A chain has one token per head; a tree can spend its nodes on several guesses per head.
        cap = max(request.max_tokens, default=0) if request.tree else self.head.config.num_heads
        max_tokens = [min(n, cap) if ok else 0 for n, ok in zip(request.max_tokens, known)]
        steps = min(max(max_tokens, default=0), self.head.config.num_heads)
        if steps == 0:
            return Draft.empty(batch, self.device)
        size = self.head.config.hidden_size
        features = torch.stack(
            [self.last_feature.get(row, torch.zeros(size, device=self.device)) for row in request.row_ids]
        )
        head_logits = self.head(features, num_heads=steps)  # [B, steps, draft_vocab]
        logits = [self.full_vocab(head_logits[:, i]) for i in range(steps)]
        if request.tree:
            probs = _head_probs(request, logits)
            return cartesian_tree(probs, max_tokens, self.config.tree_top_k, self.config.min_confidence)
        return chain(request, max_tokens, self.config.min_confidence, lambda i, previous, active: logits[i])


def _head_probs(request: DraftRequest, logits: list[torch.Tensor]) -> torch.Tensor:
    """Each head's processed distribution, [B, heads, V], from its logits [B, V]. Head i's scores
    are processed after the row and the top-1 guesses of the heads before it, the context a greedy
    chain gives it: processors that read the context (repetition penalty) see the tree's most
    probable path."""
    batch = len(request.row_ids)
    guesses = request.tokens.new_zeros(batch, 0)
    probs = []
    for head_logits in logits:
        contexts = (
            [torch.cat([request.row(b), guesses[b : b + 1]], dim=1) for b in range(batch)]
            if request.processor.reads_context
            else []
        )
        dist = request.processor(contexts, request.row_ids, head_logits.float()).softmax(dim=-1)
        probs.append(dist)  # rows whose processors allow no draftable token give NaN: no nodes
        guesses = torch.cat([guesses, dist.nan_to_num(0.0).argmax(dim=-1, keepdim=True)], dim=1)
    return torch.stack(probs, dim=1)


def cartesian_tree(
    probs: torch.Tensor,  # [B, D, V] head d's distribution of the d-th token after the row's last
    max_tokens: list[int],  # [B] nodes per row
    top_k: int,
    min_confidence: float = 0.0,
) -> Draft:
    """Medusa's tree (Cai et al. 2024, "Medusa", tree attention): every combination of head
    0's, head 1's, ... top-k guesses is a root-to-node path, and the paper keeps the nodes of
    highest estimated accuracy (its "sparse trees", from the product of each head's top-i accuracy
    on calibration data). Without calibration data the heads' own probabilities stand in for those
    accuracies: a node's score is the product of its path's head probabilities, and each row keeps
    its `max_tokens[b]` best nodes, grown best-first.

    A child's score never exceeds its parent's, so the best nodes form a tree and come out parents
    first, most probable first: any prefix of the nodes is the best tree of that size (what the
    policy's cut relies on). Siblings are distinct top-k tokens. Nodes scoring below
    `min_confidence`, or with probability 0 (not allowed by the processors), are not proposed.
    """
    top = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
    values, indices = top.values.tolist(), top.indices.tolist()  # [B, D, K]
    rows = [_best_nodes(v, i, n, min_confidence) for v, i, n in zip(values, indices, max_tokens)]
    lengths = [len(nodes) for nodes in rows]
    width = max(lengths, default=0)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    parents = torch.full((len(rows), width), -1, dtype=torch.long)
    confidence = torch.zeros(len(rows), width)
    for b, nodes in enumerate(rows):
        for i, (token, parent, p) in enumerate(nodes):
            tokens[b, i], parents[b, i], confidence[b, i] = token, parent, p
    device = probs.device
    # No `probs`: the tree was chosen without draws, and the target's walk keeps sampling exact.
    return Draft(tokens.to(device), lengths, None, confidence.to(device), parents=parents.to(device))


def _best_nodes(
    values: list[list[float]],  # [D][K] each head's top-k probabilities
    indices: list[list[int]],  # [D][K] and tokens
    budget: int,
    min_confidence: float,
) -> list[tuple[int, int, float]]:
    """One row's best `budget` nodes (token, parent node, own probability), best first."""
    nodes: list[tuple[int, int, float]] = []
    # Candidates (-score, order, parent node, level, token, probability); `order` breaks ties toward
    # the candidate offered first, so a parent always comes before its children.
    candidates: list[tuple[float, int, int, int, int, float]] = []
    order = itertools.count()

    def offer(parent: int, level: int, reach: float) -> None:
        if level >= len(values):
            return
        for p, token in zip(values[level], indices[level]):
            if p > 0 and reach * p >= min_confidence:  # NaN (nothing allowed) fails too
                heapq.heappush(candidates, (-reach * p, next(order), parent, level, token, p))

    offer(-1, 0, 1.0)
    while candidates and len(nodes) < budget:
        neg_score, _, parent, level, token, p = heapq.heappop(candidates)
        nodes.append((token, parent, p))
        offer(len(nodes) - 1, level + 1, -neg_score)
    return nodes
