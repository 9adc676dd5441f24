"""Evaluation: validation loss vs r (API, offline CLI, DCP input), the lm-eval model and sweep, task configs."""

from __future__ import annotations

import functools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from titan_recur import load_model
from titan_recur.cli.eval import main as eval_main
from titan_recur.convert.surgery import ConvertOptions, convert, plan_layers
from titan_recur.models.loss import cross_entropy_loss
from titan_recur.storage.checkpoint import ModelState
from titan_recur.storage.manifest import seal_folder
from titan_recur.training.validation import mean_losses, validation_loss_sums

REPO = Path(__file__).resolve().parents[2]
DEBUG_MODEL = REPO / "assets" / "tiny_llama_recurrent"
LM_EVAL_TASKS = REPO / "tests" / "assets_lm_eval"
TINY_TASKS = ["titan_recur_tiny_choice", "titan_recur_tiny_gen", "titan_recur_tiny_rolling"]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No downloads; the tiny lm-eval tasks name their data relative to the repository root."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(REPO)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pretrained tiny Llama retrofitted 2,4,2 with a random adapter, so the output depends on r."""
    folder = tmp_path_factory.mktemp("eval") / "tiny_random_adapter"
    convert(REPO / "assets" / "tiny_llama", folder, plan_layers(8, (2, 4, 2)), ConvertOptions(adapter_init="random"))
    return folder


def validation_losses(model, batches, recurrences, device) -> dict[int, float]:
    """{r: token-weighted mean loss} on one process's batches."""
    return mean_losses(validation_loss_sums(model, batches, recurrences, device))


def make_batches(seed: int = 0) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for size in (3, 2):
        ids = torch.randint(3, 512, (size, 17), generator=gen)
        labels = ids[:, 1:].clone()
        labels[0, :5] = -100  # ignored tokens must not count
        batches.append({"input_ids": ids[:, :-1], "labels": labels})
    return batches


def test_validation_losses_are_token_weighted_and_deterministic(model_dir: Path) -> None:
    model = load_model(model_dir)
    assert model.args.state_init == "normal"  # the eval init is zero regardless: no RNG in the result
    batches = make_batches()
    losses = validation_losses(model, iter(batches), [1, 4], "cpu")  # a one-shot iterator is read once
    assert losses == validation_losses(model, batches, [1, 4], "cpu")
    for r in (1, 4):
        total = sum(
            cross_entropy_loss(model(b["input_ids"], r, state_init="zero"), b["labels"]).item()
            * (b["labels"] != -100).sum().item()
            for b in batches
        )
        n_tokens = sum((b["labels"] != -100).sum().item() for b in batches)
        assert losses[r] == pytest.approx(total / n_tokens, rel=1e-6)
    assert abs(losses[1] - losses[4]) > 1e-3  # the random adapter makes depth matter


def test_validation_loss_sums_add_across_ranks(model_dir: Path) -> None:
    """Per-rank (sum, count) pairs, summed as an all-reduce would, give the loss over all batches."""
    model = load_model(model_dir)
    batches = make_batches()
    per_rank = [validation_loss_sums(model, [b], [2], "cpu") for b in batches]
    reduced = {2: (sum(s[2][0] for s in per_rank), sum(s[2][1] for s in per_rank))}
    assert reduced[2][1] == (3 + 2) * 16 - 2 * 5
    assert mean_losses(reduced)[2] == pytest.approx(validation_losses(model, batches, [2], "cpu")[2], rel=1e-9)


@pytest.mark.parametrize("recurrences", [[0], [], [2, -1]])
def test_validation_rejects_bad_recurrences(model_dir: Path, recurrences: list[int]) -> None:
    with pytest.raises(ValueError, match="recurrences"):
        validation_losses(load_model(model_dir), make_batches(), recurrences, "cpu")


def run_loss_cli(*args: str) -> int:
    return eval_main(["loss", "--batches", "2", "--batch-size", "2", "--seq-len", "32", *args])


