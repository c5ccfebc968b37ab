"""Drafts that read the target's hidden states: EAGLE and Medusa heads, DFlash / DSpark block drafts,
and their checkpoint formats."""

HEAD_METHODS = ("eagle", "medusa", "dflash")  # the `method=` names whose `draft` is a trained head
# The methods a head of ours drafts for: `hf-specdec train-draft --method`, `bench --head METHOD=DIR`.
# An `mtp` head is an MTP layer in DeepSeek-V3's design trained for a target that ships none.
TRAINED_METHODS = (*HEAD_METHODS, "mtp")
