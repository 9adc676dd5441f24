"""Job config: TOML loading, CLI overrides, strict types, one-line errors, help, round trip."""

import json
import textwrap
from pathlib import Path

import pytest

from titan_recur.config import (
    ConfigError,
    DataSource,
    JobConfig,
    config_from_dict,
    config_to_dict,
    load_config,
    parse_args,
    validate,
)

MODEL = ["--model.path", "models/x"]  # the one setting without a usable default


def write(tmp_path: Path, text: str, name: str = "job.toml") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def error(fn, *args) -> str:
    with pytest.raises(ConfigError) as e:
        fn(*args)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_defaults_match_the_paper():
    cfg = load_config(None, MODEL)
    assert cfg.training.steps == 50000
    assert cfg.recurrence.mean_recurrence == 32 and cfg.recurrence.backprop_depth == 8
    assert cfg.recurrence.seed == 514229 and cfg.recurrence.curriculum == "1-sqrt"
    assert cfg.optimizer.name == "muon" and cfg.optimizer.adamw_betas == (0.9, 0.95)
    assert cfg.validation.recurrences == [1, 2, 4, 8, 16, 32]
    assert cfg.data.sources == [] and cfg.model.shape == []


def test_mutable_defaults_are_not_shared():
    a, b = JobConfig(), JobConfig()
    a.validation.recurrences.append(64)
    a.data.sources.append(DataSource(path="x"))
    assert b.validation.recurrences == [1, 2, 4, 8, 16, 32] and b.data.sources == []


def test_toml_loads_into_dataclasses(tmp_path):
    path = write(
        tmp_path,
        """
        [model]
        path = "models/tiny"
        [training]
        steps = 100
        max_norm = 2          # an int is fine for a float
        global_batch_size = 64
        compile = true
        ac_mode = "full"
        [optimizer]
        adamw_betas = [0.8, 0.99]
        [validation]
        recurrences = [1, 4]
        [metrics]
        peak_flops = 1e15
        """,
    )
    cfg = load_config(path)
    assert cfg.model.path == "models/tiny"
    assert cfg.training.steps == 100 and cfg.training.global_batch_size == 64
    assert cfg.training.max_norm == 2.0 and isinstance(cfg.training.max_norm, float)
    assert cfg.training.compile is True and cfg.training.ac_mode == "full"
    assert cfg.optimizer.adamw_betas == (0.8, 0.99)
    assert cfg.validation.recurrences == [1, 4]
    assert cfg.metrics.peak_flops == 1e15
    assert cfg.training.seq_len == 1024  # untouched keys keep their defaults


def test_cli_beats_file_beats_defaults(tmp_path):
    path = write(tmp_path, '[model]\npath = "m"\n[training]\nsteps = 100\nseq_len = 256\n')
    cfg = parse_args(["--config", path, "--training.steps", "7"])
    assert cfg.training.steps == 7  # CLI over file
    assert cfg.training.seq_len == 256  # file over default
    assert cfg.training.local_batch_size == 16  # default
    assert parse_args([f"--config={path}", "--training.steps=9"]).training.steps == 9


def test_equals_form_and_values_that_look_like_options():
    cfg = load_config(None, MODEL + ["--job.description=a=b", "--parallel.dp_shard", "-1"])
    assert cfg.job.description == "a=b" and cfg.parallel.dp_shard == -1


@pytest.mark.parametrize(
    "override, attr, expected",
    [
        (["--validation.recurrences", "1,2,4"], ("validation", "recurrences"), [1, 2, 4]),
        (["--validation.recurrences="], ("validation", "recurrences"), []),
        (["--validation.recurrences", " 3, 5 "], ("validation", "recurrences"), [3, 5]),
        (["--optimizer.adamw_betas", "0.9,0.999"], ("optimizer", "adamw_betas"), (0.9, 0.999)),
        (["--training.global_batch_size", "none"], ("training", "global_batch_size"), None),
        (["--training.global_batch_size", "32"], ("training", "global_batch_size"), 32),
        (["--data.tokenizer", "None"], ("data", "tokenizer"), None),
        (["--data.tokenizer", "tok/"], ("data", "tokenizer"), "tok/"),
        (["--recurrence.curriculum", "linear"], ("recurrence", "curriculum"), "linear"),
        (["--optimizer.lr", "3"], ("optimizer", "lr"), 3.0),
        (["--training.compile", "yes"], ("training", "compile"), True),
        (["--recurrence.mean_offset", "0"], ("recurrence", "mean_offset"), False),
        (["--training.compile"], ("training", "compile"), True),  # bare flag at the end
        (["--training.compile", "--job.seed", "3"], ("training", "compile"), True),  # bare flag
    ],
)
def test_cli_value_parsing(override, attr, expected):
    cfg = load_config(None, MODEL + override)
    value = getattr(getattr(cfg, attr[0]), attr[1])
    assert value == expected and type(value) is type(expected)


