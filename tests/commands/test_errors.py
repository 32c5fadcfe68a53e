"""Every command's failure is one line naming the file, flag or field in the user's words, and every
command that writes follows one overwrite rule (refuse what holds something, unless --force)."""
from __future__ import annotations

import os
import shutil
import stat

import pytest

from linnet.cli import main
from linnet.model import resolve


def one_line_error(argv: list[str], capsys) -> str:
    """Run ``linnet ARGV``; it must fail with exit status 2 and a single line on stderr."""
    capsys.readouterr()  # what building the fixtures printed
    try:
        status = main(argv)
    except SystemExit as e:  # argparse's own exit, through Parser.error
        status = e.code
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.count("\n") == 1 and err.startswith("linnet: error: "), err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize(("argv", "expected"), [
    (["run", "--dtype", "f64"], "argument --dtype: invalid choice: 'f64'"),
    (["run", "--backend", "nope"], "argument --backend: invalid choice: 'nope'"),
    (["run", "--max-new-tokens", "0"], "argument --max-new-tokens: must be at least 1, got 0"),
    (["run", "--max-new-tokens", "x"], "argument --max-new-tokens: expected a whole number, got 'x'"),
    (["run", "--top-p", "0"], "argument --top-p: must be in (0, 1], got 0"),
    (["run", "--temperature", "nan"], "argument --temperature: must be in [0, 100], got nan"),
    (["run", "--top-k", "-1"], "argument --top-k: must be at least 0, got -1"),
    (["bench", "--new-tokens", "1"], "argument --new-tokens: must be at least 2, got 1"),
    (["bench", "--warmup", "-1"], "argument --warmup: must be at least 0, got -1"),
    (["export", "gguf"], "the following arguments are required: -o/--output"),
    (["frobnicate"], "argument command: invalid choice: 'frobnicate'"),
])
def test_usage_mistakes_are_one_line(argv, expected, capsys):
    err = one_line_error(argv, capsys)
    assert expected in err and f"`linnet {argv[0]}" in err or argv[0] == "frobnicate"


def test_the_cache_message_adds_up(checkpoint_dir, capsys):
    err = one_line_error(["run", str(checkpoint_dir("qwen3-gqa3")), "--prompt", "a b c d e f g h",
                          "--max-new-tokens", "128", "--cache-positions", "64"], capsys)
    prompt = int(err.split("the prompt's ")[1].split(" tokens")[0])
    assert f"need {prompt} + 128 - 1 = {prompt + 127} cache positions" in err and "holds 64" in err


def test_a_truncated_gguf_names_the_file_and_field(tmp_path, capsys):
    path = tmp_path / "cut.gguf"
    path.write_bytes(resolve("smollm2").read_bytes()[:100_000])
    err = one_line_error(["info", str(path)], capsys)
    assert f"{path} is not a readable GGUF file: metadata 'tokenizer.ggml.tokens': needs 8 bytes" in err
    assert "unpack_from" not in err


@pytest.mark.parametrize("where", ["/proc/linnet-site", "{file}/site"])
def test_site_into_an_unwritable_place(where, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    out = where.format(file=tmp_path / "file")
    err = one_line_error(["site", "-o", out], capsys)
    assert f"cannot write to {out}" in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_site_into_a_read_only_directory(tmp_path, capsys):
    tmp_path.chmod(0o500)
    try:
        assert "Permission denied" in one_line_error(["site", "-o", str(tmp_path / "site")], capsys)
    finally:
        tmp_path.chmod(0o700)


def writers(model: str, out: str) -> dict[str, list[str]]:
    """Every command that writes, with its output at ``out``."""
    return {
        "site": ["site", "-o", out],
        "compile": ["compile", model, "--target", "torch", "-o", out],
        "compile program": ["compile", model, "--target", "program", "-o", out],
        "export hf": ["export", "hf", model, "-o", out],
        "export gguf": ["export", "gguf", model, "-o", out],
        "bench": ["bench", model, "--backend", "torch:eager", "-o", out],
    }


@pytest.mark.parametrize("command", list(writers("", "")))
@pytest.mark.parametrize("existing", ["file", "full directory"])
def test_every_writer_refuses_what_exists_unless_forced(command, existing, checkpoint_dir, tmp_path, capsys):
    out = tmp_path / "out"
    if existing == "file":
        out.write_text("keep me")
    else:
        out.mkdir()
        (out / "keep").write_text("keep me")
    argv = writers(str(checkpoint_dir("qwen2-tied")), str(out))[command]
    err = one_line_error(argv, capsys)
    assert f"{out} already exists" in err and "pass --force to replace it" in err
    assert (out.read_text() if existing == "file" else (out / "keep").read_text()) == "keep me"


@pytest.mark.parametrize("command", ["site", "compile", "export hf"])
def test_force_replaces_a_full_directory(command, checkpoint_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale").write_text("old")
    assert main([*writers(str(checkpoint_dir("qwen2-tied")), str(out))[command], "--force"]) == 0
    assert not (out / "stale").exists() and any(out.iterdir())
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # nothing left aside


def test_files_get_the_users_umask(checkpoint_dir, tmp_path, capsys):
    """safetensors' writer makes 0600 files; what Linnet writes has the modes the umask gives."""
    old = os.umask(0o027)
    try:
        model = str(checkpoint_dir("qwen2-tied"))
        assert main(["export", "hf", model, "-o", str(tmp_path / "hf")]) == 0
        assert main(["compile", model, "--target", "torch", "-o", str(tmp_path / "torch")]) == 0
        assert main(["export", "gguf", model, "-o", str(tmp_path / "m.gguf")]) == 0
    finally:
        os.umask(old)
    for path in [tmp_path / "hf", tmp_path / "torch", *(tmp_path / "hf").iterdir(), *(tmp_path / "torch").iterdir(),
                 tmp_path / "m.gguf"]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o750 if path.is_dir() else 0o640), (path, oct(mode))


def test_an_empty_directory_is_no_obstacle(checkpoint_dir, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    assert main(["export", "gguf", str(checkpoint_dir("qwen2-tied")), "-o", str(tmp_path / "m.gguf")]) == 0
    assert main(["site", "-o", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "index.html").is_file()
    shutil.rmtree(tmp_path / "out")
