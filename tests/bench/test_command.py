"""`hf_specdec.bench` and `hf-specdec bench` on a tiny random Llama that uses SmolLM2's real tokenizer."""

from __future__ import annotations

import json
import math
import os
from typing import ClassVar

import pytest
import torch
from transformers import AutoTokenizer

import hf_specdec
from hf_specdec import cli
from hf_specdec.bench import SUITES, overall, run_bench, save, summarize, to_markdown
from hf_specdec.bench.suites import Prompt, load_prompt_file, load_suite, take_per_category
from hf_specdec.drafters import DRAFTERS, Drafter, register_drafter
from hf_specdec.drafters.ngram import NgramDrafter

from ..conftest import tiny_llama

MAX_NEW = 6


@pytest.fixture(scope="module")
def result(tiny_folder):
    return run_bench(tiny_folder, suite="builtin", limit=1, max_new_tokens=MAX_NEW, progress=False)


def test_every_row_runs_on_every_prompt(result):
    rows = ["plain", "auto", "transformers_prompt_lookup"]  # by default what speculative=True does
    assert result.settings["rows"] == rows
    assert not result.interrupted
    categories = result.settings["categories"]
    assert len(categories) == 6 and result.settings["prompts"] == 6
    assert len(result.measurements) == len(rows) * len(categories)
    for m in result.measurements:
        assert m.error is None, m.error
        assert 0 < m.new_tokens <= MAX_NEW and m.seconds > 0
        # greedy, fp32: every row reproduces plain generate
        assert m.lossless == {"identical": 1, "tie": 0, "mismatch": 0} and m.differences == []
        assert (m.stats is not None) == (m.row == "auto")


def test_summary_figures_are_consistent(result):
    summary = summarize(result.measurements)
    for entry in summary:
        group = [m for m in result.measurements if (m.category, m.row) == (entry["category"], entry["row"])]
        plain = next(e for e in summary if (e["category"], e["row"]) == (entry["category"], "plain"))
        # One prompt per category: the medians are that prompt's own tokens/s.
        assert entry["median_tokens_per_s"] == pytest.approx(group[0].new_tokens / group[0].seconds)
        assert entry["speedup"] == pytest.approx(entry["median_tokens_per_s"] / plain["median_tokens_per_s"])
        assert entry["paired_speedup"] == pytest.approx(entry["speedup"])
        assert (entry["identical"], entry["tie"], entry["mismatch"]) == (1, 0, 0)
    for total in overall(result.measurements):
        speedups = [e["speedup"] for e in summary if e["row"] == total["row"]]
        geomean = math.exp(sum(map(math.log, speedups)) / len(speedups))
        assert total["geomean_speedup"] == pytest.approx(geomean)
    ours = next(t for t in overall(result.measurements) if t["row"] == "auto")
    assert 0.0 <= ours["acceptance_rate"] <= 1.0 and ours["mean_accepted_length"] >= 1.0
    tau = ours["mean_accepted_length_speculative"]
    assert tau == 0.0 or tau >= ours["mean_accepted_length"]  # 0.0: nothing was drafted


def test_the_paired_mean_takes_each_prompt_against_its_own_plain_run(result):
    """Two prompts of one category, one short and fast, one long and slow: the medians of tokens/s
    mix the prompts, the paired figure does not (2x and 1.5x on their own prompts: sqrt(3))."""
    from hf_specdec.bench.result import Measurement

    def run(prompt: str, row: str, tokens: int, seconds: float) -> Measurement:
        return Measurement(1, "qa", [prompt], row, seconds=seconds, new_tokens=tokens)

    measurements = [
        run("a", "plain", 100, 10.0),  # 10 tok/s
        run("a", "ngram", 100, 5.0),  # 20 tok/s: 2x
        run("b", "plain", 40, 2.0),  # 20 tok/s
        run("b", "ngram", 60, 2.0),  # 30 tok/s: 1.5x
    ]
    ngram = next(t for t in overall(measurements) if t["row"] == "ngram")
    assert ngram["geomean_speedup"] == pytest.approx(25 / 15)  # medians: (20 + 30) / 2 over (10 + 20) / 2
    assert ngram["paired_geomean_speedup"] == pytest.approx(math.sqrt(3.0))
    report = hf_specdec.bench.BenchResult({**result.settings, "batch_sizes": [1]}, measurements)
    assert "| geometric mean over prompts, paired | | | 1.73x |" in to_markdown(report)


