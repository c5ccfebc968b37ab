"""The training loop for draft heads: time-budgeted, resumable, with a held-out acceptance estimate.

EAGLE heads train with training-time test (EAGLE-3): the head is unrolled for a few chained
draft steps, each step reading the previous step's predicted features, so it learns to draft
from its own guesses and not only from the target's features. The loss per step is the
cross-entropy against the target's greedy token plus a regression onto the target's feature.
An MTP head (DeepSeek-V3's MTP layer: the same layer with a norm on its output) unrolls the same
way with the cross-entropy alone, as DeepSeek trains its MTP modules: its output is no estimate of
the target's feature. Medusa head i learns the target's greedy token i+1 positions after the
next. DFlash block drafts learn whole blocks anchored at the target's answer tokens (`block.py`).
"""

from __future__ import annotations

import json
import math
import pickle
import random
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..core.fields import check_fields
from ..core.timing import clock
from ..heads import TRAINED_METHODS
from ..heads.dflash import BlockDraftConfig
from ..heads.eagle import EagleHeadConfig
from ..heads.io import CONFIG_NAME, build_head, check_saved_head, load_state, read_weights, save_head
from ..heads.medusa import MedusaHeadConfig
from ..heads.published import read_json_object
from ..store.manifest import write_atomically
from .block import acceptance, block_loss, default_target_layers, loss_decay
from .features import Example

CHECKPOINT_DIR = "checkpoint"
STATE_NAME = "trainer_state.pt"
READ_BY = "read_by"  # the key of a field's metadata that names the methods reading it (`_read_by`)