def test_optional_and_literal_from_toml(tmp_path):
    path = write(
        tmp_path,
        """
        [model]
        path = "m"
        [training]
        global_batch_size = 32
        [recurrence]
        curriculum = "none"
        """,
    )
    cfg = load_config(path)
    assert cfg.training.global_batch_size == 32 and cfg.recurrence.curriculum == "none"


@pytest.mark.parametrize(
    "toml, expected",
    [
        ("[job]\ndeterministic = 1\n", "[job] deterministic expects bool, got 1"),
        ("[training]\nsteps = true\n", "[training] steps expects int, got True"),
        ("[training]\nsteps = 1.5\n", "[training] steps expects int, got 1.5"),
        ('[training]\nsteps = "10"\n', "[training] steps expects int, got '10'"),
        ("[optimizer]\nlr = false\n", "[optimizer] lr expects float, got False"),
        (
            '[training]\nac_mode = "some"\n',
            "[training] ac_mode expects one of 'none', 'full', 'per_iteration', got 'some'",
        ),
        ('[validation]\nrecurrences = [1, "a"]\n', "[validation.recurrences][1] expects int, got 'a'"),
        ("[validation]\nrecurrences = 4\n", "[validation] recurrences expects list[int], got 4"),
        ("[optimizer]\nadamw_betas = [0.9]\n", "[optimizer] adamw_betas expects tuple[float, float], got [0.9]"),
        ('[training]\nglobal_batch_size = "none"\n', "[training] global_batch_size expects int | None, got 'none'"),
        ("training = 5\n", "[training] expects table, got 5"),
    ],
)
def test_wrong_type_in_file_names_file_key_and_type(tmp_path, toml, expected):
    path = write(tmp_path, toml)
    assert error(load_config, path, MODEL) == f"{path}: {expected}"


@pytest.mark.parametrize(
    "override, expected",
    [
        (["--training.steps", "abc"], "command line: --training.steps expects int, got 'abc'"),
        (["--training.steps=1.0"], "command line: --training.steps expects int, got '1.0'"),
        (["--training.compile", "maybe"], "command line: --training.compile expects bool, got 'maybe'"),
        (["--job.seed", "true"], "command line: --job.seed expects int, got 'true'"),
        (
            ["--training.device", "tpu"],
            "command line: --training.device expects one of 'auto', 'cpu', 'cuda', got 'tpu'",
        ),
        (["--model.shape", "4,x,4"], "command line: --model.shape expects list[int], got '4,x,4'"),
        (
            ["--optimizer.adamw_betas", "0.9"],
            "command line: --optimizer.adamw_betas expects tuple[float, float], got '0.9'",
        ),
        (["--training.seq_len", "none"], "command line: --training.seq_len expects int, got 'none'"),
        (["--training.steps"], "command line: --training.steps needs a value (int)"),
    ],
)
def test_wrong_type_on_cli(override, expected):
    assert error(load_config, None, MODEL + override) == expected


def test_unknown_key_in_file_suggests(tmp_path):
    path = write(tmp_path, "[training]\nstpes = 10\n")
    assert error(load_config, path, MODEL) == f"{path}: [training] unknown key 'stpes' (did you mean 'steps'?)"
    path = write(tmp_path, "[trainig]\nsteps = 10\n")
    assert error(load_config, path, MODEL) == f"{path}: unknown section 'trainig' (did you mean 'training'?)"