def test_a_row_that_drafted_nothing_shows_no_acceptance_or_tau(result):
    """Stats report 0 for τ and acceptance when nothing was drafted; the table says there is none."""
    from hf_specdec.bench.result import Measurement
    from hf_specdec.core.stats import SpeculativeStats

    idle, busy = SpeculativeStats(method="ngram"), SpeculativeStats(method="suffix")
    idle.record_step(0, 0)  # plain steps only: the policy never drafted
    busy.record_step(4, 2)
    measurements = [
        Measurement(1, "qa", ["a"], "plain", seconds=1.0, new_tokens=10),
        Measurement(1, "qa", ["a"], "ngram", seconds=1.0, new_tokens=10, stats=idle),
        Measurement(1, "qa", ["a"], "suffix", seconds=1.0, new_tokens=10, stats=busy),
    ]
    markdown = to_markdown(
        hf_specdec.bench.BenchResult({**result.settings, "batch_sizes": [1]}, measurements)
    )
    assert "| ngram | 10.0 | 1.00x | 1.00x | – | – | – |" in markdown
    assert "| suffix | 10.0 | 1.00x | 1.00x | 50% | 3.00 | 4.0 |" in markdown


def test_save_writes_json_markdown_and_plots(result, tmp_path):
    pytest.importorskip("matplotlib")
    written = save(result, tmp_path)
    names = {p.name for p in written}
    assert names == {"results.json", "results.md", "speedup.png", "acceptance_by_position.png"}
    for path in written:
        assert path.stat().st_size > 0
    data = json.loads((tmp_path / "results.json").read_text())
    assert len(data["measurements"]) == len(result.measurements)
    assert data["measurements"][0]["tokens_per_s"] == pytest.approx(result.measurements[0].tokens_per_s)
    markdown = (tmp_path / "results.md").read_text()
    assert "geometric mean" in markdown and "### translation" in markdown
    assert "Not run: `draft_model`" in markdown
    assert "dtype float32, device cpu" in markdown and "native bf16" in markdown
    assert "| identical/tie/mismatch |" in markdown and "| 1 / 0 / 0 |" in markdown
    runtime = data["settings"]["runtime"]
    assert runtime["dtype"] == "float32" and runtime["device"] == "cpu"
    assert isinstance(runtime["native_bf16"], bool)
    assert data["summary"][0]["mismatch"] == 0


def test_save_without_plots_leaves_no_earlier_runs_plots(result, tmp_path):
    """`--no-plots` into a folder an earlier run plotted in kept that run's PNGs beside the new
    results.json and results.md, their figures another run's without a word."""
    pytest.importorskip("matplotlib")
    save(result, tmp_path)
    assert (tmp_path / "speedup.png").exists()
    written = save(result, tmp_path, plots=False)
    assert {p.name for p in tmp_path.iterdir()} == {p.name for p in written} == {"results.json", "results.md"}


def test_save_replaces_the_results_whole(result, tmp_path):
    """results.json was rewritten in place: a reader (export-serving --from-bench, a script polling
    the folder) that opened it while a run saved read a truncated file, as would every reader after
    a save cut short. Written beside it and renamed over it, a reader has the old file or the new."""
    (tmp_path / "results.json").write_text('{"earlier": "run"}\n')
    with (tmp_path / "results.json").open() as reader:
        save(result, tmp_path, plots=False)
        assert json.loads(reader.read()) == {"earlier": "run"}
    saved = json.loads((tmp_path / "results.json").read_text())
    assert len(saved["measurements"]) == len(result.measurements)
    assert {p.name for p in tmp_path.iterdir()} == {"results.json", "results.md"}  # no temporary file left


