"""Drafts that read the target's hidden states: EAGLE and Medusa heads, DFlash / DSpark block drafts,
and their checkpoint formats."""

HEAD_METHODS = ("eagle", "medusa", "dflash")  # the `method=` names whose `draft` is a trained head