def _read_by(*methods: str, default: Any) -> Any:
    """A setting only `methods` read: one set to other than `default` for another method is refused
    (it would be ignored without a word)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={READ_BY: methods})
    return field(default=default, metadata={READ_BY: methods})


@dataclass
class TrainConfig:
    """Settings of `hf-specdec train-draft` (saved beside the head as `training.json`)."""

    method: str = "eagle"
    minutes: float = 30.0  # training time, not counting data generation
    max_steps: int = 0  # stop after this many optimizer steps too (0: the time budget alone)
    unrolled_steps: int = _read_by("eagle", "mtp", default=3)  # chained draft steps trained at once
    medusa_heads: int = _read_by("medusa", default=4)
    draft_vocab_size: int = 8192  # most frequent target tokens the head scores; 0 = all
    learning_rate: float = 2e-3
    batch_tokens: int = 4096
    prompt_token_loss: bool = _read_by("eagle", "mtp", default=False)  # token loss on the prompt too
    block_size: int = _read_by("dflash", default=8)  # block positions, the anchor included (size - 1 drafts)
    draft_layers: int = _read_by("dflash", default=2)  # the draft's transformer layers
    target_layers: list[int] = _read_by("dflash", default=[])  # layers read; empty: 5 spread out
    anchors: int = _read_by("dflash", default=32)  # blocks trained per sequence and step
    max_length: int = 384  # train on each sequence's last positions (its answer and the prompt's end)
    holdout: float = 0.05  # share of sequences kept out of training to estimate acceptance
    eval_every_minutes: float = 3.0
    save_every_minutes: float = 5.0
    seed: int = 0

    def __post_init__(self) -> None:
        # Checked when made, before minutes of answer generation, not when training starts.
        check_fields(
            self,
            ranges={
                "max_steps": (0, None),
                "unrolled_steps": (1, None),
                "medusa_heads": (1, None),
                "draft_vocab_size": (0, None),
                "batch_tokens": (1, None),
                "max_length": (2, None),
                "holdout": (0, 1),
                "block_size": (2, None),
                "draft_layers": (1, None),
                "anchors": (1, None),
            },
            choices={"method": TRAINED_METHODS},
        )
        for name in ("minutes", "learning_rate", "eval_every_minutes", "save_every_minutes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"`{name}` of TrainConfig must be above 0, got {getattr(self, name)!r}.")
        for f in fields(self):
            methods = f.metadata.get(READ_BY)
            if methods is None or self.method in methods:
                continue
            default = f.default_factory() if f.default is MISSING else f.default
            if getattr(self, f.name) != default:
                raise ValueError(
                    f"`{f.name}` of TrainConfig is read only when training {' or '.join(methods)}, not "
                    f"{self.method}; leave it at its default ({default!r}) or choose that method."
                )


def feature_layers(target: Any, config: TrainConfig) -> tuple[int, ...]:
    """The target's `output_hidden_states` indices the head of `config.method` reads: the last for
    EAGLE and Medusa heads, the block draft's `target_layers` (each layer's output) for DFlash."""
    if config.method != "dflash":
        return (-1,)
    return tuple(i + 1 for i in _block_layers(target, config))


def _block_layers(target: Any, config: TrainConfig) -> list[int]:
    layers = target.config.get_text_config().num_hidden_layers
    chosen = list(config.target_layers) or default_target_layers(layers)
    if min(chosen) < -1 or max(chosen) >= layers:
        raise ValueError(
            f"target_layers {chosen} are not layers of this {layers}-layer target (0..{layers - 1}, -1: "
            "the embeddings)."
        )
    return chosen


def _progress(state: dict[str, Any], budget: float, max_steps: int) -> float:
    """How far training is, 0 to 1: by time, or by steps when a step cap comes first."""
    by_time = state["seconds"] / budget if budget > 0 else 1.0
    return min(1.0, max(by_time, state["step"] / max_steps if max_steps else 0.0))


def _finished(state: dict[str, Any], budget: float, max_steps: int) -> bool:
    return _progress(state, budget, max_steps) >= 1.0


def train_head(target: Any, examples: list[Example], out: Path, config: TrainConfig) -> dict[str, Any]:
    """Train a head for `target` on `examples`; returns the training log (also saved in `out`). The
    target is frozen meanwhile (a head shares its embedding and LM head) and handed back as given."""
    trainable = {parameter: parameter.requires_grad for parameter in target.parameters()}
    target.requires_grad_(False)
    try:
        return _train_head(target, examples, out, config)
    finally:
        for parameter, flag in trainable.items():
            parameter.requires_grad_(flag)


def _train_head(target: Any, examples: list[Example], out: Path, config: TrainConfig) -> dict[str, Any]:
    if config.method not in TRAINED_METHODS:
        raise ValueError(f"Unknown head method {config.method!r}; use {', '.join(TRAINED_METHODS)}.")
    rng = random.Random(config.seed)
    shuffled = [_last_positions(e, config.max_length) for e in examples]
    rng.shuffle(shuffled)
    held = max(1, round(len(shuffled) * config.holdout))
    if len(shuffled) - held < 1:
        raise ValueError(
            f"{len(examples)} training sequences cannot be split into training and held-out sets."
        )
    heldout, train = shuffled[:held], shuffled[held:]

    head = _new_head(target, train, config)
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.learning_rate, weight_decay=0.0)
    state = {"step": 0, "seconds": 0.0, "history": [], "epoch": 0}
    resumed = _resume(out / CHECKPOINT_DIR, head, optimizer, state)
    budget = config.minutes * 60
    if config.max_steps < 0:
        raise ValueError(f"max_steps must be 0 (no cap) or positive, got {config.max_steps}.")
    to_draft = _index_of(head.draft_vocab, head.config.vocab_size)
    device = next(head.parameters()).device  # the training budget counts what it computed
    last_eval = last_save = state["seconds"]
    log = {
        "config": asdict(config),
        "train_sequences": len(train),
        "train_tokens": sum(len(e.ids) for e in train),
        "heldout_sequences": len(heldout),
        "draft_vocab_coverage": _coverage(train, head.draft_vocab, head.config.vocab_size),
        "resumed_at_step": state["step"] if resumed else None,
    }
    bar = tqdm(
        total=round(budget), initial=round(state["seconds"]), desc=f"training {config.method} head", unit="s"
    )
    try:
        while not _finished(state, budget, config.max_steps):
            for batch in _batches(train, config.batch_tokens, rng):
                started = clock(device)
                warmup = min(1.0, (state["step"] + 1) / 50)
                for group in optimizer.param_groups:
                    group["lr"] = (
                        config.learning_rate
                        * warmup
                        * 0.5
                        * (1 + math.cos(math.pi * _progress(state, budget, config.max_steps)))
                    )
                head.train()
                loss, _ = _loss(head, batch, to_draft, config)
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
                optimizer.step()
                state["step"] += 1
                spent = clock(device) - started
                state["seconds"] += spent
                bar.update(round(state["seconds"]) - bar.n)
                bar.set_postfix(loss=f"{loss.item():.3f}", step=state["step"])
                finished = _finished(state, budget, config.max_steps)
                if state["seconds"] - last_eval >= config.eval_every_minutes * 60 or finished:
                    estimate = evaluate(head, heldout, to_draft, config)
                    state["history"].append(
                        {"step": state["step"], "seconds": round(state["seconds"]), **estimate}
                    )
                    bar.write(_describe(state["history"][-1]))
                    last_eval = state["seconds"]
                if state["seconds"] - last_save >= config.save_every_minutes * 60:
                    _checkpoint(out / CHECKPOINT_DIR, head, optimizer, state)
                    last_save = state["seconds"]
                if finished:
                    break
            state["epoch"] += 1
    except KeyboardInterrupt:
        _checkpoint(out / CHECKPOINT_DIR, head, optimizer, state)
        bar.close()
        raise KeyboardInterrupt(
            f"Interrupted; the checkpoint is in {out / CHECKPOINT_DIR}: run the same command to resume."
        ) from None
    bar.close()
    if not state["history"] or state["history"][-1]["step"] != state["step"]:
        estimate = evaluate(head, heldout, to_draft, config)
        state["history"].append({"step": state["step"], "seconds": round(state["seconds"]), **estimate})
    _checkpoint(out / CHECKPOINT_DIR, head, optimizer, state)
    save_head(head, out)
    log.update(
        steps=state["step"],
        epochs=state["epoch"],
        train_seconds=round(state["seconds"]),
        history=state["history"],
    )
    (out / "training.json").write_text(json.dumps(log, indent=2))
    return log


@torch.no_grad()
def evaluate(
    head: Any, examples: list[Example], to_draft: torch.Tensor, config: TrainConfig
) -> dict[str, Any]:
    """Held-out estimate on the target's answers: per-position greedy acceptance and mean accepted length."""
    head.eval()
    verdicts = [_loss(head, [example], to_draft, config, judge=True)[1] for example in examples]
    if config.method == "dflash":  # per example, (right, judged) [1, A, D] of its blocks
        right = torch.cat([r.flatten(0, 1) for r, _ in verdicts])
        judged = torch.cat([j.flatten(0, 1) for _, j in verdicts])
        return acceptance(right, judged)
    correct_sum = None
    counted = 0
    accepted_total = 0.0
    for correct in verdicts:  # [steps, T] over answer positions
        if correct.shape[1] == 0:
            continue
        steps = correct.shape[0]
        # A chain started at position t is accepted up to its first miss: step s is judged at t + s - 1.
        starts = correct.shape[1] - steps + 1  # drafts whose every step falls inside the answer
        if starts <= 0:
            continue
        run = torch.ones(starts, dtype=torch.bool)
        length = torch.zeros_like(run, dtype=torch.float)
        for s in range(steps):
            run &= correct[s, s : s + len(run)]
            length += run.float()
        accepted_total += float(length.sum())
        counted += len(run)
        # Conditional acceptance of position s given positions < s were accepted.
        cond = [float(correct[0].float().mean())]
        prev = correct[0, :starts]
        for s in range(1, steps):
            now = prev & correct[s, s : s + len(prev)]
            cond.append(float(now.sum()) / max(1, float(prev.sum())))
            prev = now
        weights = torch.tensor(cond) * len(run)
        correct_sum = weights if correct_sum is None else correct_sum + weights
    if not counted:
        return {"acceptance": [], "tau": 1.0}
    return {
        "acceptance": [round(float(a) / counted, 4) for a in correct_sum],
        "tau": round(1 + accepted_total / counted, 3),
    }