def test_the_header_counts_in_words(tiny_folder, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Count to 3.", "category": "c"}))
    result = run_bench(tiny_folder, prompts=prompts, max_new_tokens=2, progress=False)
    assert "1 prompt in 1 category;" in to_markdown(result)
    assert 0.0 <= result.settings["cpu_taken_by_others"] <= 1.0


def test_batched_rows_skip_transformers_baselines(tiny_folder, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Count to {n}.", "category": "c"}) for n in (3, 7)))
    result = run_bench(tiny_folder, prompts=prompts, batch_sizes=[2], max_new_tokens=MAX_NEW, progress=False)
    assert [m.row for m in result.measurements] == ["plain", "auto"]
    assert all(m.batch_size == 2 and m.lossless["identical"] == 2 for m in result.measurements)
    assert all(m.error is None for m in result.measurements)


def test_a_batch_size_a_category_cannot_fill_is_refused(tiny_folder):
    """Batches are formed within a category: `--batch-sizes 2 --limit 1` ran every call on one prompt
    and reported the figures under "batch size 2" (batched speedups are not batch 1's)."""
    with pytest.raises(ValueError, match=r"--batch-sizes 2: category qa has 1 prompt.*--limit 2"):
        run_bench(tiny_folder, limit=1, categories=["qa"], batch_sizes=[2], progress=False)


def test_a_failing_row_is_reported_and_the_others_kept(tiny_folder, monkeypatch, tmp_path):
    def boom(self, request):
        raise RuntimeError("drafter exploded")

    monkeypatch.setattr(NgramDrafter, "proposals", boom)  # auto's suffix drafter asks prompt lookup
    result = run_bench(tiny_folder, limit=1, max_new_tokens=MAX_NEW, progress=False)
    errors = [m for m in result.measurements if m.error]
    assert errors and all(m.row == "auto" and "drafter exploded" in m.error for m in errors)
    assert all(m.error is None for m in result.measurements if m.row != "auto")
    markdown = to_markdown(result)
    assert "| error |" in markdown.split("###")[0]  # the overview marks the failed row per category
    assert "RuntimeError: drafter exploded" in markdown


def test_ctrl_c_keeps_results_so_far(tiny_folder, monkeypatch):
    from hf_specdec.bench import runner

    calls = {"n": 0}
    real = runner._time_row

    def interrupt_late(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 3 + 4:  # 3 warm-up runs, then 4 measured runs
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "_time_row", interrupt_late)
    result = run_bench(tiny_folder, limit=1, max_new_tokens=MAX_NEW, progress=False)
    assert result.interrupted and len(result.measurements) == 4
    assert "Interrupted" in to_markdown(result)


def test_cli_writes_files(tiny_folder, tmp_path, capsys):
    out, markdown = tmp_path / "out", tmp_path / "BENCH.md"
    argv = ["bench", "--model", str(tiny_folder), "--limit", "1", "--max-new-tokens", "4"]
    argv += ["--no-transformers", "--no-plots", "--quiet", "--out", str(out), "--markdown", str(markdown)]
    argv += ["--note", "A note for the header.", "--dtype", "bfloat16", "--device", "cpu"]
    assert cli.main(argv) == 0
    assert json.loads((out / "results.json").read_text())["settings"]["runtime"]["dtype"] == "bfloat16"
    assert (out / "results.json").exists() and not (out / "speedup.png").exists()
    text = markdown.read_text()
    assert text == (out / "results.md").read_text() and "A note for the header." in text
    assert "transformers_prompt_lookup" not in text
    assert "## Speedup vs plain generate, batch size 1" in capsys.readouterr().out


def test_cli_exits_1_when_a_row_failed_on_every_prompt(tiny_folder, monkeypatch, tmp_path, capsys):
    """A row that raised on every prompt measured nothing, yet `hf-specdec bench` exited 0: a script
    running it learnt nothing. The report is still written; the exit status is 1 and stderr names
    the row with its error."""

    def boom(self, request):
        raise RuntimeError("drafter exploded")

    monkeypatch.setattr(NgramDrafter, "proposals", boom)
    out = tmp_path / "out"
    argv = ["bench", "--model", str(tiny_folder), "--methods", "ngram,suffix", "--limit", "1"]
    argv += ["--max-new-tokens", "4", "--no-transformers", "--no-plots", "--quiet", "--out", str(out)]
    assert cli.main(argv) == 1
    assert (out / "results.json").exists()
    err = capsys.readouterr().err
    assert "2 row(s) failed on every prompt:\n- ngram (batch size 1): RuntimeError: drafter exploded" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--methods", "ngram,lookahead"],
            "valid methods: assistant, auto, dflash, draft_model, dspark, eagle, medusa, mtp, ngram, onnx, "
            "quantized, suffix",
        ),
        (["--methods", "ngram,medusa"], "needs a trained head: pass --head medusa=FOLDER"),
        (["--head", "eagle"], "--head takes METHOD=FOLDER"),
        (["--head", "eagle=a", "--head", "eagle=b"], "--head eagle= is given twice (a, b)"),
        (["--categories", "poetry"], "No prompts of category poetry"),
        (["--methods", "draft_model"], "needs a draft model"),
        (["--methods", "onnx"], "Method onnx needs an ONNX draft: pass --draft FOLDER"),
        (
            ["--methods", "ngram,ngram+tree", "--static-cache"],
            "ngram+tree: tree drafts over a static cache are not built yet; drop --static-cache",
        ),
        (["--methods", "ngram+tree", "--compile"], "drop --compile"),
        (["--chat-template"], "has no chat template"),
        (["--batch-sizes", "0"], "positive integers"),
        # given but naming nothing (a script's empty variable, a stray comma): the default ran instead
        (["--methods", ",,"], "--methods names no method: pass some, e.g. --methods auto,ngram"),
        (["--methods", ""], "--methods names no method"),
        (["--categories", " , "], "--categories names no category"),
        # both runs went into one report under that batch size: twice the prompts, plain paired with
        # its other run (not 1.00x), and the section printed twice
        (["--batch-sizes", "1,2,1"], "Batch sizes are listed twice: [1, 2, 1]; list each once."),
        # Refused before the model loads: every row failed alone, or the run was lost at the end.
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
        (
            ["--methods", "eagle", "--head", "eagle=/no/such/head"],
            "--head eagle=/no/such/head: no such folder",
        ),
        (["--out", "{file}"], "is a file; pass a folder for the results"),
        (["--markdown", "/no/such/folder/report.md"], "--markdown /no/such/folder/report.md: pass a file"),
        # a folder that exists but takes no files (as one of another user's would): the run's figures
        # were lost when saving them failed at its end
        pytest.param(
            ["--out", "/proc/self"],
            "--out /proc/self: cannot write files in that folder",
            marks=pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="Linux /proc"),
        ),
    ],
)
def test_cli_errors(tiny_folder, tmp_path, capsys, argv, message):
    if argv == ["--chat-template"]:  # a model whose tokenizer has no chat template
        folder = tmp_path / "no-template"
        AutoTokenizer.from_pretrained(tiny_folder).save_pretrained(folder)
        (folder / "chat_template.jinja").unlink(missing_ok=True)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        for name in ("config.json", "model.safetensors"):
            (folder / name).write_bytes((tiny_folder / name).read_bytes())
        argv = [*argv, "--model", str(folder)]
    else:
        argv = [*argv, "--model", str(tiny_folder)]
    (tmp_path / "a-file").write_text("")
    argv = [a.replace("{file}", str(tmp_path / "a-file")) for a in argv]
    out = [] if "--out" in argv else ["--out", str(tmp_path / "o")]
    try:
        code = cli.main(["bench", *argv, "--quiet", *out])
    except SystemExit as exit_:
        code = exit_.code
    assert code != 0
    assert message in capsys.readouterr().err


