"""What a new user meets on a first try of the command (issue 27's tour): errors in the subcommand's own form,
output that is safe in a pipe and plain when it is not a terminal, progress only on a terminal, a load that says
what it writes, and messages that say what is wrong before any work is done."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

import squishlike
from squishlike.cli import build_parser
from squishlike.npydir import NpyDir, is_npydir

README = Path(__file__).parents[2] / "README.md"
ANSI = re.compile(r"\x1b\[")


def cli(*args, check_rc: int | None = 0, cwd=None, env=None, stdin=None) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "squishlike", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, **(env or {})}, input=stdin)
    if check_rc is not None:
        assert done.returncode == check_rc, done.stderr
    return done


def on_a_terminal(*args) -> tuple[int, str]:
    """Run the command with its stderr on a pseudo-terminal (stdout a pipe): (exit code, what stderr showed)."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 columns wide
    process = subprocess.Popen([sys.executable, "-m", "squishlike", *map(str, args)], stdout=subprocess.DEVNULL,
                               stderr=terminal, stdin=subprocess.DEVNULL)
    os.close(terminal)
    shown = bytearray()
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(controller)
    return process.wait(), shown.decode(errors="replace")


def test_a_mistyped_option_is_the_subcommands_usage_error(tiny_llama, tmp_path):  # defect 1
    done = cli("compress", tiny_llama, "-o", tmp_path / "out", "--fromat", "int4", check_rc=2)
    assert done.stderr.splitlines()[-1] == "squishlike compress: error: unrecognized arguments: --fromat int4"
    assert done.stderr.startswith("usage: squishlike compress ")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv", [["chat", "--help"], ["compress", "--help"], ["--help"], ["inspect", "{store}"]])
