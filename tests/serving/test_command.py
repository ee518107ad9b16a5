"""The `hf-fp8kv serve` command line: transformers' `serve` options and ours in one command, our defaults, and
what reaches the server (no server is started: `FP8Serve` is replaced by a recorder)."""

import pytest

pytest.importorskip("fastapi", reason="the serving extra: pip install hf-fp8kv[serve]")
pytest.importorskip("transformers.cli.serve", reason="this transformers has no `transformers serve`")

from hf_fp8kv import cli  # noqa: E402
from hf_fp8kv.serving import command  # noqa: E402


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
                   "--skip-layers", "--recent-tokens", "--sink-tokens", "--max-requests", "--kv-memory-mib"):  # fmt: skip
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


def test_the_cache_flags_reach_the_server(started):
    with pytest.raises(SystemExit):
        cli.main(["serve", "org/model", "--scales", "0.05", "--kv-cache-dtype", "fp8_e5m2", "--skip-layers", "0,3",
                  "--recent-tokens", "0", "--sink-tokens", "0", "--kv-memory-mib", "64"])  # fmt: skip
    (call,) = started
    options = call["options"]
    assert call["force_model"] == "org/model" and options.scales == 0.05 and options.kv_cache_dtype == "fp8_e5m2"
    assert (options.skip_layers, options.recent_tokens, options.sink_tokens) == ("0,3", 0, 0)
    assert options.kv_memory_mib == 64


def test_turning_continuous_batching_off_is_a_usage_error(started, capsys):
    with pytest.raises(SystemExit) as exit_:
        command.main(["--no-continuous-batching"])
    assert exit_.value.code == 2 and "drop --no-continuous-batching" in capsys.readouterr().err
    assert started == []