def test_cli_refuses_a_draft_that_is_not_a_causal_lm_in_one_line(tiny_folder, t5_folder, tmp_path, capsys):
    """`bench --draft ./t5` printed AutoModelForCausalLM's list of every causal config class."""
    argv = ["bench", "--model", str(tiny_folder), "--draft", str(t5_folder), "--methods", "draft_model"]
    argv += ["--limit", "1", "--max-new-tokens", "2", "--no-plots", "--quiet", "--out", str(tmp_path)]
    assert cli.main(argv) == 2
    error = capsys.readouterr().err.partition("error: ")[2]  # after the target's loading bar
    assert f"The draft {t5_folder} is a t5 model (T5ForConditionalGeneration), not a causal LM" in error
    assert error.count("\n") == 1 and len(error) < 400, error


def test_a_prompt_past_the_models_context_is_refused(tiny_folder, tmp_path):
    """A prompt longer than the model's context was timed like any other, transformers only logging a
    "friendly reminder": the rows' outputs past it are the model's noise, their speedups reported
    beside the others'. Refused before anything is timed, naming the prompt and what to do."""
    context = json.loads((tiny_folder / "config.json").read_text())["max_position_embeddings"]
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "Say hi.", "id": "short"}, {"prompt": "word " * context, "id": "long"}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ValueError, match=rf"Prompt long \(custom\) is \d+ tokens.*context of {context}"):
        run_bench(tiny_folder, prompts=prompts, max_new_tokens=MAX_NEW, progress=False)
    # the tokens generated count too: a prompt that fits, but not with --max-new-tokens more
    prompts.write_text(json.dumps({"prompt": "Say hi.", "id": "short"}) + "\n")
    with pytest.raises(ValueError, match=r"Prompt short \(custom\) is \d+ tokens.*lower --max-new-tokens"):
        run_bench(tiny_folder, prompts=prompts, max_new_tokens=context, progress=False)