def test_every_command_is_safe_in_a_pipe_closed_early(tiny_llama, tmp_path, argv):  # defect 2
    """`squishlike chat --help | head -3`: the reader leaves before the output is written."""
    store = squishlike.compress(tiny_llama, tmp_path / "out", scheme="int8")
    argv = [a.format(store=store) for a in argv]
    process = subprocess.Popen([sys.executable, "-m", "squishlike", *argv], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    process.stdout.close()  # before the interpreter has even started: every write meets a closed pipe
    stderr = process.stderr.read().decode()
    assert process.wait() == 0, stderr
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr


@pytest.mark.smollm
def test_chat_on_a_pipe_writes_plain_text(smollm_gguf):  # defect 3
    done = cli("chat", "--model", smollm_gguf, "--max-tokens", "3", stdin="hello\nq\n")
    assert "bye" in done.stdout and "mlx_lm.chat" in done.stdout
    assert not ANSI.search(done.stdout) and "\x01" not in done.stdout, repr(done.stdout[:300])


def test_inspect_never_cuts_a_tensor_name(tiny_llama, tmp_path):  # defect 7
    store = squishlike.compress(tiny_llama, tmp_path / "out", scheme="int4")
    names = {t for t in NpyDir(store).entries}
    text = cli("inspect", store, env={"COLUMNS": "60"}).stdout
    table = text.split("\n\n", 1)[1].splitlines()
    shown = {line.split()[0] for line in table[1:] if line and not line.startswith(" ")}
    assert shown == names and "…" not in text
    report = json.loads(cli("inspect", store, "--json").stdout)
    exact = {q["reason"] for q in report["quality"].values() if "rel_error" not in q}
    assert exact
    for reason in exact:  # wrapped at spaces, every word whole
        assert " ".join(reason.split()) in " ".join(text.split()), reason


def test_prune_says_what_it_did_and_what_was_not_there(tiny_llama, tmp_path):  # defect 8
    store = squishlike.compress(tiny_llama, tmp_path / "out", scheme="int8", tiers=("mlx", "int8"))
    squishlike.load(store)
    assert (store / "squish_8bit").is_dir() and (store / "squish_weights.safetensors").exists()
    int8_bytes = sum(p.stat().st_size for p in (store / "squish_8bit").rglob("*") if p.is_file())

    done = cli("prune", store, "--keep", "int4,mlx")
    assert "int4 is not on disk" in done.stdout and "kept mlx" in done.stdout, done.stdout
    assert f"removed tier int8: {int8_bytes / 1e6:.1f} MB" in done.stdout
    assert not (store / "squish_8bit").exists() and (store / "squish_weights.safetensors").exists()

    done = cli("prune", store, "--keep", "")
    assert "removed tier mlx" in done.stdout and not (store / "squish_weights.safetensors").exists()
    assert is_npydir(store)


def test_prune_removes_the_int8_tier_directory(tiny_llama, tmp_path):  # defect 8
    store = squishlike.compress(tiny_llama, tmp_path / "out", scheme="int8", tiers=("int8",))
    squishlike.load(store)
    int8_bytes = sum(p.stat().st_size for p in (store / "squish_8bit").rglob("*") if p.is_file())
    done = cli("prune", store, "--keep", "")
    assert not (store / "squish_8bit").exists() and not (store / ".squish_8bit_ready").exists()
    assert f"freed {int8_bytes / 1e6:.1f} MB" in done.stdout and int8_bytes > 0


def test_prune_of_what_is_not_a_store(tiny_llama):  # defect 8
    before = sorted(p.name for p in tiny_llama.iterdir())
    done = cli("prune", tiny_llama, check_rc=2)
    assert done.stderr.strip() == f"squishlike prune: error: {tiny_llama}: not a squishlike store (no manifest.json)"
    assert sorted(p.name for p in tiny_llama.iterdir()) == before


def test_a_mistyped_local_path_is_not_sent_to_the_hub(tmp_path):  # defect 9
    (tmp_path / "stores").mkdir()
    done = cli("inspect", "stores/nope", cwd=tmp_path, check_rc=2, env={"HF_HUB_OFFLINE": "1"})
    assert done.stderr.strip() == "squishlike inspect: error: stores/nope: no such file or directory"
    hub = cli("inspect", "someone/nope", cwd=tmp_path, check_rc=2, env={"HF_HUB_OFFLINE": "1"})
    assert hub.stderr.startswith("squishlike inspect: error: someone/nope: no such file or directory, and the "
                                 "Hugging Face repo someone/nope")


def test_eval_checks_its_arguments_before_loading(tiny_llama, tmp_path):  # defect 10
    store = squishlike.compress(tiny_llama, tmp_path / "out", scheme="int8")
    before = sorted(p.name for p in store.iterdir())
    done = cli("eval", store, "--reference", tmp_path / "nonexistent", check_rc=2)
    assert done.stderr.strip() == f"squishlike eval: error: {tmp_path / 'nonexistent'}: no such file or directory"
    assert sorted(p.name for p in store.iterdir()) == before  # not loaded: no tier was built


def test_eval_counts_in_english(tiny_llama, tmp_path):  # defect 11
    store = squishlike.compress(tiny_llama, tmp_path / "out", scheme="int8")
    done = cli("eval", store, "--max-tokens", "64")
    assert re.search(r"scored tokens in 1 window$", done.stdout, re.M), done.stdout


def test_the_readme_synopsis_names_every_option():  # defect 12
    synopsis = README.read_text().split("\n## Commands", 1)[1].split("```", 2)[1]
    entries = {entry.split()[1]: entry for entry in re.split(r"\n(?=squishlike )", synopsis.strip())}
    for name, command in build_parser()._subparsers._group_actions[0].choices.items():
        for action in command._actions:
            flag = max(action.option_strings, key=len, default=None)
            if flag not in (None, "--help"):
                assert re.search(rf"{flag}\b", entries[name]), (name, flag)


def test_a_load_that_writes_a_cache_says_what_and_how_much_once(tiny_llama, tmp_path):  # defect 5
    # a cache tier asked for at compress: on mlx[cpu] the default policy writes none
    store = squishlike.compress(tiny_llama, tmp_path / "out", scheme="int8", tiers=("mlx",))
    store_bytes = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
    first = cli("generate", "--model", store, "--prompt", "hi", "--max-tokens", "2", "--ignore-chat-template")
    added = sum(p.stat().st_size for p in store.rglob("*") if p.is_file()) - store_bytes
    said = [line for line in first.stderr.splitlines() if "squishlike prune" in line]
    assert said == [f"{store}: wrote the cache tier mlx for faster loads ({added / 1e6:.1f} MB more on disk); "
                    f"`squishlike prune {store}` removes it"], first.stderr
    again = cli("generate", "--model", store, "--prompt", "hi", "--max-tokens", "2", "--ignore-chat-template")
    assert "squishlike prune" not in again.stderr


def test_forcing_a_tier_the_device_order_would_not_take_says_why(tiny_llama, tmp_path):  # defect 6
    from squishlike.tiers.order import reason

    store = squishlike.compress(tiny_llama, tmp_path / "out", scheme="int8", tiers=("mlx", "int8"))
    squishlike.load(store, tier="int8")
    squishlike.load(store, tier="mlx")
    slower, faster = "mlx", "int8"  # every device takes the quantized tiers first (tiers/order.py)
    argv = ["generate", "--model", store, "--prompt", "hi", "--max-tokens", "2", "--ignore-chat-template"]
    done = cli(*argv, "--tier", slower)
    assert f"{store}: tier {slower} is forced, but a load here would take {faster}: {reason()}" in done.stderr
    assert "is forced" not in cli(*argv, "--tier", faster).stderr


def test_progress_on_a_terminal_and_nothing_on_a_pipe(tiny_llama, tmp_path):  # defect 4
    rc, shown = on_a_terminal("compress", tiny_llama, "-o", tmp_path / "int8")
    assert rc == 0 and re.search(r"compress: +100%\|", shown), shown
    rc, shown = on_a_terminal("eval", tmp_path / "int8", "--max-tokens", "64")
    assert rc == 0 and re.search(r"teacher-forced: +100%\|", shown), shown
    piped = cli("compress", tiny_llama, "-o", tmp_path / "int4", "--scheme", "int4")
    assert piped.returncode == 0 and "%|" not in piped.stderr and "\r" not in piped.stderr
    piped = cli("eval", tmp_path / "int4", "--max-tokens", "64")
    assert "%|" not in piped.stderr and "\r" not in piped.stderr