def _loss(
    head: Any, batch: list[Example], to_draft: torch.Tensor, config: TrainConfig, judge: bool = False
) -> tuple[torch.Tensor, Any]:
    """Training loss of a batch; with `judge` (for `evaluate`, a batch of one), also which drafts
    were right. For a chain or Medusa, which steps got which answer positions right, [steps, T]: a
    draft started at t is judged at column t for its first token, t + 1 for its second, and so on.
    For a block draft, blocks anchored at every answer position (`judge`) or at `config.anchors`
    random ones, and which of their positions were right and which were judged, [B, A, D] each."""
    ids, features, labels, valid, answer = _stack(batch, head)
    losses, correct = [], []
    if config.method == "dflash":
        gamma = loss_decay(config.block_size)
        loss, right, judged = block_loss(
            head, ids, features, to_draft[labels], valid, answer, config.anchors, gamma, every_anchor=judge
        )
        return loss, (right, judged)
    if config.method in ("eagle", "mtp"):
        inputs, targets = ids[:, 1:], to_draft[labels[:, 1:]]  # t reads (f_t, x_{t+1}), predicts f_{t+1}
        positions = torch.arange(inputs.shape[1], device=ids.device)[None]
        for s, predicted in enumerate(head.unrolled(inputs, features[:, :-1], config.unrolled_steps)):
            use = valid[:, 1:] & (positions >= s)  # step s + 1 reads s earlier predictions
            # Token loss where drafting happens (the target's answers); the LM head is most of the
            # cost. The feature loss is cheap and also learns from the prompt.
            scored = use if config.prompt_token_loss else use & answer[:, 1:]
            logits = head.logits(predicted[scored])
            ce = _cross_entropy(logits, targets[scored])
            if config.method == "eagle":  # the predicted feature regressed onto the target's
                ce = ce + F.smooth_l1_loss(predicted[use], features[:, 1:][use].to(predicted.dtype))
            losses.append(ce * 0.8**s)
            if judge:
                hit = torch.zeros(inputs.shape[1], dtype=torch.bool, device=ids.device)
                hit[scored[0]] = logits.argmax(-1) == targets[scored]
                correct.append(hit)
    else:
        logits = head(features, num_heads=config.medusa_heads)  # [B, T, heads, V']
        length = ids.shape[1]
        for i in range(min(config.medusa_heads, length - 2)):
            ahead = 2 + i  # head i at position t guesses x_{t+2+i}: i + 1 tokens after the next
            # The target's greedy choice there (in its greedy answers, the token itself; in a corpus
            # or a sampled answer, what the target would have verified a draft against).
            label = to_draft[labels[:, ahead - 1 : length - 1]]
            use = valid[:, ahead:] & answer[:, 1 + i : length - 1]  # drafts started in the answer
            guess = logits[:, : length - ahead, i]
            losses.append(_cross_entropy(guess[use], label[use]))
            if judge:  # all heads read the same position: head i's verdict goes i columns later
                hit = torch.zeros(length - 1, dtype=torch.bool, device=ids.device)
                hit[i : length - ahead + i] = guess[0].argmax(-1) == label[0]
                correct.append(hit)
    hits = torch.stack(correct)[:, answer[0, 1:]].cpu() if correct else torch.zeros(0, 0, dtype=torch.bool)
    return sum(losses), hits


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over labels inside the draft vocabulary; 0 (not NaN) when there are none."""
    if not bool((labels != -100).any()):
        return logits.sum() * 0.0
    return F.cross_entropy(logits.float(), labels, ignore_index=-100)


def _last_positions(example: Example, length: int) -> Example:
    """The example's last `length` positions; its features were computed with the whole context."""
    cut = max(0, len(example.ids) - length)
    if cut == 0:
        return example
    return Example(
        example.ids[cut:], example.features[cut:], example.labels[cut:], max(0, example.answer_start - cut)
    )