def test_unknown_option_on_cli_suggests():
    msg = error(load_config, None, MODEL + ["--training.stpes", "10"])
    assert msg == "command line: unknown option --training.stpes (did you mean --training.steps?)"
    assert "did you mean --training.seq_len?" in error(load_config, None, MODEL + ["--seq_len", "8"])
    assert "unexpected argument 'oops'" in error(load_config, None, MODEL + ["oops"])
    assert "unknown option --model" in error(load_config, None, ["--model", "x"])


def test_data_phases_arrays_of_tables(tmp_path):
    path = write(
        tmp_path,
        """
        [model]
        path = "m"
        [[data.sources]]
        path = "web/*.jsonl"
        kind = "jsonl"
        weight = 3

        [[data.phases]]
        start_step = 0
        [[data.phases.sources]]
        name = "web"
        path = "web/*.jsonl"
        [[data.phases.sources]]
        path = "HuggingFaceFW/fineweb-edu"
        kind = "hf"
        hf_config = "sample-10BT"

        [[data.phases]]
        start_step = 1000
        [[data.phases.sources]]
        path = "math.parquet"
        kind = "parquet"
        """,
    )
    data = load_config(path).data
    assert data.sources == [DataSource(path="web/*.jsonl", kind="jsonl", weight=3.0)]
    assert [p.start_step for p in data.phases] == [0, 1000]
    assert [s.path for s in data.phases[0].sources] == ["web/*.jsonl", "HuggingFaceFW/fineweb-edu"]
    assert data.phases[0].sources[1].hf_config == "sample-10BT"
    assert data.phases[1].sources[0].kind == "parquet" and data.phases[1].sources[0].split == "train"


def test_array_of_tables_errors_carry_the_path(tmp_path):
    path = write(tmp_path, "[[data.phases]]\nstart_step = 0\n[[data.phases]]\nx = 1\n")
    assert error(load_config, path, MODEL) == f"{path}: [data.phases][1] unknown key 'x'"
    path = write(tmp_path, '[[data.phases]]\n[[data.phases.sources]]\npath = "a"\nkind = "csv"\n')
    msg = error(load_config, path, MODEL)
    assert msg.startswith(f"{path}: [data.phases][0].sources[0] kind expects one of 'text', 'jsonl'")
    path = write(tmp_path, "[data]\nsources = [1]\n")
    assert error(load_config, path, MODEL) == f"{path}: [data.sources][0] expects table, got 1"
    msg = error(load_config, None, MODEL + ["--data.sources", "a"])
    assert msg == (
        "command line: --data.sources is an array of tables; set a field of entry N as --data.sources.N.key "
        "(e.g. --data.sources.0.path) or [[data.sources]] in the config file"
    )


@pytest.mark.parametrize(
    "override, expected",
    [
        ([], "set model.path (a converted model folder), model.preset, or an architecture to train from scratch"),
        (MODEL + ["--training.steps", "0"], "training.steps must be >= 1, got 0"),
        (MODEL + ["--recurrence.warmup_fraction", "1.5"], "recurrence.warmup_fraction must be in [0, 1], got 1.5"),
        (MODEL + ["--recurrence.start", "40"], "recurrence.mean_recurrence (32) must be >= recurrence.start (40)"),
        (MODEL + ["--recurrence.backprop_depth", "0"], "recurrence.backprop_depth must be >= 1, got 0"),
        (
            MODEL + ["--recurrence.mean_recurrence", "1000000000"],
            "recurrence.mean_recurrence 1000000000 is outside [1, 1024]",
        ),
        (MODEL + ["--validation.recurrences", "2,5000"], "validation.recurrences 5000 is outside [1, 1024]"),
        (
            MODEL + ["--lr_scheduler.warmup_fraction", "0.5"],
            "lr_scheduler.warmup_fraction + decay_fraction must be <= 1",
        ),
        (MODEL + ["--training.global_batch_size", "20"], "training.global_batch_size (20) must be a multiple of"),
        (MODEL + ["--parallel.dp_shard", "0"], "parallel.dp_shard must be -1 or >= 1, got 0"),
        (MODEL + ["--model.preset", "tinyllama-1.1b"], "model.preset needs model.shape = P,R,C"),
        (["--model.preset", "tinyllama-1.1b", "--model.init", "random"], "model.preset needs model.shape = P,R,C"),
        (["--model.preset", "tinyllama-1.1b", "--model.shape", "4,8,4"], "model.preset has no weights"),
        (["--model.preset", "tinylama-1.1b"], "unknown model.preset 'tinylama-1.1b' (did you mean 'tinyllama-1.1b'?)"),
        (["--model.preset", "olmo2-1b", "--model.shape", "8,8,8"], "needs 24 layers; olmo2-1b has 16"),
        (MODEL + ["--model.shape", "1,2,3"], "model.shape only applies with model.preset"),
    ],
)
def test_cross_field_validation(override, expected):
    msg = error(load_config, None, override)
    assert msg.startswith("invalid config: ") and expected in msg