def test_a_prompt_within_a_yarn_scaled_context_is_taken(tiny_folder, tmp_path):
    """A model whose YaRN rope scaling extends its context past max_position_embeddings (as Qwen's
    model cards have users add: factor 4 over an original_max_position_embeddings equal to it) was
    refused prompts it can take: the check read max_position_embeddings alone. transformers 5.25
    defines YaRN's context as original_max_position_embeddings times factor."""
    folder = tmp_path / "yarn"
    folder.mkdir()
    for file in tiny_folder.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    rope = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 1e4}
    config |= {"max_position_embeddings": 32, "rope_parameters": rope}
    (folder / "config.json").write_text(json.dumps(config))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "word " * 60, "id": "long"}) + "\n")
    result = run_bench(
        folder, prompts=prompts, methods=["ngram"], max_new_tokens=2, transformers_baselines=False,
        chat_template=False, progress=False,
    )  # fmt: skip
    assert all(m.error is None for m in result.measurements)
    prompts.write_text(json.dumps({"prompt": "word " * 130, "id": "longer"}) + "\n")
    with pytest.raises(ValueError, match=r"Prompt longer \(custom\) is \d+ tokens.*context of 128 \(yarn"):
        run_bench(folder, prompts=prompts, methods=["ngram"], max_new_tokens=2, progress=False)


