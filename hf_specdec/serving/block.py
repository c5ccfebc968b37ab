"""Serving plans for block drafts (`dflash`, `dspark`): vLLM's `dflash` / `dspark` methods, SGLang's
DFLASH / DSPARK algorithms (their flags: `engines.py`).

A published draft the registry knows is served from its Hub repo, as its authors publish it; one in
a published layout in a folder is served from that folder; ours (`train-draft --method dflash`) is
written in z-lab's DFlash layout, which both engines load. The engines draft whole blocks, so the
plan's length is the draft's block (`ServingPlan.block`).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from ..drafters.base import options_to_config
from ..drafters.dflash import BLOCK_METHODS, BlockDrafterConfig, load_block_draft
from ..heads.io import CONFIG_NAME
from ..heads.layouts import check_dflash_layout
from ..selection.select import registry_head
from .base import Options, ServingExportError, ServingPlan, Source, not_carried
from .sources import hub_origin, load_target

# The engines' methods by the checkpoint's layout: z-lab's DFlash layout (ours is written in it),
# DeepSpec's Qwen3DSparkModel (which its DFlash drafts use too).
ENGINE_METHODS = {
    "DFlash": {"vllm": "dflash", "sglang": "DFLASH"},
    "DSpark": {"vllm": "dspark", "sglang": "DSPARK"},
}


def plan_block(
    model: str, draft: Source, head: Source, options: Options, method: str = "dflash"
) -> ServingPlan:
    """The plan serving the block draft `draft` (or `head`) for `model`."""
    source = draft or head
    if source is None:
        raise ValueError(f"method {method!r} needs --draft: the block draft's folder or Hub repo id.")
    options_to_config(BlockDrafterConfig, options)  # unknown options are named now
    caveats = not_carried(options)
    known = registry_head(str(source))
    if known is not None and known["method"] in BLOCK_METHODS:
        return ServingPlan(
            method,
            ENGINE_METHODS[known["layout"]],
            draft=known["head"],
            measure={"method": method, "draft": known["head"], "options": options},
            block=int(known["drafts"]),
            caveats=_trained_for(model, known) + caveats,
        )
    folder = Path(str(source))
    if not folder.is_dir():
        raise ValueError(
            f"Block draft {source!r} is neither a local folder nor a block draft the registry knows; "
            "download it and pass its folder."
        )
    target = load_target(model)
    loaded = load_block_draft(str(folder), target)
    config = loaded.config
    layout = "DSpark" if config.drafts_from_anchor else "DFlash"
    plan = functools.partial(
        ServingPlan,
        method,
        ENGINE_METHODS[layout],
        measure={"method": method, "draft": loaded, "options": options},
        target=target,
        block=config.drafts_per_block,
        caveats=caveats,
    )
    if (folder / CONFIG_NAME).is_file():  # ours: written in z-lab's layout when rendered
        check_dflash_layout(loaded)
        return plan(head=loaded)
    if config.layout.startswith("MuseGlimmer"):
        caveats.append(
            "vLLM reads MuseGlimmer assistants (its qwen3_dflash maps encoder.fc and "
            "encoder.output_norm_enc); whether SGLang does was not checked."
        )
    return plan(draft=str(folder))


plan_dspark = functools.partial(plan_block, method="dspark")


def _trained_for(model: str, known: dict[str, Any]) -> list[str]:
    """Refuse a published block draft trained for another target; a caveat when `model` does not say
    which Hub model it is."""
    origin = hub_origin(model)
    if origin is not None and origin.lower() not in [t.lower() for t in known["targets"]]:
        raise ServingExportError(
            f"The block draft {known['head']} was trained for {', '.join(known['targets'])}, not for "
            f"{origin}: it drafts from that model's hidden states only. `hf-specdec select TARGET` lists "
            "the drafts known for a target."
        )
    if origin is None:
        return [
            f"{model} does not say which Hub model it is, so whether {known['head']} was trained for it "
            f"(it was for {', '.join(known['targets'])}) could not be checked."
        ]
    return []