def test_preset_with_shape_and_random_init_is_valid():
    cfg = load_config(None, ["--model.preset", "tinyllama-1.1b", "--model.shape", "4,8,4", "--model.init", "random"])
    assert cfg.model.shape == [4, 8, 4] and cfg.model.path is None


def test_data_validation(tmp_path):
    phases = "[[data.phases]]\nstart_step = 5\n[[data.phases.sources]]\npath = 'a'\n[[data.phases]]\nstart_step = "
    assert "[data.phases][1] has no sources" in error(load_config, write(tmp_path, phases + "9\n"), MODEL)
    msg = error(load_config, write(tmp_path, phases + "5\n"), MODEL)
    assert msg == "invalid config: data.phases start_steps must be increasing, got [5, 5]"
    path = write(tmp_path, "[[data.sources]]\nkind = 'hf'\n")
    assert "[data.sources][0] needs a path" in error(load_config, path, MODEL)


def test_config_file_errors(tmp_path):
    missing = str(tmp_path / "nope.toml")
    assert error(load_config, missing) == f"{missing}: config file not found"
    bad = write(tmp_path, "[training\n")
    assert error(load_config, bad).startswith(f"{bad}: cannot parse: ")
    assert "--config given more than once" in error(parse_args, ["--config", bad, "--config", bad])


@pytest.mark.parametrize(
    "name, content, expected",
    [
        ("folder.toml", None, "is a folder, not a config file"),
        ("latin1.toml", b"[job]\ndescription = '\xe9t\xe9'\n", "not UTF-8 text (byte 0xe9 at position 21)"),
        ("list.json", b"[1, 2]\n", "the top level is a list, not a table of sections"),
        ("text.json", b'"job"\n', "the top level is a str, not a table of sections"),
    ],
)
def test_a_config_that_is_no_table_of_sections_is_one_line(tmp_path, capsys, name, content, expected):
    """A folder, a file that is not UTF-8, JSON whose top level is not an object: one line naming the file, exit 2
    (each was a traceback)."""
    from titan_recur.cli.train import main

    path = tmp_path / name
    path.mkdir() if content is None else path.write_bytes(content)
    assert error(load_config, str(path)) == f"{path}: {expected}"
    assert main(["--config", str(path), "--check"]) == 2
    assert capsys.readouterr().err == f"error: {path}: {expected}\n"


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--training.steps", "abc", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--training.steps (int; default 50000)" in out
    assert "Number of optimizer steps." in out
    assert "--training.ac_mode (one of 'none', 'full', 'per_iteration'; default 'per_iteration')" in out
    assert "[[data.phases.sources]]" in out
    for section, value in config_to_dict(JobConfig()).items():
        assert f"[{section}]" in out
        for key in value:
            assert f"--{section}.{key}" in out or f"[[{section}.{key}]]" in out


def test_config_to_dict_round_trips_through_json(tmp_path):
    path = write(
        tmp_path,
        """
        [model]
        path = "m"
        [training]
        global_batch_size = 32
        [[data.phases]]
        [[data.phases.sources]]
        path = "a.txt"
        hf_config = "x"
        """,
    )
    cfg = load_config(path, ["--optimizer.adamw_betas", "0.8,0.9"])
    values = config_to_dict(cfg)
    assert values["optimizer"]["adamw_betas"] == [0.8, 0.9]  # plain JSON types
    assert values["training"]["global_batch_size"] == 32 and values["model"]["preset"] is None
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps(values))
    assert config_from_dict(json.loads(saved.read_text())) == cfg
    assert load_config(str(saved)) == cfg  # a run's saved config can be the --config of the next