def _stack(batch: list[Example], head: Any):
    width = max(len(e.ids) for e in batch)
    size = batch[0].features.shape[-1]
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    labels = torch.zeros(len(batch), width, dtype=torch.long)
    features = torch.zeros(len(batch), width, size)
    valid = torch.zeros(len(batch), width, dtype=torch.bool)
    answer = torch.zeros(len(batch), width, dtype=torch.bool)
    for b, e in enumerate(batch):
        n = len(e.ids)
        ids[b, :n], labels[b, :n], features[b, :n] = e.ids, e.labels, e.features.float()
        valid[b, :n] = True
        answer[b, e.answer_start : n] = True
    device = head.draft_vocab.device
    if hasattr(head, "project_features"):  # EAGLE-3-style heads project several layers into one feature
        features = head.project_features(features.to(device))
    return ids.to(device), features.to(device), labels.to(device), valid.to(device), answer.to(device)


def _batches(examples: list[Example], batch_tokens: int, rng: random.Random) -> list[list[Example]]:
    """Shuffled batches of similar-length sequences, about `batch_tokens` padded tokens each."""
    order = sorted(examples, key=lambda e: len(e.ids) + rng.random())
    batches, current = [], []
    for e in order:
        if current and (len(current) + 1) * len(e.ids) > batch_tokens:
            batches.append(current)
            current = []
        current.append(e)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def _new_head(target: Any, train: list[Example], config: TrainConfig) -> Any:
    head_config = _head_config(target, config)
    vocab, size = head_config.vocab_size, head_config.draft_vocab_size
    counts = torch.bincount(torch.cat([e.labels for e in train] + [e.ids for e in train]), minlength=vocab)
    draft_vocab = torch.sort(torch.argsort(counts, descending=True, stable=True)[:size]).values
    torch.manual_seed(config.seed)
    head = build_head(head_config, target).float()
    head.set_draft_vocab(draft_vocab)
    return head


def _head_config(target: Any, config: TrainConfig) -> EagleHeadConfig | MedusaHeadConfig | BlockDraftConfig:
    """The config of the head `config` trains for `target` (what its checkpoint records)."""
    vocab = target.config.get_text_config().vocab_size
    size = config.draft_vocab_size if 0 < config.draft_vocab_size < vocab else vocab
    if config.method in ("eagle", "mtp"):
        mtp = config.method == "mtp"
        return EagleHeadConfig.for_target(
            target, draft_vocab_size=size, input_norms=True, output_norm=mtp, method=config.method
        )
    if config.method == "dflash":
        return BlockDraftConfig.for_target(
            target,
            _block_layers(target, config),
            num_hidden_layers=config.draft_layers,
            block_size=config.block_size,
            draft_vocab_size=size,
        )
    return MedusaHeadConfig.for_target(target, draft_vocab_size=size, num_heads=config.medusa_heads)


