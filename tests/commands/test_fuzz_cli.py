"""The CLI fuzzer: Hypothesis drives every command's argument parser with generated arguments (each flag
the command has, with values of every kind: numbers in and out of range, text that is empty, not UTF-8
or spans lines, paths that are missing or taken), and each run must exit 0 or 2, with exactly one line
on stderr when it exits 2, and never a traceback.

Nothing long starts: the first function of each command that does real work (building a runner,
measuring, serving, writing the output) is replaced by one that raises ``Reached``, so an example ends as
soon as its arguments have passed every check, and the checks themselves run for real: argparse's flag
types, the model opened (a tiny checkpoint, a missing path, a file that is no model), the prompt
tokenised, positions and cache memory, the serving port bound (and released). It runs in a scratch
directory, so relative outputs land nowhere that matters. A fixed seed and few examples per command
in the default suite; ``slow`` runs many more.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from linnet.cli import build_parser, main

CASE = "qwen3-gqa3"


class Reached(Exception):
    """The arguments passed every check: the command was about to start its work."""


def reached(*args: object, **kwargs: object) -> None:
    raise Reached


# (module, attribute): the first real work of each command, replaced by ``reached``
WORK = [
    ("linnet.commands.run", "pick_runner"),
    ("linnet.commands.serve", "serve"),  # serve: the server starts, loading the model behind it
    ("linnet.serve.model_thread", "ModelThread"),  # the runner is built on it (triton's engine too)
    ("linnet.commands.bench", "run_bench"),
    ("linnet.commands.bench", "run_all"),
    ("linnet.commands.bench_serve", "serving_results"),
    ("linnet.commands.export", "export_hf"),
    ("linnet.commands.export", "export_gguf"),
    ("linnet.commands.compile", "atomic_write"),
    ("linnet.commands.triton", "atomic_write"),
    ("linnet.site.render", "atomic_write"),  # site: the results files are read and checked first
]

if importlib.util.find_spec("ray") is not None:
    WORK.append(("linnet.ray.deployment", "build"))  # serve --replicas: the application, before Ray starts

ODD = ["", " ", "-", "--", "-1", "0", "1", "2", "3", "65535", "65536", "70000", str(2**63), str(2**64), "1e400",
       "nan", "inf", "-inf", "0.5", "1.5", "4M", "0k", "1G", "99999999999999999999G", "caf\udce9 \udcff", "\ud800",
       "two\nlines", "tab\there", "x" * 300, "\x00", "--help", "f32", "bf16", "torch:eager", "onnx:cpu"]


PLAUSIBLE = ["1", "2", "3", "8", "64", "128", "200", "256", "0.5", "1.0", "4k", "The quick", "Hi", "x"]
# Arguments that take a command past its first checks, given now and then
USUALLY = {"run": [["--prompt", "The quick"], ["--chat", "Hi"], ["--chat", "Hi", "--max-new-tokens", "8"]],
           "serve": [["--positions", "128"], ["--positions", "256", "--rows", "2"]],
           "triton": [["--positions", "128"]], "export hf": [["-o", "out"]], "export gguf": [["-o", "out"]],
           "compile": [["-o", "out"]]}


def value() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(ODD), st.integers(-10, 100_000).map(str), st.text(max_size=12))


def accepts(action: argparse.Action, text: str) -> bool:
    try:
        (action.type or str)(text)
    except (argparse.ArgumentTypeError, ValueError, TypeError):
        return False
    return True


def flag_pieces(action: argparse.Action) -> st.SearchStrategy[list[str]]:
    """One use of an optional flag: its name, then mostly a value its type takes, else any other."""
    name = st.sampled_from(action.option_strings)
    if action.nargs == 0:
        return name.map(lambda n: [n])
    likely = list(action.choices) if action.choices else [v for v in PLAUSIBLE if accepts(action, v)]
    values = st.one_of(st.sampled_from(likely), st.sampled_from(likely), value()) if likely else value()
    return st.tuples(name, values).map(list)


def arguments(command: str, parser: argparse.ArgumentParser, models: list[str]) -> st.SearchStrategy[list[str]]:
    """The model (when the command takes one) from ``models``, now and then the flags that take the command
    further (``USUALLY``), then flags in any order, now and then a stray word."""
    flags = [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]
    stray = value().map(lambda v: [v])
    piece = st.one_of(*(flag_pieces(a) for a in flags), stray) if flags else stray
    takes_model = any(a.dest == "model" for a in parser._actions)
    head = st.sampled_from(models).map(lambda m: [m]) if takes_model else st.just([])
    usual = st.one_of(st.just([]), st.sampled_from(USUALLY[command])) if command in USUALLY else st.just([])
    rest = st.lists(piece, max_size=5).map(lambda pieces: [w for p in pieces for w in p])
    return st.tuples(head, usual, rest).map(lambda parts: [w for part in parts for w in part])


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each command's parser by its words (``export hf`` has one of its own)."""
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    found = {}
    for name, command in sub.choices.items():
        nested = [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]
        if nested:
            found.update({f"{name} {n}": p for n, p in nested[0].choices.items()})
        else:
            found[name] = command
    return found


COMMANDS = list(subparsers(build_parser()))


@pytest.fixture(scope="module")
def scene(checkpoint_dir, tmp_path_factory):
    """A scratch working directory with outputs that are taken, and the models the examples name."""
    root = tmp_path_factory.mktemp("fuzz-cli")
    (root / "file").write_text("not a model")
    (root / "full").mkdir()
    (root / "full" / "keep").write_text("keep me")
    (root / "empty").mkdir()
    models = [str(checkpoint_dir(CASE)), str(root / "missing"), str(root / "file"), str(root / "empty"),
              "no-such-registry-name"]
    ODD.extend([str(root / "file"), str(root / "full"), str(root / "out"), "/proc/linnet-fuzz"])
    with pytest.MonkeyPatch.context() as patch:
        for module, attribute in WORK:
            patch.setattr(f"{module}.{attribute}", reached)
        patch.chdir(root)
        yield models
    assert (root / "full" / "keep").read_text() == "keep me"  # nothing was written over


def check(argv: list[str]) -> None:
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            status = main(argv)
        except SystemExit as e:  # argparse: --help, --version, a usage mistake
            status = e.code
        except Reached:
            status = 0
    text = err.getvalue()
    assert "Traceback" not in text, text
    assert status in (0, 2), (status, text)
    if status == 2:
        assert text.startswith("linnet: error: ") and text.count("\n") == 1 and text.endswith("\n"), text


def fuzz(command: str, models: list[str], examples: int) -> None:
    parser = subparsers(build_parser())[command]

    @settings(max_examples=examples, derandomize=True, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(arguments(command, parser, models))
    def run(argv: list[str]) -> None:
        check([*command.split(), *argv])

    run()


@pytest.mark.parametrize("command", COMMANDS)
def test_generated_arguments(command, scene):
    fuzz(command, scene, examples=40)


@pytest.mark.slow
@pytest.mark.parametrize("command", COMMANDS)
def test_generated_arguments_at_length(command, scene):
    fuzz(command, scene, examples=500)

