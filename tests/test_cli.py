"""The `hf-fp8kv compare` command: a small run on the bundled SmolLM2 and on a local model directory, and its errors."""

import argparse
import re
import runpy
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from hf_fp8kv.bundled import smollm2_dir
from hf_fp8kv.cli import build_parser, main
from hf_fp8kv.compat import HAS_FP8_QUANTIZED_CACHE
from tests.models import tiny_model

SMALL = ["--max-new-tokens", "3", "--prefill", "16", "--eval-tokens", "8", "--contexts", "24", "--decode-steps", "1",
         "--no-progress"]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text("Say hello.\n\n")
    return path


def run(capsys, *args):
    status = main(["compare", *args])
    out, err = capsys.readouterr()
    return status, out, err


def test_default_model_prints_the_tables_and_writes_the_plots(capsys, tmp_path, prompts_file):
    status, out, _ = run(capsys, *SMALL, "--variants", "fp8_recent", "--prompts-file", str(prompts_file),
                         "--out", str(tmp_path))
    assert status == 0
    # what the recommended variant gains opens the report and, after the tables, closes the output
    assert out.startswith("== Summary ==\nRecommended: fp8_recent = QuantizedFP8Cache(model, scales='dynamic')")
    assert out.count("Against the native cache (native): ") == 2
    assert out.rstrip().splitlines()[-2].startswith("Against the native cache (native): ")
    assert out.rstrip().splitlines()[-1].startswith("Break-even of decode step time against native on this machine (")
    assert "prompt 1: Say hello." in out
    for name in ("report.txt", "report.html", "kl_vs_position.png", "memory_vs_context.png", "step_time_vs_context.png"):
        assert (tmp_path / name).stat().st_size > 0
        assert str(tmp_path / name) in out


def test_local_model_directory(capsys, tmp_path, prompts_file):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    text = tmp_path / "text.txt"
    text.write_text("The keeper wrote the weather down at six every morning and six every evening. " * 4)
    theirs = ["hf_quantized_fp8"] if HAS_FP8_QUANTIZED_CACHE else []  # transformers' fp8 cache: from 5.21
    status, out, err = run(capsys, *SMALL, "--model", str(tmp_path / "model"), "--variants", ",".join(["fp8_e4m3", *theirs]),
                           "--prompts-file", str(prompts_file), "--text-file", str(text), "--out", str(tmp_path / "out"),
                           "--retrieval-lengths", "160", "--retrieval-depths", "0,100", "--retrieval-trials", "1")
    assert status == 0
    assert all(name in out for name in ("native", "fp8_e4m3", *theirs, "Cost (batch 1)"))
    table = out.split("== Passkey retrieval (keys found / trials, by context length and key depth) ==\n")[1]
    columns = " +".join(["length", "depth_%", "trials", "native", "fp8_e4m3", *theirs])
    assert re.match(columns + r"\n[- ]+\n +160 +0 +1 +[01]/1 ", table)
    assert (tmp_path / "out" / "retrieval.png").stat().st_size > 0
    assert "Recommended" not in out  # fp8_recent was not compared
    # the scale-1.0 variant's warning is summarized once in the report, not printed raw
    assert out.count("fp8_e4m3 warned (UncalibratedScalesWarning): ") == 1 and "Warning" not in err


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "/no/such/model"], "'/no/such/model' is neither a local model directory nor a model in the"),
        (["--variants", "fp8_e4m3,fp9"], "unknown variant 'fp9'; valid names: native, fp8_recent, fp8_per_token_head, int8"),
        (["--prompts-file", "EMPTY"], "prompts is empty"),
        (["--text-file", "SHORT", "--prefill", "64"], r"text 1 has \d+ tokens, no more than prefill=64"),
        (["--gguf-file", "model.gguf"], "--gguf-file needs --model"),
        (["--model", "DIR", "--gguf-file", "model.gguf"], "--gguf-file 'model.gguf': no such file in"),
        (["--retrieval-lengths", "1024", "--retrieval-depths", "50,150"], r"--retrieval-depths \[50, 150\]: percents"),
        (["--retrieval-lengths", "9000"], r"retrieval length 9000 is beyond the model's context \(8192 tokens\)"),
    ],
)
def test_bad_input_exits_2_with_a_clear_error(capsys, tmp_path, args, message):
    (tmp_path / "EMPTY").write_text("\n \n")
    (tmp_path / "SHORT").write_text("Too short.")
    args = [str(tmp_path / a) if a in ("EMPTY", "SHORT") else str(tmp_path) if a == "DIR" else a for a in args]
    status, _, err = run(capsys, *args, "--out", str(tmp_path / "out"))
    assert status == 2
    assert re.search("hf-fp8kv: error: .*" + message, err)


def test_python_m_and_console_script_entry_points(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["hf_fp8kv", "compare", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("hf_fp8kv", run_name="__main__")
    assert exit_info.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "about 3 minutes on 2 CPU cores" in out and "--gguf-file" in out and "--contexts" in out
    scripts = {e.name: e.value for e in entry_points(group="console_scripts")}
    assert scripts["hf-fp8kv"] == "hf_fp8kv.cli:main"


BAD_NUMBERS = [("--max-new-tokens", "0"), ("--prefill", "-1"), ("--eval-tokens", "0"), ("--decode-steps", "x"),
               ("--contexts", "128,0"), ("--retrieval-lengths", "0"), ("--retrieval-depths", "50,-5"),
               ("--retrieval-trials", "0"), ("--memory-budget-gib", "nan"), ("--memory-budget-gib", "inf"),
               ("--memory-budget-gib", "0")]  # fmt: skip


@pytest.mark.parametrize("option,value", BAD_NUMBERS)
def test_a_bad_number_is_a_usage_error_naming_its_option(capsys, option, value):
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", option, value])
    assert exit_info.value.code == 2
    assert f"hf-fp8kv compare: error: argument {option}: " in capsys.readouterr().err


def test_every_numeric_option_is_checked():
    """Each option of compare that takes a number has a case above (a plain int or float type takes nan, inf
    and numbers below 1 to the run, where they fail unnamed or after the model loads)."""
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    actions = commands.choices["compare"]._actions
    assert all(action.type not in (int, float) for action in actions)
    numeric = {action.option_strings[0] for action in actions if action.type not in (None, str, Path)}
    assert numeric == {option for option, _ in BAD_NUMBERS}