def test_loss_cli_on_debug_model_writes_json_and_png(tmp_path: Path) -> None:
    import matplotlib.image

    out = tmp_path / "sweep"
    data = str(REPO / "assets" / "corpus" / "math.jsonl")
    argv = ["--checkpoint", str(DEBUG_MODEL), "--data", data, "--recurrences", "1,2,4", "--out", str(out)]
    assert run_loss_cli(*argv) == 0
    report = json.loads((out / "validation_loss.json").read_text())
    assert report["recurrences"] == [1, 2, 4] and report["tokens"] == 2 * 2 * 32
    assert report["state_init"] == "zero" and all(math.isfinite(v) for v in report["loss"].values())
    image = matplotlib.image.imread(out / "validation_loss.png")
    assert image.ndim == 3 and image.shape[0] > 100


def test_loss_cli_reads_dcp_step_and_train_config_validation_split(model_dir: Path, tmp_path: Path) -> None:
    """A DCP step folder (+ --model-config) gives the model folder's losses; --config uses the held-out split."""
    step = tmp_path / "checkpoints" / "step-7"
    dcp.save({"model": ModelState(load_model(model_dir))}, checkpoint_id=str(step))
    seal_folder(step, "checkpoint")  # a step folder carries its manifest, as the trainer writes it
    config = tmp_path / "train.toml"
    config.write_text(
        f'[model]\npath = "{model_dir}"\n[data]\nvalidation_fraction = 0.2\n'
        '[[data.sources]]\npath = "assets/corpus/math.jsonl"\nkind = "jsonl"\n'
    )
    reports = {}
    for name, source in {
        "folder": ["--checkpoint", str(model_dir)],
        "dcp": ["--checkpoint", str(step), "--model-config", str(model_dir)],
    }.items():
        argv = [*source, "--config", str(config), "--recurrences", "1,3", "--out", str(tmp_path / name)]
        assert run_loss_cli(*argv) == 0
        reports[name] = json.loads((tmp_path / name / "validation_loss.json").read_text())
    assert reports["dcp"]["loss"] == reports["folder"]["loss"]
    assert reports["folder"]["data"].endswith("(validation split)")


def last_line(stderr: str) -> str:
    """The CLI's one-line error (library warnings may precede it)."""
    line = stderr.strip().splitlines()[-1]
    assert line.startswith("python -m titan_recur.eval "), stderr
    return line


def test_loss_cli_errors_are_one_line(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    data = ["--data", str(REPO / "assets" / "corpus" / "math.jsonl"), "--out", str(tmp_path / "o")]
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(model_dir, no_tokenizer, ignore=shutil.ignore_patterns("tokenizer*"))
    cases = {
        "no such checkpoint": ["--checkpoint", str(tmp_path / "missing")],
        "no tokenizer found": ["--checkpoint", str(no_tokenizer)],
        "recurrences must be": ["--checkpoint", str(model_dir), "--recurrences", "0,2"],
        "no file matches": ["--checkpoint", str(model_dir), "--data", str(tmp_path / "nothing.jsonl")],
    }
    for message, args in cases.items():
        assert run_loss_cli(*data, *args) == 2, message
        assert message in last_line(capsys.readouterr().err)
    step = tmp_path / "step-1"
    dcp.save({"model": ModelState(load_model(model_dir))}, checkpoint_id=str(step))
    assert run_loss_cli(*data, "--checkpoint", str(step), "--tokenizer", str(model_dir)) == 2
    assert "--model-config" in last_line(capsys.readouterr().err)


# ------------------------------------------------------------------ lm-eval-harness


@pytest.fixture(scope="module")
def task_manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(LM_EVAL_TASKS), include_defaults=False)


def test_lm_eval_batch_size_8_equals_batch_size_1(model_dir: Path, task_manager) -> None:
    """loglikelihood, loglikelihood_rolling and generate_until through lm_eval's API: per-sample equality."""
    from lm_eval import simple_evaluate

    import titan_recur.eval.lm_eval_model  # noqa: F401  (registers "titan_recur")

    samples = {}
    for batch_size in (1, 8):
        result = simple_evaluate(
            model="titan_recur",
            model_args=f"pretrained={model_dir},num_steps=3,batch_size={batch_size}",
            tasks=TINY_TASKS,
            task_manager=task_manager,
            log_samples=True,
        )
        samples[batch_size] = {task: [s["resps"] for s in result["samples"][task]] for task in TINY_TASKS}
    one, eight = samples[1], samples[8]
    for task in ("titan_recur_tiny_choice", "titan_recur_tiny_rolling"):
        flat1 = [r for doc in one[task] for req in doc for r in req]
        flat8 = [r for doc in eight[task] for req in doc for r in req]
        assert len(flat1) == len(flat8) >= 10
        for a, b in zip(flat1, flat8, strict=True):
            a, b = (a, b) if isinstance(a, tuple) else ((a, None), (b, None))
            assert a[0] == pytest.approx(b[0], rel=1e-5, abs=1e-4) and a[1] == b[1], task
    generations = [doc[0][0] for doc in one["titan_recur_tiny_gen"]]
    assert generations == [doc[0][0] for doc in eight["titan_recur_tiny_gen"]]
    assert len(set(generations)) > 1 and all(generations)