def test_validate_accepts_defaults_with_a_model():
    cfg = JobConfig()
    cfg.model.path = "m"
    validate(cfg)


# ---------------------------------------------------------------- composition: extends, array overrides


def test_extends_merges_tables_and_replaces_arrays(tmp_path):
    (tmp_path / "base").mkdir()
    write(
        tmp_path,
        """
        [training]
        steps = 100
        seq_len = 256
        [validation]
        recurrences = [1, 2, 4]
        [[data.sources]]
        path = "base.jsonl"
        [[data.sources]]
        path = "base2.jsonl"
        """,
        "base/common.toml",
    )
    write(tmp_path, 'extends = "common.toml"\n[training]\nsteps = 200\nlocal_batch_size = 4\n', "base/recipe.toml")
    write(tmp_path, '[model]\npath = "m"\n[training]\nlocal_batch_size = 2\n', "base/model.toml")
    path = write(
        tmp_path,
        """
        extends = ["base/recipe.toml", "base/model.toml"]
        [validation]
        recurrences = [8]
        [[data.sources]]
        path = "mine.jsonl"
        """,
    )
    cfg = load_config(path)
    assert (cfg.training.steps, cfg.training.seq_len, cfg.training.local_batch_size) == (200, 256, 2)
    assert cfg.model.path == "m"
    assert cfg.validation.recurrences == [8]  # arrays replace
    assert [s.path for s in cfg.data.sources] == ["mine.jsonl"]  # arrays of tables too
    # The result is the same as the one file it stands for.
    flat = write(
        tmp_path,
        """
        [model]
        path = "m"
        [training]
        steps = 200
        seq_len = 256
        local_batch_size = 2
        [validation]
        recurrences = [8]
        [[data.sources]]
        path = "mine.jsonl"
        """,
        "flat.toml",
    )
    assert load_config(flat) == cfg


def test_extends_an_empty_array_clears_the_base(tmp_path):
    write(tmp_path, '[model]\npath = "m"\n[[data.phases]]\n[[data.phases.sources]]\npath = "a"\n', "base.toml")
    path = write(tmp_path, 'extends = "base.toml"\n[data]\nphases = []\n[[data.sources]]\npath = "b"\n')
    data = load_config(path).data
    assert data.phases == [] and [s.path for s in data.sources] == ["b"]


def test_extends_errors_name_the_file(tmp_path):
    base = write(tmp_path, "[training]\nstpes = 1\n", "base.toml")
    path = write(tmp_path, 'extends = "base.toml"\n')
    assert error(load_config, path, MODEL) == f"{base}: [training] unknown key 'stpes' (did you mean 'steps'?)"
    path = write(tmp_path, 'extends = "nope.toml"\n')
    assert error(load_config, path) == f"{path}: extends 'nope.toml', but {tmp_path / 'nope.toml'} is not a file"
    path = write(tmp_path, "extends = 3\n")
    assert error(load_config, path) == f"{path}: extends expects a file name or a list of file names, got 3"
    a = write(tmp_path, 'extends = "b.toml"\n', "a.toml")
    b = write(tmp_path, 'extends = "a.toml"\n', "b.toml")
    assert error(load_config, a) == f"{b}: extends 'a.toml', which extends {b} again (a cycle)"


@pytest.mark.parametrize(
    "override, check",
    [
        (["--data.sources.0.path", "x.jsonl"], lambda d: [s.path for s in d.sources] == ["x.jsonl", "b"]),
        (["--data.sources.1.weight=2"], lambda d: [s.weight for s in d.sources] == [1.0, 2.0]),
        (
            ["--data.sources.2.path", "c", "--data.sources.2.kind", "jsonl"],
            lambda d: (d.sources[2].path, d.sources[2].kind, d.sources[2].text_field) == ("c", "jsonl", "text"),
        ),
    ],
)
def test_cli_sets_fields_inside_arrays_of_tables(tmp_path, override, check):
    path = write(tmp_path, '[model]\npath = "m"\n[[data.sources]]\npath = "a"\n[[data.sources]]\npath = "b"\n')
    assert check(load_config(path, override).data)


