"""Draft heads that read the target's hidden states: EAGLE and Medusa, and their checkpoint formats."""

HEAD_METHODS = ("eagle", "medusa")  # the `method=` names whose `draft` must be a trained head
# The methods a head of ours drafts for: `hf-specdec train-draft --method`, `bench --head METHOD=DIR`.
# An `mtp` head is an MTP layer in DeepSeek-V3's design trained for a target that ships none.
TRAINED_METHODS = (*HEAD_METHODS, "mtp")
