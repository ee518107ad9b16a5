"""The `hf-fp8kv serve` command line: transformers' `serve` options and ours in one command, our defaults, and
what reaches the server (no server is started: `FP8Serve` is replaced by a recorder)."""

import re

import click
import pytest

pytest.importorskip("fastapi", reason="the serving extra: pip install hf-fp8kv[serve]")
pytest.importorskip("transformers.cli.serve", reason="this transformers has no `transformers serve`")

from hf_fp8kv import cli  # noqa: E402
from hf_fp8kv.serving import FP8Options, command  # noqa: E402


@pytest.fixture
def started(monkeypatch):
    """The keyword arguments each `FP8Serve` would have been built with."""
    calls = []
    monkeypatch.setattr(command, "FP8Serve", lambda options, **kwargs: calls.append(dict(options=options, **kwargs)))
    monkeypatch.setattr("hf_fp8kv.bundled.smollm2_dir", lambda: "/bundled/smollm2")
    return calls


def test_help_lists_transformers_options_and_ours(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for option in ("--cb-num-blocks", "--cb-block-size", "--port", "--dtype", "--kv-cache-dtype", "--scales",
                   "--skip-layers", "--recent-tokens", "--sink-tokens", "--outlier-tokens", "--scale-search",
                   "--rotate", "--max-requests", "--kv-memory-mib"):  # fmt: skip
        assert option in out, option


def test_defaults_serve_the_bundled_model_with_the_recommended_pages(started):
    with pytest.raises(SystemExit) as exit_:
        command.main(["--port", "8123", "--cb-block-size", "16"])
    assert exit_.value.code == 0
    (call,) = started
    assert call["force_model"] == "/bundled/smollm2" and call["continuous_batching"] is True
    assert call["port"] == 8123 and call["cb_block_size"] == 16 and call["blocking"] is True
    options = call["options"]
    assert (options.kv_cache_dtype, options.scales, options.skip_layers) == ("fp8", "dynamic", "")
    assert (options.recent_tokens, options.sink_tokens, options.max_requests) == (128, 4, None)  # the cache's
    assert options.rotate is False and options.outlier_tokens == 0 and options.scale_search == 0  # the cache's


def test_the_cache_flags_reach_the_server(started):
    with pytest.raises(SystemExit):
        cli.main(["serve", "org/model", "--scales", "0.05", "--kv-cache-dtype", "fp8_e5m2", "--skip-layers", "0,3",
                  "--recent-tokens", "0", "--sink-tokens", "0", "--kv-memory-mib", "64"])  # fmt: skip
    (call,) = started
    options = call["options"]
    assert call["force_model"] == "org/model" and options.scales == 0.05 and options.kv_cache_dtype == "fp8_e5m2"
    assert (options.skip_layers, options.recent_tokens, options.sink_tokens) == ("0,3", 0, 0)
    assert options.kv_memory_mib == 64 and options.rotate is False


def test_the_rotate_flag_reaches_the_server(started):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--rotate"])
    (call,) = started
    assert call["options"].rotate is True


def test_the_outlier_tokens_flag_reaches_the_server(started):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--outlier-tokens", "16"])
    (call,) = started
    assert call["options"].outlier_tokens == 16


def test_the_scale_search_flag_reaches_the_server(started, capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--scale-search", "16"])
    (call,) = started
    assert call["options"].scale_search == 16
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--scale-search", "3"])
    assert exit_.value.code == 2 and "--scale-search" in capsys.readouterr().err


def test_turning_continuous_batching_off_is_a_usage_error(started, capsys):
    with pytest.raises(SystemExit) as exit_:
        command.main(["--no-continuous-batching"])
    assert exit_.value.code == 2 and "drop --no-continuous-batching" in capsys.readouterr().err
    assert started == []


def bad_values(param) -> list[str]:
    """Values out of a numeric option's range: nan and inf for floats, one past each bound for integers."""
    if isinstance(param.type, click.FloatRange):
        return ["nan", "inf", "-inf"]
    low, high = param.type.min, param.type.max
    return [str(bound) for bound in (None if low is None else low - 1, None if high is None else high + 1)
            if bound is not None]  # fmt: skip


def test_every_numeric_option_refuses_bad_numbers_by_name(started, capsys):
    """Ours and transformers serve's: each numeric option is ranged, and a value outside (nan and inf for a
    float) is a usage error naming the option, before any server starts."""
    numeric = (click.types.IntParamType, click.types.FloatParamType)
    params = [p for p in command.serve_command().params if isinstance(p.type, numeric)]
    assert {p.name for p in params} >= {"kv_memory_mib", "recent_tokens", "max_requests", "cb_num_blocks", "port",
                                        "cb_max_memory_percent"}  # fmt: skip
    for param in params:
        assert isinstance(param.type, (click.IntRange, click.FloatRange)), f"{param.opts[0]} is not ranged"
        values = bad_values(param)
        assert values, param.opts[0]
        for value in values:
            with pytest.raises(SystemExit) as exit_:
                command.main([f"{param.opts[0]}={value}"])
            assert exit_.value.code == 2 and f"Invalid value for '{param.opts[0]}'" in capsys.readouterr().err
    assert started == []


@pytest.mark.parametrize("scales", ["nan", "inf", "0", "-0.5"])
def test_a_scale_that_is_not_positive_and_finite_is_refused(started, capsys, scales):
    with pytest.raises(SystemExit) as exit_:
        command.main(["--scales", scales])
    assert exit_.value.code == 2 and "Invalid value for '--scales'" in capsys.readouterr().err
    assert started == []


@pytest.mark.parametrize("mib", [float("nan"), float("inf"), 0, -1, True])
def test_the_kv_memory_option_is_checked_in_python_too(mib):
    with pytest.raises(ValueError, match="kv_memory_mib="):
        FP8Options(kv_memory_mib=mib)


def test_a_transformers_without_the_servers_internals_is_refused_naming_the_release(monkeypatch, capsys):
    from transformers.cli.serve import Serve

    monkeypatch.delattr(Serve, "start_server")  # (as transformers 5.25, which rewrote its server)
    assert cli.main(["serve", "--port", "8011"]) == 2
    refusal = r"as of transformers 5\.24\.x, .*'hf-fp8kv\[serve\]'.* lacks \['Serve\.start_server'\]"
    assert re.search(refusal, capsys.readouterr().err)
