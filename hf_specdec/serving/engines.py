"""The engine renderers: a `ServingPlan` as vLLM's `speculative_config`, command line and Python snippet,
or as SGLang's `--speculative-*` flags; a head converted to the engine's layout is written beside it.

Names checked against the engines' sources (the versions in `base.py`):

- vLLM's repository, `vllm/config/speculative.py`: `SpeculativeConfig` keys `method`, `model`,
  `num_speculative_tokens` (> 0), `prompt_lookup_min`, `prompt_lookup_max`; `SpeculativeMethod`
  literals ngram, draft_model, suffix, eagle, eagle3, MTP types (`mtp`, into which the
  model-specific `deepseek_mtp`, `glm4_moe_mtp`, `gemma4_mtp`, ... are folded, with a warning):
  `mtp` without `model` loads the MTP layers out of the target's own checkpoint, `mtp` with a
  Gemma 4 assistant as `model` wires it to the target's KV cache. Medusa is gone (since 0.33; 0.32
  keeps it). A missing `method` is guessed from the draft checkpoint (0.33 also overrode a given
  `draft_model` or `mtp` by the draft's path name; 0.34 keeps a given method), so it is always
  written. The 0.34.0 wheel (`vllm/v1/worker/gpu/spec_decode/suffix/`): `suffix` runs on the GPU
  without arctic-inference, its corpus bounded by `suffix_decoding_corpus_tokens` (0.33 refuses
  the key), `suffix_decoding_max_spec_factor` / `_min_token_prob` are accepted and ignored. Each
  config we write was parsed by the 0.34.0 wheel's `SpeculativeConfig` against tiny targets.
  CLI `vllm serve TARGET --speculative-config JSON`.
- the sglang 0.5.23 wheel, `sglang/srt/arg_groups/fields/spec.py` and `fields/model.py` (the
  `ServerArgs` fields; the CLI flag is the field name with dashes): `model_path`,
  `speculative_algorithm` (builtins EAGLE, EAGLE3, NEXTN, STANDALONE, NGRAM, ...),
  `speculative_draft_model_path`, `speculative_num_steps`,
  `speculative_eagle_topk`, `speculative_num_draft_tokens` (the verify width: `ngram_worker.py`
  feeds that many tokens a request from its sequence length on, the first being the last sampled
  token, so k drafts are k + 1); no n-gram size flags (earlier releases' match-window flags are
  gone). The same wheel's `sglang/srt/arg_groups/speculative_hook.py`: EAGLE (and its alias NEXTN)
  runs on the target's own NextN layers when the draft path is the target, which it fills in for
  a few architectures only (`_handle_eagle_family`; `configs/model_config.py` maps the draft
  architectures of the others), so the target is always written as the draft path; FROZEN_KV_MTP
  drafts with a Gemma 4 assistant (NEXTN / EAGLE with such a draft are promoted to it,
  `_resolve_speculative_algorithm_alias`).
  Launched with `python -m sglang.launch_server`.
- Block drafts (checked against vLLM's main branch, `vllm/config/speculative.py`: methods `dflash`
  and `dspark`, `vllm/model_executor/models/qwen3_dflash.py`; and against the sglang 0.5.23 flag list,
  whose algorithms include DFLASH and DSPARK): vLLM's `num_speculative_tokens` is the drafts a block
  (its DFlash runs 1 + N positions, the anchor first; z-lab serves its 16-position drafts with 15);
  SGLang's DFLASH takes the block's verify width in `--speculative-num-draft-tokens` (N + 1, which it
  also sets as `--speculative-dflash-block-size`; it fixes steps and top-k to 1 itself), DSPARK its
  drafted tokens in `--speculative-dspark-block-size`. Written from these sources; not run by an
  engine here.
- Head layouts: see `hf_specdec/heads/layouts.py`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..heads.dflash import BlockDraft
from ..heads.layouts import save_dflash, save_eagle3, save_speculators
from ..version import __version__
from .base import ENGINES, ServingPlan
from .sources import hub_origin

HEAD_FOLDER = "draft-head"  # under the output folder: a head converted to the engine's layout
Renderer = Callable[[str, ServingPlan, int, Path | None], dict[str, Any]]  # (model, plan, k, out)


def render_vllm(model: str, plan: ServingPlan, k: int, out: Path | None) -> dict[str, Any]:
    caveats = list(plan.caveats) + plan.engine_caveats.get("vllm", [])
    draft = plan.draft
    if plan.head is not None:
        draft, note = _write_head(plan.head, "speculators", model, k, out)
        caveats.append(note)
    config: dict[str, Any] = {"method": plan.engine_method["vllm"]}  # else vLLM guesses from the path
    if draft is not None:
        config["model"] = draft
    # vLLM (0.33, 0.34: `SpeculativeConfig.__post_init__`) refuses more drafts than a target's MTP
    # layers unless they are a multiple of them ("must be divisible by n_predict").
    n = plan.mtp_layers
    if plan.method == "mtp" and n and k > n and k % n:
        caveats.append(
            f"vLLM takes a draft length above the target's {n} MTP layers only in multiples of {n}: "
            f"num_speculative_tokens is {k // n * n} here, not {k}."
        )
        k = k // n * n
    elif plan.method == "mtp" and n is None and k > 1:
        caveats.append(
            "The target's MTP layers could not be counted here: vLLM takes a draft length above their "
            "number n only in multiples of n; lower --num-draft-tokens if it refuses this one."
        )
    config["num_speculative_tokens"] = k
    config.update(plan.engine_options.get("vllm", {}))
    if plan.ngram is not None and plan.engine_method["vllm"] == "ngram":
        config["prompt_lookup_max"], config["prompt_lookup_min"] = plan.ngram[1], plan.ngram[0]
        caveats.append(
            f"vLLM's prompt lookup matches n-grams of {plan.ngram[0]}..{plan.ngram[1]} tokens as ours does; "
            "which earlier occurrence it continues from may differ, so acceptance may differ a little."
        )
    if plan.block is not None:
        caveats.append(_block_caveat(plan, k))
    caveats.append(
        "vLLM verifies with its own kernels and batching: its greedy output equals plain vLLM's up to "
        "floating-point near-ties, and may differ from hf-specdec's at such ties."
    )
    snippet = (
        "from vllm import LLM, SamplingParams\n\n"
        'if __name__ == "__main__":  # vLLM starts its workers by spawn\n'
        f"    llm = LLM(model={model!r}, speculative_config={config!r})\n"
        '    outputs = llm.generate(["Hello!"], SamplingParams(temperature=0, max_tokens=64))\n'
        "    print(outputs[0].outputs[0].text)\n"
    )
    command = ["vllm", "serve", model, "--speculative-config", json.dumps(config)]
    return _result("vllm", model, plan, k, draft, command, caveats, speculative_config=config, python=snippet)


def render_sglang(model: str, plan: ServingPlan, k: int, out: Path | None) -> dict[str, Any]:
    algorithm = plan.engine_method["sglang"]
    caveats = list(plan.caveats) + plan.engine_caveats.get("sglang", [])
    draft = plan.draft
    if plan.head is not None:
        draft, note = _write_head(plan.head, "eagle3", model, k, out)
        caveats.append(note)
    if draft is None and algorithm == "EAGLE":
        # The target's own MTP (NextN) layers. SGLang takes them from the draft path, which it fills
        # in with the target itself for a few architectures only (DeepSeek-V3, GLM-4.5, Ling); the
        # others it has MTP layers for (ERNIE 4.5, Step-3.7, Inkling, ...) fail to start without it.
        draft = model
    command = ["python", "-m", "sglang.launch_server", "--model-path", model]
    command += ["--speculative-algorithm", algorithm]
    if draft is not None:
        command += ["--speculative-draft-model-path", draft]
    if plan.block is not None:  # a block draft: its block size, in SGLang's sense for the method
        if algorithm == "DSPARK":  # DSpark's block size counts drafted tokens
            command += ["--speculative-dspark-block-size", str(k)]
        else:  # DFLASH's is the verify width, the last verified token included
            command += ["--speculative-num-draft-tokens", str(k + 1)]
        caveats.append(_block_caveat(plan, k))
        return _result("sglang", model, plan, k, draft, command, caveats)
    if plan.ngram is not None:
        # Earlier releases had --speculative-ngram-{min,max}-match-window-size; 0.5.23 has not (its
        # NGRAM fields: bfs breadths, match type, max_trie_depth), and an unknown flag stops the
        # server, so our n-gram sizes are not written.
        caveats.append(
            "SGLang runs NGRAM speculation (on CUDA, CPU or XPU) matching suffixes in its own trie with "
            f"its defaults: our n-gram sizes ({plan.ngram[0]}..{plan.ngram[1]}) are not carried over."
        )
    else:  # a chain of k drafts: k steps, one candidate each
        command += ["--speculative-num-steps", str(k), "--speculative-eagle-topk", "1"]
    command += ["--speculative-num-draft-tokens", str(k + 1)]
    caveats.append(
        f"--speculative-num-draft-tokens is {k + 1} for {k} draft tokens: SGLang counts the last verified "
        "token as the root of its draft tree."
    )
    return _result("sglang", model, plan, k, draft, command, caveats)


RENDERERS: dict[str, Renderer] = {"vllm": render_vllm, "sglang": render_sglang}


def _result(
    engine: str,
    model: str,
    plan: ServingPlan,
    k: int,
    draft: str | None,
    command: list[str],
    caveats: list[str],
    **extra: Any,
) -> dict[str, Any]:
    return {
        "engine": engine,
        "engine_version": ENGINES[engine],
        "model": model,
        "method": plan.method,
        "engine_method": plan.engine_method[engine],
        "draft": draft,
        "num_draft_tokens": k,
        "command": command,
        **extra,
        "caveats": caveats,
        "written_by": f"hf-specdec {__version__}",
    }


def _block_caveat(plan: ServingPlan, k: int) -> str:
    """What a block draft served with `k` drafts a block means for the engine."""
    if k == plan.block:
        return f"The engine drafts the whole block ({k} tokens) in one forward, as the draft was trained."
    return (
        f"The draft was trained on blocks of {plan.block} drafts; the engine runs blocks of {k}, whose "
        "positions attend to one another, so it drafts differently from the trained block."
    )


def _write_head(head: Any, layout: str, model: str, k: int, out: Path | None) -> tuple[str, str]:
    """Write `head` in `layout` under `out` (a block draft: in z-lab's DFlash layout, which both engines
    load); returns its folder and a note on it."""

    assert out is not None  # export_serving checked it before measuring anything
    folder = out / HEAD_FOLDER
    if isinstance(head, BlockDraft):
        save_dflash(head, folder)
        return str(folder), (
            f"The block draft is written in z-lab's DFlash layout at {folder}. It scores every token with "
            "the target's LM head there, where ours scores its draft vocabulary only: drafts may differ "
            "where the best token lies outside it."
        )
    if layout == "speculators":
        verifier = hub_origin(model)
        save_speculators(head, folder, verifier=verifier or model, num_speculative_tokens=k)
        short = (
            f"`vllm serve {folder}` (the short form) would load the verifier {verifier} from the Hub"
            if verifier
            else f"`vllm serve {folder}` (the short form) fails: vLLM needs its verifier to be a Hub repo id"
        )
        note = (
            f"The head is written in the speculators layout at {folder}. {short}; the command here is the "
            "long form, which serves the target you name."
        )
    else:
        save_eagle3(head, folder)
        note = f"The head is written in the original EAGLE-3 layout (LlamaForCausalLMEagle3) at {folder}."
    return str(folder), note