def test_cli_sets_data_from_nothing_and_nested_phases():
    cfg = load_config(None, MODEL + ["--data.sources.0.path", "web.jsonl", "--data.sources.0.kind", "jsonl"])
    assert cfg.data.sources == [DataSource(path="web.jsonl", kind="jsonl")]
    cfg = load_config(
        None,
        MODEL
        + [
            "--data.phases.0.sources.0.path",
            "a",
            "--data.phases.1.start_step",
            "10",
            "--data.phases.1.sources.0.path",
            "b",
            "--data.phases.1.sources.1.path",
            "c",
        ],
    )
    assert [(p.start_step, [s.path for s in p.sources]) for p in cfg.data.phases] == [(0, ["a"]), (10, ["b", "c"])]


@pytest.mark.parametrize(
    "override, expected",
    [
        (
            ["--data.sources.1.path", "a"],
            "command line: --data.sources.1.path: data.sources has 0 entries; use an entry number up to 0 "
            "(that one appends a new entry)",
        ),
        (
            ["--data.sources.0.pth", "a"],
            "command line: unknown option --data.sources.0.pth (did you mean --data.sources.0.path?)",
        ),
        (
            ["--data.sources.x.path", "a"],
            "command line: --data.sources.x.path: expected an entry number after --data.sources, got 'x'",
        ),
        (
            ["--data.sources.0", "a"],
            "command line: --data.sources.0 is an entry of data.sources; the only value it takes is none (drop it); "
            "set its fields as --data.sources.0.key",
        ),
        (["--data.sources.0.weight", "heavy"], "command line: --data.sources.0.weight expects float, got 'heavy'"),
        (["--data.phases.0.sources", "a"], "command line: --data.phases.0.sources is an array of tables"),
        (["--training.steps.0", "1"], "command line: unknown option --training.steps.0"),
    ],
)
def test_cli_array_field_errors(override, expected):
    assert error(load_config, None, MODEL + override).startswith(expected)


def test_choice_lists_are_derived_from_the_config_types():
    """The modes a command or a component accepts are the config's Literal types, written once."""
    from typing import get_args

    from titan_recur.cli import eval as eval_cli
    from titan_recur.cli import flops, prepare_data
    from titan_recur.config import (
        DECAY_TYPES,
        MIXED_PRECISION_MODES,
        SAMPLE_BY,
        TEXT_SOURCE_KINDS,
        DataSource,
        LRScheduler,
        Training,
        field_types,
    )
    from titan_recur.models.args import CURRICULUM_KINDS
    from titan_recur.training import parallelize

    def choices(parser, flag: str) -> tuple:
        actions = [a for a in parser._actions if flag in a.option_strings]
        for sub in (a for a in parser._actions if a.choices and isinstance(a.choices, dict)):
            actions += [b for p in sub.choices.values() for b in p._actions if flag in b.option_strings]
        return tuple(actions[0].choices)

    assert choices(prepare_data.build_parser(), "--kind") == TEXT_SOURCE_KINDS
    assert (
        choices(prepare_data.build_parser(), "--sample-by")
        == SAMPLE_BY
        == get_args(field_types(DataSource)["sample_by"])
    )
    assert choices(eval_cli.build_parser(), "--kind") == TEXT_SOURCE_KINDS
    assert set(TEXT_SOURCE_KINDS) == set(get_args(field_types(DataSource)["kind"])) - {"tokenized"}
    assert choices(flops.build_parser(), "--curriculum") == CURRICULUM_KINDS
    assert MIXED_PRECISION_MODES == get_args(field_types(Training)["mixed_precision_mode"])
    assert parallelize.MIXED_PRECISION_MODES is MIXED_PRECISION_MODES
    assert DECAY_TYPES == get_args(field_types(LRScheduler)["decay_type"])