def choice_accuracy(model_dir: Path, r: int, limit: int) -> float:
    """The tiny choice task's accuracy computed by hand: one unbatched forward per (question, choice).

    As lm_eval scores it: context "Question: q\nAnswer:", continuation " choice" (the tokens the
    whole text adds after the context's own), context starting with BOS, argmax of summed log-probs.
    """
    from titan_recur.data.tokenizer import load_tokenizer

    model, tokenizer = load_model(model_dir), load_tokenizer(model_dir)
    docs = [json.loads(line) for line in (LM_EVAL_TASKS / "tiny.jsonl").read_text().splitlines()[:limit]]
    correct = 0
    for doc in docs:
        context = f"Question: {doc['question']}\nAnswer:"
        context_ids = tokenizer.encode(context, bos=tokenizer.add_bos, eos=False)
        scores = []
        for choice in doc["choices"]:
            whole = tokenizer.encode(context + " " + choice, bos=tokenizer.add_bos, eos=False)
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([whole[:-1]]), r, state_init="zero")[0], -1)
            positions = range(len(context_ids) - 1, len(whole) - 1)
            scores.append(sum(logprobs[i, whole[i + 1]].item() for i in positions))
        correct += max(range(len(scores)), key=scores.__getitem__) == doc["answer"]
    return correct / len(docs)


def test_harness_sweep_one_load_table_per_r(model_dir: Path, task_manager, tmp_path: Path) -> None:
    from titan_recur.eval.harness import harness_sweep, results_table, write_results
    from titan_recur.eval.lm_eval_model import TitanRecurLM

    lm = TitanRecurLM(pretrained=str(model_dir), batch_size=4)
    results = harness_sweep(lm, ["titan_recur_tiny_choice"], [1, 3], task_manager, limit=8)
    rows = results_table(results)
    expected = {str(r): choice_accuracy(model_dir, r, limit=8) for r in (1, 3)}
    assert rows == [
        {"task": "titan_recur_tiny_choice", "metric": "acc,none", **expected},
        {"task": "titan_recur_tiny_choice", "metric": "mean_iterations", "1": 1.0, "3": 3.0},
    ]
    table_json, table_md = write_results(results, tmp_path)
    assert json.loads(table_json.read_text()) == rows
    assert "| titan_recur_tiny_choice | acc,none |" in table_md.read_text()
    assert (tmp_path / "results_r3.json").is_file()


def index_without_lm_eval_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    """CLIs build their TaskManager with lm_eval's ~15k built-in configs (~8 s); tests leave those out."""
    import lm_eval.tasks

    manager = functools.partial(lm_eval.tasks.TaskManager, include_defaults=False)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", manager)


