"""Draft heads that read the target's hidden states: EAGLE and Medusa, and their checkpoint formats."""

HEAD_METHODS = ("eagle", "medusa")  # the `method=` names whose `draft` is a trained head
