"""The bundled models' converted copies under `$HF_FP8KV_CACHE`: processes that want one at once (test workers)
make it once."""

import threading

from filelock import FileLock

from hf_fp8kv import bundled


def test_a_conversion_under_way_elsewhere_is_waited_for_not_repeated(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_FP8KV_CACHE", str(tmp_path))
    target, got = tmp_path / "model", []

    def convert():
        got.append(bundled.converted_dir("model", lambda: got.append("a second conversion")))

    with FileLock(tmp_path / "model.lock"):  # another process converting
        waiting = threading.Thread(target=convert)
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive()  # it waits for the lock
        target.mkdir()
        (target / "config.json").write_text("{}")
        (target / "tokenizer_config.json").write_text("{}")
    waiting.join(10)
    assert got == [target]  # the other's copy, no second conversion