def test_harness_cli_writes_table(model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The primary command, end to end."""
    import matplotlib.image

    index_without_lm_eval_tasks(monkeypatch)
    argv = [
        "harness",
        "--model_args",
        f"pretrained={model_dir},batch_size=8",
        "--include_path",
        str(LM_EVAL_TASKS),
        "--tasks",
        "titan_recur_tiny_gen",
        "--recurrences",
        "2,4",
        "--limit",
        "3",
        "--log_samples",
        "--out",
        str(tmp_path),
    ]
    assert eval_main(argv) == 0
    assert "| titan_recur_tiny_gen | exact_match,flexible-extract |" in (tmp_path / "table.md").read_text()
    assert (tmp_path / "samples_r4.json").is_file()
    image = matplotlib.image.imread(tmp_path / "accuracy_vs_r.png")  # accuracy vs r, one line per metric
    assert image.ndim == 3 and image.shape[0] > 100


def test_harness_cli_runs_a_task_group_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--tasks OUT/perm.yaml, the group tools/make_depth_task.py writes: its tasks resolve from its folder."""
    from tests.torchrun_util import load_tool

    index_without_lm_eval_tasks(monkeypatch)
    task = tmp_path / "task"
    argv = ["--out", str(task), "--eval-lengths", "6-7", "--train-examples", "10", "--eval-examples", "3"]
    assert load_tool("make_depth_task").main(argv) == 0
    out = tmp_path / "out"
    argv = ["harness", "--model_args", f"pretrained={DEBUG_MODEL},max_gen_toks=2", "--tasks", str(task / "perm.yaml")]
    assert eval_main([*argv, "--recurrences", "1", "--out", str(out)]) == 0
    table = (out / "table.md").read_text()
    assert all(f"| {name} | exact_match,flexible-extract |" in table for name in ("perm", "perm_6", "perm_7"))


def test_unknown_task_is_a_clear_error(task_manager) -> None:
    from titan_recur.eval.harness import check_tasks

    assert check_tasks(["titan_recur_tiny_*", str(LM_EVAL_TASKS / "tiny_gen.yaml")], task_manager)
    with pytest.raises(ValueError, match=r"unknown task\(s\) \['no_such_task'\]"):
        check_tasks(["titan_recur_tiny_gen", "no_such_task"], task_manager)


@pytest.mark.parametrize(
    "model_args, message",
    [
        ("num_steps=0", "recurrences"),
        ("state_init=random", "state_init"),
        ("batch_size=auto", "batch_size"),
        ("nonsense=1", "nonsense"),
    ],
)
def test_bad_model_args(model_dir: Path, model_args: str, message: str) -> None:
    from lm_eval.utils import simple_parse_args_string

    from titan_recur.eval.lm_eval_model import TitanRecurLM

    with pytest.raises((ValueError, TypeError), match=message):
        TitanRecurLM(**simple_parse_args_string(f"pretrained={model_dir},{model_args}"))


def test_unverified_model_arg_loads_a_folder_without_its_manifest(model_dir: Path, tmp_path: Path) -> None:
    from lm_eval.utils import simple_parse_args_string

    from titan_recur.eval.lm_eval_model import TitanRecurLM

    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    (bare / "manifest.json").unlink()
    with pytest.raises(Exception, match="--unverified"):
        TitanRecurLM(pretrained=str(bare))
    assert TitanRecurLM(**simple_parse_args_string(f"pretrained={bare},unverified=true")).model is not None


def test_generate_until_refuses_sampling(model_dir: Path) -> None:
    from titan_recur.eval.lm_eval_model import TitanRecurLM

    with pytest.raises(ValueError, match="greedily"):
        TitanRecurLM(pretrained=str(model_dir))._generation_settings({"do_sample": True, "temperature": 0.7})


def test_model_args_take_every_generation_option_with_its_default(model_dir: Path) -> None:
    """GenerationOptions is the one list of generation knobs: each field is a model_arg (but the per-request
    budget, EOS and sampling), defaulting to the dataclass' value and converted to the field's type."""
    import dataclasses

    from lm_eval.utils import simple_parse_args_string

    from titan_recur.eval.lm_eval_model import GENERATION_MODEL_ARGS, NOT_MODEL_ARGS, TitanRecurLM
    from titan_recur.inference.options import GenerationOptions

    fields = {f.name: f.default for f in dataclasses.fields(GenerationOptions)}
    assert set(GENERATION_MODEL_ARGS) == set(fields) - set(NOT_MODEL_ARGS)
    assert set(NOT_MODEL_ARGS) <= set(fields)
    lm = TitanRecurLM(pretrained=str(model_dir))
    assert lm.num_steps == lm.model.args.mean_recurrence  # num_steps None: the model's
    for name in GENERATION_MODEL_ARGS:
        if name != "num_steps":
            assert getattr(lm.generation, name) == fields[name], name
    # Every knob is accepted by name (here: its default given explicitly).
    lm = TitanRecurLM(pretrained=str(model_dir), **{name: fields[name] for name in GENERATION_MODEL_ARGS})
    assert all(getattr(lm.generation, n) == fields[n] for n in GENERATION_MODEL_ARGS if n != "num_steps")
    given = "num_steps=3,exit_criterion=kl,exit_threshold=1,min_steps=2,check_every=2,compile=false,lookahead=3"
    lm = TitanRecurLM(**simple_parse_args_string(f"pretrained={model_dir},{given}"))
    assert lm.num_steps == 3 and lm.generation.num_steps is None
    options = lm.generation_options(4)
    rule = options.exit
    assert rule is not None and (rule.criterion, rule.min_steps, rule.check_every, options.lookahead) == ("kl", 2, 2, 3)
    assert type(rule.threshold) is float and rule.threshold == 1.0 and options.compile is False
    with pytest.raises(TypeError, match="unexpected keyword argument 'temperature'"):
        TitanRecurLM(pretrained=str(model_dir), temperature=0.7)


def test_gsm8k_cot_recur_task_parses_offline(tmp_path: Path) -> None:
    """tasks/gsm8k_cot_recur.yaml is indexed, and renders 1-shot CoT prompts (on a local stand-in for GSM8K)."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml

    manager = TaskManager(include_path=str(REPO / "tasks"), include_defaults=False)
    assert "gsm8k_cot_recur" in manager.all_tasks
    config = load_yaml(manager.task_index["gsm8k_cot_recur"].yaml_path)
    assert config["dataset_path"] == "openai/gsm8k"
    data = tmp_path / "gsm8k.jsonl"
    doc = {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = 7.\n#### 7"}
    data.write_text(json.dumps(doc))
    config.pop("dataset_name")
    config.update(dataset_path="json", dataset_kwargs={"data_files": {"test": str(data)}})
    task = manager.load([config])["tasks"]["gsm8k_cot_recur"]
    doc = next(iter(task.test_docs()))
    prompt = task.fewshot_context(doc, num_fewshot=task.config.num_fewshot)
    assert prompt.count("Q: ") == 2 and prompt.count("A: Let's think step by step.") == 2
    assert prompt.endswith("Q: Tom has 3 apples and buys 4 more. How many?\nA: Let's think step by step.")
    assert task.doc_to_target(doc) == "7"
    assert [f["name"] for f in config["filter_list"]] == ["strict-match", "flexible-extract"]


def test_lm_eval_cli_with_registered_model(model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """`python -m titan_recur.eval lm_eval ...` is lm_eval's CLI with `--model titan_recur` available."""
    index_without_lm_eval_tasks(monkeypatch)
    argv = [
        "lm_eval",
        "run",
        "--model",
        "titan_recur",
        "--model_args",
        f"pretrained={model_dir},num_steps=2",
        "--tasks",
        "titan_recur_tiny_choice",
        "--include_path",
        str(LM_EVAL_TASKS),
        "--limit",
        "2",
        "--device",
        "cpu",
    ]
    assert eval_main(argv) == 0
    assert "titan_recur_tiny_choice" in capsys.readouterr().out


def test_lm_eval_cli_default_device_is_what_exists(model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Without --device, lm_eval asks for its default cuda:0: on a machine without CUDA the model runs on the CPU
    (as lm_eval's HF backend does) instead of failing; a device= in model_args wins over lm_eval's."""
    from titan_recur.eval.lm_eval_model import TitanRecurLM

    index_without_lm_eval_tasks(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["lm_eval", "run", "--model", "titan_recur", "--model_args", f"pretrained={model_dir},num_steps=2"]
    argv += ["--tasks", "titan_recur_tiny_choice", "--include_path", str(LM_EVAL_TASKS), "--limit", "2"]
    assert eval_main(argv) == 0
    assert "titan_recur_tiny_choice" in capsys.readouterr().out
    lm = TitanRecurLM.create_from_arg_string(
        f"pretrained={model_dir},device=cpu", {"device": "cuda:0", "batch_size": 1}
    )
    assert lm.device == torch.device("cpu")


# ------------------------------------------------------------------ finite files, held-out files, in-loop parity


def encoded_lengths(path: Path) -> list[int]:
    from titan_recur.data.loader import encode_document
    from titan_recur.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(DEBUG_MODEL)
    return [len(encode_document(tokenizer, json.loads(line)["text"])) for line in path.read_text().splitlines()]


def test_loss_cli_reads_a_one_document_file_once(tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys) -> None:
    """One short document: one pass, the real token count, no "looping over it again", seconds."""
    import time

    doc = tmp_path / "one.jsonl"
    doc.write_text(
        json.dumps({"text": "Question: Dev packs 2 boxes every hour. How many in 3 hours?\nAnswer: 6"}) + "\n"
    )
    start = time.process_time()
    code = eval_main(
        [
            "loss",
            "--checkpoint",
            str(DEBUG_MODEL),
            "--data",
            str(doc),
            "--recurrences",
            "1,2",
            "--out",
            str(tmp_path / "out"),
        ]
    )
    cpu_seconds = time.process_time() - start
    assert code == 0
    report = json.loads((tmp_path / "out" / "validation_loss.json").read_text())
    (length,) = encoded_lengths(doc)
    assert report["tokens"] == length - 1 and report["batches_read"] == 1 and report["rows_read"] == 1
    assert "looping" not in caplog.text
    assert f"evaluated {length - 1} labelled tokens" in capsys.readouterr().out
    assert cpu_seconds < 10


def test_loss_cli_warns_when_the_data_has_fewer_batches(tmp_path: Path, capsys) -> None:
    doc = tmp_path / "one.jsonl"
    doc.write_text(json.dumps({"text": "A short document. " * 4}) + "\n")
    argv = [
        "loss",
        "--checkpoint",
        str(DEBUG_MODEL),
        "--data",
        str(doc),
        "--recurrences",
        "1",
        "--batches",
        "4",
        "--batch-size",
        "2",
        "--seq-len",
        "16",
        "--out",
        str(tmp_path / "out"),
    ]
    assert eval_main(argv) == 0
    report = json.loads((tmp_path / "out" / "validation_loss.json").read_text())
    (length,) = encoded_lengths(doc)
    rows = math.ceil(length / 17)  # rows of seq_len + 1 tokens, the last one padded
    assert report["rows_read"] == rows and report["batches_read"] == math.ceil(rows / 2) < 4
    assert report["tokens"] == length - rows
    assert f"gave {report['batches_read']} batches of the 4 asked" in capsys.readouterr().err


def test_single_pass_over_a_mixture_reads_every_document_once(tmp_path: Path) -> None:
    """Two sources: the batches end when both are exhausted; every token is labelled except row starts."""
    from titan_recur.data.tokenizer import load_tokenizer
    from titan_recur.eval.sweep import heldout_batches

    lines = (REPO / "assets" / "corpus" / "math.jsonl").read_text().splitlines()
    paths = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    paths[0].write_text("\n".join(lines[:5]) + "\n")
    paths[1].write_text("\n".join(lines[5:12]) + "\n")
    config = tmp_path / "train.toml"
    config.write_text(
        f'[model]\npath = "{DEBUG_MODEL}"\n[training]\nseq_len = 31\nlocal_batch_size = 3\n'
        + "".join(f'[[data.validation_sources]]\npath = "{p}"\nkind = "jsonl"\n' for p in paths)
    )
    batches = list(
        heldout_batches(load_tokenizer(DEBUG_MODEL), seq_len=31, batch_size=3, num_batches=None, config=str(config))
    )
    expected = sum(total - math.ceil(total / 32) for total in (sum(encoded_lengths(p)) for p in paths))
    assert sum(int((b["labels"] != -100).sum()) for b in batches) == expected
    assert all(int(b["input_ids"].min()) >= 0 for b in batches)


def test_heldout_command_writes_the_validation_split(tmp_path: Path, capsys) -> None:
    """The held-out documents of a config (by content hash), then eval loss --data on them."""
    from titan_recur.data.loader import _held_out

    out = tmp_path / "held_out.jsonl"
    config = str(REPO / "train_configs" / "debug_model.toml")
    assert eval_main(["heldout", "--config", config, "--documents", "6", "--out", str(out)]) == 0
    docs = [json.loads(line)["text"] for line in out.read_text().splitlines()]
    assert len(docs) == 6 and all(_held_out(d, 0.05) for d in docs)
    sources = [
        json.loads(line)["text"]
        for name in ("general", "math")
        for line in (REPO / "assets" / "corpus" / f"{name}.jsonl").read_text().splitlines()
    ]
    assert set(docs) <= set(sources)
    assert "wrote 6 documents" in capsys.readouterr().out
    argv = [
        "loss",
        "--checkpoint",
        str(DEBUG_MODEL),
        "--data",
        str(out),
        "--seq-len",
        "64",
        "--recurrences",
        "1",
        "--out",
        str(tmp_path / "eval"),
    ]
    assert eval_main(argv) == 0
    report = json.loads((tmp_path / "eval" / "validation_loss.json").read_text())
    total = sum(encoded_lengths(out))
    assert report["tokens"] == total - math.ceil(total / 65)


def test_heldout_command_reads_any_source_whole(tmp_path: Path, capsys) -> None:
    out = tmp_path / "docs.jsonl"
    source = REPO / "tests" / "assets_lm_eval" / "tiny.jsonl"
    argv = ["heldout", "--data", str(source), "--text-field", "question", "--documents", "1000", "--out", str(out)]
    assert eval_main(argv) == 0
    expected = [json.loads(line)["question"] for line in source.read_text().splitlines()]
    assert [json.loads(line)["text"] for line in out.read_text().splitlines()] == expected
    assert f"has {len(expected)} documents, 1000 asked" in capsys.readouterr().err


def test_heldout_command_errors_are_one_line(tmp_path: Path, capsys) -> None:
    no_split = tmp_path / "no_split.toml"
    no_split.write_text(f'[model]\npath = "{DEBUG_MODEL}"\n[[data.sources]]\npath = "x.jsonl"\nkind = "jsonl"\n')
    cases = {
        "no validation split": ["--config", str(no_split)],
        "no file matches": ["--data", str(tmp_path / "missing.jsonl")],
        "--documents must be >= 1": ["--data", str(no_split), "--documents", "0"],
    }
    for message, args in cases.items():
        out = tmp_path / "out.jsonl"
        argv = ["heldout", "--documents", "3", "--out", str(out), *args]
        assert eval_main(argv) == 2, message
        assert message in last_line(capsys.readouterr().err)
        assert not out.exists() and not (tmp_path / "out.jsonl.tmp").exists()


def test_validation_sources_are_the_validation_split(tmp_path: Path) -> None:
    """[[data.validation_sources]]: read whole as the split; exclusive with the hash split."""
    from titan_recur.config import ConfigError, load_config

    source = REPO / "tests" / "assets_lm_eval" / "tiny.jsonl"
    text = (
        f'[model]\npath = "{DEBUG_MODEL}"\n[validation]\nenable = true\n'
        '[[data.sources]]\npath = "assets/corpus/math.jsonl"\nkind = "jsonl"\n'
        f'[[data.validation_sources]]\npath = "{source}"\nkind = "jsonl"\ntext_field = "question"\n'
    )
    config = tmp_path / "train.toml"
    config.write_text(text)
    assert load_config(str(config)).data.validation_sources[0].path == str(source)
    out = tmp_path / "docs.jsonl"
    assert eval_main(["heldout", "--config", str(config), "--documents", "2", "--out", str(out)]) == 0
    expected = [json.loads(line)["question"] for line in source.read_text().splitlines()[:2]]
    assert [json.loads(line)["text"] for line in out.read_text().splitlines()] == expected
    both = tmp_path / "both.toml"
    both.write_text(text.replace("[validation]", "[data]\nvalidation_fraction = 0.1\n[validation]"))
    with pytest.raises(ConfigError, match="set data.validation_fraction = 0"):
        load_config(str(both))


def test_harness_fails_before_the_model_when_task_data_is_unreachable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """GSM8K offline: one line naming the task and the dataset, exit 2, and no model is loaded."""
    import titan_recur.eval.lm_eval_model as lm_eval_model

    index_without_lm_eval_tasks(monkeypatch)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the task data was checked")

    monkeypatch.setattr(lm_eval_model, "TitanRecurLM", no_model)
    argv = [
        "harness",
        "--model_args",
        f"pretrained={DEBUG_MODEL}",
        "--tasks",
        "gsm8k_cot_recur",
        "--out",
        str(tmp_path / "out"),
    ]
    assert eval_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "cannot load the data of task(s) gsm8k_cot_recur" in err[0] and "openai/gsm8k" in err[0]
    assert not (tmp_path / "out").exists()


def test_in_loop_validation_and_eval_loss_agree_on_the_same_rows(tmp_path: Path, capsys) -> None:
    """`eval loss --config <run>/config.json` defaults to the in-loop geometry: the same rows, the same losses.

    With other rows (the old defaults: 8 batches of 8) the numbers differ by more than float noise:
    that, not the model, was the gap between the in-loop and the offline figure.
    """
    from titan_recur.cli.train import main as train_main

    dump = tmp_path / "run"
    assert (
        train_main(
            [
                "--config",
                str(REPO / "train_configs" / "debug_model.toml"),
                "--job.dump_folder",
                str(dump),
                "--training.steps",
                "2",
                "--validation.interval",
                "2",
                "--checkpoint.enable",
                "false",
                "--metrics.enable_tensorboard",
                "false",
            ]
        )
        == 0
    )
    in_loop = next(
        json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines() if "validation.loss_r1" in line
    )
    common = [
        "loss",
        "--checkpoint",
        str(dump / "final_model"),
        "--config",
        str(dump / "config.json"),
        "--recurrences",
        "1,2,4,8",
    ]
    assert eval_main([*common, "--out", str(tmp_path / "same")]) == 0
    out = capsys.readouterr().out
    assert "in-loop validation of" in out and "2 batches x 8 rows x 64 tokens on each rank" in out
    same = json.loads((tmp_path / "same" / "validation_loss.json").read_text())
    assert (same["batches"], same["batch_size"], same["seq_len"]) == (2, 8, 64)
    for r in (1, 2, 4, 8):
        assert same["loss"][str(r)] == pytest.approx(in_loop[f"validation.loss_r{r}"], rel=1e-6, abs=1e-6)
    assert eval_main([*common, "--batches", "8", "--batch-size", "8", "--out", str(tmp_path / "other")]) == 0
    other = json.loads((tmp_path / "other" / "validation_loss.json").read_text())
    assert abs(other["loss"]["4"] - in_loop["validation.loss_r4"]) > 1e-3


def test_document_masked_eval_batches_score_each_document_alone(model_dir: Path) -> None:
    """Rows of the corpus packed under document masking: the validation sums are those of each document piece of
    each row run alone (its own positions, no earlier document in view)."""
    from titan_recur.data.tokenizer import load_tokenizer
    from titan_recur.eval.sweep import heldout_batches

    data = str(REPO / "assets" / "corpus" / "math.jsonl")
    tokenizer = load_tokenizer(model_dir)
    batches = list(
        heldout_batches(tokenizer, seq_len=48, batch_size=2, num_batches=2, data=data, attention_mask="document")
    )
    model = load_model(model_dir)
    sums = validation_loss_sums(model, batches, [3], "cpu")[3]
    expected, pieces = 0.0, 0
    for batch in batches:
        for ids, labels, documents in zip(batch["input_ids"], batch["labels"], batch["document_ids"], strict=True):
            for doc in documents.unique():
                part = documents == doc
                logits = model(ids[part][None], 3, state_init="zero")
                expected += cross_entropy_loss(logits, labels[part][None]).item() * int((labels[part] != -100).sum())
                pieces += 1
    assert pieces > 2 * len(batches)  # rows of several documents
    assert sums[0] == pytest.approx(expected, rel=1e-5)


def test_document_masking_in_training_validation_and_eval_loss(tmp_path: Path) -> None:
    """training.attention_mask = "document": the in-loop validation and `eval loss --config` (which takes the
    config's mask) agree on the same rows; `--attention-mask causal` gives other losses."""
    from titan_recur.cli.train import main as train_main

    dump = tmp_path / "run"
    argv = ["--config", str(REPO / "train_configs" / "debug_model.toml"), "--job.dump_folder", str(dump)]
    argv += ["--training.steps", "2", "--validation.interval", "2", "--training.attention_mask", "document"]
    assert train_main([*argv, "--checkpoint.enable", "false", "--metrics.enable_tensorboard", "false"]) == 0
    in_loop = next(
        json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines() if "validation.loss_r1" in line
    )
    common = ["loss", "--checkpoint", str(dump / "final_model"), "--config", str(dump / "config.json")]
    common += ["--recurrences", "1,4"]
    assert eval_main([*common, "--out", str(tmp_path / "same")]) == 0
    same = json.loads((tmp_path / "same" / "validation_loss.json").read_text())
    assert same["attention_mask"] == "document"
    for r in (1, 4):
        assert same["loss"][str(r)] == pytest.approx(in_loop[f"validation.loss_r{r}"], rel=1e-6, abs=1e-6)
    assert eval_main([*common, "--attention-mask", "causal", "--out", str(tmp_path / "causal")]) == 0
    causal = json.loads((tmp_path / "causal" / "validation_loss.json").read_text())
    assert abs(causal["loss"]["4"] - same["loss"]["4"]) > 1e-3