def _index_of(draft_vocab: torch.Tensor, vocab: int) -> torch.Tensor:
    """Token id -> index in the draft vocabulary, -100 (ignored by the loss) outside it."""
    table = torch.full((vocab,), -100, dtype=torch.long, device=draft_vocab.device)
    table[draft_vocab] = torch.arange(len(draft_vocab), device=draft_vocab.device)
    return table


def _coverage(examples: list[Example], draft_vocab: torch.Tensor, vocab: int) -> float:
    inside = torch.zeros(vocab, dtype=torch.bool)
    inside[draft_vocab.cpu()] = True
    labels = torch.cat([e.labels[e.answer_start :] for e in examples])
    return round(float(inside[labels].float().mean()), 4) if len(labels) else 0.0


def _describe(entry: dict[str, Any]) -> str:
    accepted = ", ".join(f"{a:.0%}" for a in entry["acceptance"])
    return (
        f"step {entry['step']} ({entry['seconds']} s): held-out acceptance by position {accepted}; "
        f"τ ≈ {entry['tau']}"
    )


def _checkpoint(folder: Path, head: Any, optimizer: Any, state: dict[str, Any]) -> None:
    save_head(head, folder)
    saved = {"optimizer": optimizer.state_dict(), **state}
    write_atomically(folder / STATE_NAME, lambda tmp: torch.save(saved, tmp))


def _resume(folder: Path, head: Any, optimizer: Any, state: dict[str, Any]) -> bool:
    if not (folder / STATE_NAME).is_file():
        return False
    # Tensors, numbers, strings and containers only: unpickling anything else could run code.
    try:
        saved = torch.load(folder / STATE_NAME, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise ValueError(
            f"The training checkpoint {folder / STATE_NAME} cannot be read: it holds Python objects besides "
            f"tensors and plain data, which could run code when loaded, so it was not. Delete {folder} to "
            "train from the start."
        ) from None
    except Exception as err:  # torch raises RuntimeError, EOFError... for a damaged file
        raise ValueError(
            f"The training checkpoint {folder / STATE_NAME} cannot be read ({type(err).__name__}): it is "
            f"damaged. Delete {folder} to train from the start."
        ) from None
    weights = read_weights(folder / "head.safetensors")
    check_saved_head(folder)
    _check_same_run(folder, head.config)
    if "draft_vocab" in weights:
        head.set_draft_vocab(weights["draft_vocab"])
    load_state(head, weights, folder / "head.safetensors")
    optimizer.load_state_dict(saved.pop("optimizer"))
    state.update(saved)
    return True


def _same_folder(saved: Any, now: Any) -> bool:
    """A target recorded as typed (a relative folder, before targets were recorded resolved) names
    the folder now resolved, read from where this run started."""
    return isinstance(saved, str) and Path(saved).is_dir() and Path(saved).resolve() == Path(str(now))


def check_resumable(out: Path, target: Any, config: TrainConfig) -> None:
    """Refuse a checkpoint in `out` that `train_head` would refuse to resume (`_check_same_run`), before
    the minutes of generating the training data and the target's features, which would also replace
    the data the checkpoint's own run cached."""
    folder = out / CHECKPOINT_DIR
    if (folder / STATE_NAME).is_file() and (folder / CONFIG_NAME).is_file():
        _check_same_run(folder, _head_config(target, config))


def _check_same_run(folder: Path, head_config: Any) -> None:
    """Refuse a checkpoint whose head differs from the one this run trains (another method, draft
    vocabulary or target): resuming it would train on from another run's weights and budget.
    Fields one side does not record (a checkpoint of an older version) are not compared."""
    saved = read_json_object(folder / CONFIG_NAME)
    now = head_config.to_dict()
    differs = [
        f"{name}: {saved[name]!r} in the checkpoint, {now[name]!r} now"
        for name in sorted(saved.keys() & now.keys())
        if saved[name] != now[name] and not (name == "target" and _same_folder(saved[name], now[name]))
    ]
    if differs:
        raise ValueError(
            f"The training checkpoint in {folder} was saved for another run ({'; '.join(differs)}). "
            f"Delete {folder} to train this head from the start, or write it to another folder."
        )
