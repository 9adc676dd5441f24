"""The generate command (titan_recur/cli/generate.py, python -m titan_recur.generate): its JSON report,
batched == single, --top-k reaching the engine, one-line errors before any decoding. The engine itself:
tests/inference/test_engine.py."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import pytest

from titan_recur.cli.generate import main as generate_main

CLI_PROMPTS = ["Question: What is 3 + 4?\nAnswer:", "The sum", "Mia has nine apples and gives two away, so she"]


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    code = generate_main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_json_fields_and_batched_equals_single(generation_model_dir: Path, tmp_path: Path, capsys) -> None:
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CLI_PROMPTS))
    common = [
        "--checkpoint",
        str(generation_model_dir),
        "--num-steps",
        "6",
        "--kv-sharing",
        "latest",
        "--exit",
        "entropy-diff",
        "--exit-threshold",
        "1e-3",
        "--max-new-tokens",
        "12",
        "--json",
    ]
    code, out, err = run_cli(capsys, *common, "--prompts", str(prompts_file), "--batch-size", "3")
    assert code == 0, err
    report = json.loads(out)
    assert set(report) == {"prompts", "mean_steps", "kv_cache_bytes", "tokens_per_sec", "settings"}
    assert report["kv_cache_bytes"] > 0 and report["tokens_per_sec"] > 0
    assert report["settings"]["kv_sharing"] == "latest" and report["settings"]["exit_criterion"] == "entropy-diff"
    from titan_recur.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(generation_model_dir)
    steps = []
    for prompt, result in zip(CLI_PROMPTS, report["prompts"], strict=True):
        assert set(result) == {"prompt", "text", "tokens", "steps_per_token", "mean_steps"}
        assert result["prompt"] == prompt and len(result["steps_per_token"]) == len(result["tokens"]) > 0
        assert result["mean_steps"] == pytest.approx(sum(result["steps_per_token"]) / len(result["tokens"]))
        assert result["text"] == tokenizer.decode([t for t in result["tokens"] if t != tokenizer.eos_id])
        steps += result["steps_per_token"]
        code, out, _ = run_cli(capsys, *common, "--prompt", prompt)
        alone = json.loads(out)["prompts"][0]
        assert (alone["tokens"], alone["steps_per_token"]) == (result["tokens"], result["steps_per_token"])
    assert len(set(steps)) > 1 and max(steps) <= 6
    code, out, _ = run_cli(
        capsys, "--checkpoint", str(generation_model_dir), "--prompt", "The sum", "--max-new-tokens", "4"
    )
    assert code == 0 and out.startswith("### prompt 0: ") and "The sum" in out and "tokens/s" in out


def test_cli_top_k_one_samples_the_greedy_tokens(generation_model_dir: Path, capsys) -> None:
    """--top-k reaches the engine: at k = 1 only the most likely token is left, so sampling is greedy."""
    base = ["--checkpoint", str(generation_model_dir), "--prompt", "The sum", "--max-new-tokens", "6", "--json"]
    code, out, err = run_cli(capsys, *base)
    assert code == 0, err
    greedy = json.loads(out)["prompts"][0]["tokens"]
    code, out, err = run_cli(capsys, *base, "--temperature", "5", "--top-k", "1", "--seed", "3")
    assert code == 0, err
    report = json.loads(out)
    assert report["settings"]["top_k"] == 1 and report["prompts"][0]["tokens"] == greedy
    code, out, err = run_cli(capsys, *base, "--temperature", "5", "--seed", "3")
    assert json.loads(out)["prompts"][0]["tokens"] != greedy  # without top-k, temperature 5 strays


def test_cli_bad_input_is_one_line_before_decoding(
    generation_model_dir: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    import titan_recur.cli.generate as cli

    monkeypatch.setattr(cli, "generate", lambda *a, **k: pytest.fail("decoding started"))
    empty_line = tmp_path / "empty.jsonl"
    empty_line.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": " "}) + "\n")
    base = ["--checkpoint", str(generation_model_dir), "--num-steps", "4"]
    cases = {
        "exit_criterion must be one of kl, latent-diff, entropy-diff, argmax, got 'entropy'": [
            *base,
            "--prompt",
            "a",
            "--exit",
            "entropy",
        ],
        "kv_sharing must be 'full', 'latest' or 'compress-N' with N >= 1, got 'compress'": [
            *base,
            "--prompt",
            "a",
            "--kv-sharing",
            "compress",
        ],
        "exit_threshold must be > 0, got 0.0": [*base, "--prompt", "a", "--exit", "kl", "--exit-threshold", "0"],
        "min_steps must be an integer in [1, max_steps = num_steps = 4], got 5": [
            *base,
            "--prompt",
            "a",
            "--exit",
            "kl",
            "--min-steps",
            "5",
        ],
        "max_new_tokens (200) exceeds the model's max_seq_len (128)": [
            *base,
            "--prompt",
            "a",
            "--max-new-tokens",
            "200",
        ],
        "top_k must be an integer >= 0 (0: off), got -1": [*base, "--prompt", "a", "--top-k", "-1"],
        "--prompt is empty": [*base, "--prompt", ""],
        f"{empty_line}:2: empty prompt": [*base, "--prompts", str(empty_line)],
        "argument --min-steps: invalid int value: 'x'": [*base, "--prompt", "a", "--min-steps", "x"],
    }
    for message, argv in cases.items():
        with pytest.raises(SystemExit) if "argument" in message else nullcontext():
            code, out, err = run_cli(capsys, *argv)
            assert code == 2 and not out, message
            assert len(err.strip().splitlines()) == 1 and message in err, (message, err)
        if "argument" in message:
            err = capsys.readouterr().err
            assert len(err.strip().splitlines()) == 1 and message in err