def test_an_onnx_row_drafts_with_the_export_given_as_draft(tiny_folder, tmp_path):
    """`--methods onnx --draft <export-onnx folder>`: the onnx row drafts with that folder (it was given
    no draft, so every run failed with 'needs draft=')."""
    from hf_specdec.ort import export_onnx

    folder = tmp_path / "onnx"
    export_onnx(str(tiny_folder), folder, progress=False)
    result = run_bench(
        tiny_folder, draft=str(folder), methods=["onnx"], limit=1, max_new_tokens=MAX_NEW, progress=False
    )
    rows = [m for m in result.measurements if m.row == "onnx"]
    assert rows and all(m.error is None and m.stats.method == "onnx" for m in rows)
    assert all(m.lossless["mismatch"] == 0 for m in rows)


def test_unknown_suite_lists_the_valid_ones(capsys):
    with pytest.raises(
        ValueError, match="valid suites: specbench, specbench-quick, specbench-train, mtbench"
    ):
        load_suite("spec-bench")
    with pytest.raises(SystemExit):
        cli.main(["bench", "--suite", "nope"])
    assert "'nope' is none of builtin, specbench, specbench-quick" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "is empty"),
        ("\n  \n", "is empty"),
        ('{"prompt": "ok"}\n{"prompt": "ok", \n', "line 2: not valid JSON"),
        ("Summarize this.\n", r"line 1: not valid JSON .*; a prompt file is JSONL"),  # a .txt of prompts
        ('{"prompt": "ok"}\n\n["a list"]\n', "line 3: expected a JSON object"),
        ('{"category": "qa"}\n', "line 1: needs a non-empty 'prompt'"),
        ('{"turns": []}\n', "line 1: needs a non-empty 'prompt'"),
        # paired speedups are keyed by prompt id: two prompts under one id would divide one by the other
        ('{"prompt": "b", "id": 1}\n{"prompt": "c", "id": 1}\n', "line 2: prompt id '1' is already line 1's"),
        ('{"prompt": "b", "id": 2}\n{"prompt": "c"}\n', "line 2: prompt id '2' is already line 1's"),
        # read as given, these were cast: "false" fed the prompt without its chat template, a null
        # category made one called "None"
        (
            '{"prompt": "p", "raw": "false"}\n',
            r"line 1: 'raw' is true or false \(a JSON boolean\), got \"false\"\.",
        ),
        ('{"prompt": "p", "category": null}\n', "line 1: 'category' is a non-empty string, got null"),
        ('{"prompt": "p", "id": [1]}\n', "line 1: 'id' is a non-empty string or an integer, got \\[1\\]"),
    ],
)
def test_prompt_file_errors_name_the_line(tmp_path, content, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_prompt_file(path)


def test_a_prompt_file_that_is_not_utf8_or_not_gzip_is_named(tmp_path):
    """Both reached the user as the codec's bare message ("'utf-8' codec can't decode byte 0xff in
    position 0", "Not a gzipped file"), naming no file."""
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin.jsonl is not UTF-8 text \(invalid continuation byte\)"):
        load_prompt_file(latin)
    fake = tmp_path / "prompts.jsonl.gz"
    fake.write_text('{"prompt": "p"}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl.gz ends in .gz but is not gzip-compressed"):
        load_prompt_file(fake)


def test_a_prompt_folder_is_named_a_folder(tmp_path):
    with pytest.raises(ValueError, match="is a folder: pass a JSONL file"):
        load_prompt_file(tmp_path)


def test_prompt_file_fields(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"turns": ["first", "second"], "category": "qa", "question_id": 7}\n{"prompt": "p"}\n')
    first, second = load_prompt_file(path)
    assert (first.id, first.category, first.text) == ("7", "qa", "first")
    assert (second.id, second.category, second.raw) == ("2", "custom", False)


def test_shared_suites_load():
    sizes = {"specbench": 480, "mtbench": 80, "humaneval": 164, "builtin": 12}
    for name, size in sizes.items():
        try:
            prompts = load_suite(name)
        except ValueError as err:
            pytest.skip(str(err))
        assert len(prompts) == size
    quick = load_suite("specbench-quick")
    categories = {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}
    assert {p.category for p in quick} == categories and len(quick) == 3 * len(categories)
    assert all(p.raw for p in load_suite("humaneval"))
    assert set(SUITES) == {
        "specbench",
        "specbench-quick",
        "specbench-train",
        "mtbench",
        "humaneval",
        "builtin",
    }
    train = load_suite("specbench-train")  # where heads train: never a prompt the quick suite measures
    assert len(train) == 480 - len(quick) and not {p.id for p in train} & {p.id for p in quick}
    assert len(take_per_category(load_suite("builtin"), 1)) == 6


def test_tree_rows_and_their_refusals(target):
    from hf_specdec.bench.runner import _check_methods, _rows

    _check_methods(["ngram", "ngram+tree"], None, {})
    rows = _rows(["ngram+tree"], (target, None), (None, None), {}, "auto", False, False)
    assert [r.name for r in rows][1:] == ["ngram+tree"]
    assert (
        rows[1].kwargs["speculative"]["tree"] is True and rows[1].kwargs["speculative"]["method"] == "ngram"
    )

    # Every built-in drafter grows trees; a user's chain-only drafter is refused with `+tree`.
    class _Chains(Drafter):
        name: ClassVar[str] = "_chains_only"

        @classmethod
        def from_config(cls, config, target, tokenizer):
            return cls()

        def propose(self, request):
            raise AssertionError("not run")

    register_drafter(_Chains)
    try:
        with pytest.raises(ValueError, match=r"_chains_only\+tree: only .*ngram.* draft trees"):
            _check_methods(["_chains_only+tree"], None, {})
    finally:
        DRAFTERS.pop("_chains_only")
    with pytest.raises(ValueError, match=r"valid methods: .*\+tree"):
        _check_methods(["nope+tree"], None, {})


@pytest.mark.parametrize("sample", [False, True])
def test_transformers_assisted_row_runs_a_draft_of_another_tokenizer(
    tiny_folder, tmp_path, monkeypatch, sample
):
    """transformers runs a draft of another vocabulary only given both tokenizers (universal assisted
    decoding): without them its row failed on every prompt and the run exited 1. Sampling, it prunes
    the LM head and swaps the embeddings of the draft it is given: not the one our rows share."""
    from hf_specdec.bench import runner

    from ..helpers.tokenizers import byte_level_bpe

    draft_tokenizer = byte_level_bpe(400)
    folder = tmp_path / "other-tokenizer-draft"
    tiny_llama(1, len(draft_tokenizer), eos_token_id=draft_tokenizer.eos_token_id).save_pretrained(folder)
    draft_tokenizer.save_pretrained(folder)
    real, loaded = runner._load_draft, []

    def keep(draft, target):  # the draft our rows share, to look at afterwards
        loaded.append(real(draft, target))
        return loaded[-1]

    monkeypatch.setattr(runner, "_load_draft", keep)
    result = run_bench(
        tiny_folder, draft=str(folder), methods=["draft_model"], prompts=[Prompt("a", "qa", "the fox ran")],
        max_new_tokens=MAX_NEW, sample=sample, progress=False,
    )  # fmt: skip
    assisted = [m for m in result.measurements if m.row == "transformers_assisted"]
    assert assisted and all(m.error is None for m in assisted), assisted[0].error
    if not sample:
        for m in result.measurements:
            assert m.error is None and m.lossless == {"identical": 1, "tie": 0, "mismatch": 0}, m.row
    draft = loaded[0][0]
    assert draft.get_output_embeddings().weight.shape[0] == len(draft_tokenizer)
    assert type(draft.get_input_embeddings()) is torch.nn.Embedding


def test_repeats_time_every_row_again_and_keep_the_median(tiny_folder, monkeypatch):
    """Three rounds per prompt, every row in each; one measurement per row and prompt, its time the
    median of the three (here scripted 3, 1, 2 s on top of the real runs), the first run's output."""
    from hf_specdec.bench import runner

    real, calls = runner._time_row, []

    def scripted(model, row, inputs, generation, seed):
        measurement, out = real(model, row, inputs, generation, seed)
        if generation["max_new_tokens"] == MAX_NEW:  # not the warm-up
            calls.append(row.name)
            measurement.seconds = [3.0, 1.0, 2.0][(len(calls) - 1) // 3 % 3]
        return measurement, out

    monkeypatch.setattr(runner, "_time_row", scripted)
    prompts = [Prompt("a", "qa", "Say something about cats."), Prompt("b", "qa", "And about dogs?")]
    result = run_bench(tiny_folder, prompts=prompts, max_new_tokens=MAX_NEW, repeats=3, progress=False)
    assert result.settings["repeats"] == 3
    assert len(result.measurements) == 3 * 2  # plain, ngram, prompt lookup; two prompts
    assert sorted(calls) == sorted(["plain", "auto", "transformers_prompt_lookup"] * 6)
    assert all(m.seconds == 2.0 and m.error is None for m in result.measurements)
    assert all(m.lossless == {"identical": 1, "tie": 0, "mismatch": 0} for m in result.measurements)
    assert "median of 3 interleaved runs" in to_markdown(result)
    with pytest.raises(ValueError, match="repeats must be at least 1"):
        run_bench(tiny_folder, prompts=prompts, repeats=0, progress=False)


def test_compile_runs_every_row_on_the_compiled_static_cache(tiny_folder, fresh_dynamo):
    """`compile=`: plain generate and ours on a static cache, the decode step compiled (dynamo traces
    the graphs and runs them eagerly: inductor takes minutes on a small CPU); every verify width is
    compiled before timing, so no graph is compiled inside a timed call, and the outputs stay plain's."""
    from transformers import CompileConfig

    traced: list[int] = []

    def backend(graph, example_inputs):
        traced.append(1)
        return graph.forward

    config = CompileConfig(backend=backend, fullgraph=True, mode=None)
    # The second prompt is the longer: its cache too, unless the first call sized it for both.
    prompts = [Prompt("a", "qa", "Cats?"), Prompt("b", "qa", "Say something about dogs and their owners.")]
    result = run_bench(tiny_folder, prompts=prompts, max_new_tokens=MAX_NEW, compile=config, progress=False)
    assert result.settings["cache_implementation"] == "static" and result.settings["compiled"]
    assert not getattr(config, "_compile_all_devices", None)  # the caller's config is left as it was
    assert len(traced) >= 3  # plain's step and our widths 2 and 4 at least (6 new tokens: no wider)
    assert result.settings["graphs_compiled_while_timing"] == 0
    assert all(m.error is None for m in result.measurements)
    ours = [m for m in result.measurements if m.row == "auto"]
    assert all(m.lossless == {"identical": 1, "tie": 0, "mismatch": 0} for m in ours)
    assert "decode step compiled" in to_markdown(result)


def test_compile_refuses_several_batch_sizes(tiny_folder):
    """Their graphs would pass dynamo's limit and run eagerly while the report says compiled."""
    with pytest.raises(ValueError, match=r"--compile times one batch size per process \(got \[1, 2\]\)"):
        run_bench(tiny_folder, batch_sizes=[1, 2], compile=True, progress=False)


def test_static_cache_runs_every_row_on_it(tiny_folder):
    prompts = [Prompt("a", "qa", "Say something about cats.")]
    result = run_bench(
        tiny_folder, prompts=prompts, max_new_tokens=MAX_NEW, static_cache=True, progress=False
    )
    assert result.settings["cache_implementation"] == "static" and not result.settings["compiled"]
    assert "graphs_compiled_while_timing" not in result.settings
    assert all(m.error is None for m in result.measurements)
    assert "Cache: static" in to_markdown(result)
