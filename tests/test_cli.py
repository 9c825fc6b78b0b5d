"""python -m dspark.serve's options: checked before the model loads (port range, port in use,
--max-model-len, --speculative-config), each with a one-line error; --help gives every default;
the speculative config and the model's context reach the decoder; a compile cache for other options
is refused naming them."""
from __future__ import annotations

import json
import re
import socket

import pytest
import torch

from dspark.checkpoint import save_drafter
from dspark.compile.cache import save_compile_cache
from dspark.compile.options import build_decoder, compiled_step_options, speculative_config
from dspark.serve import __main__ as serve_main


def exit_message(argv, capsys) -> str:
    """What `python -m dspark.serve argv` says as it exits: its SystemExit, or argparse's error line."""
    with pytest.raises(SystemExit) as caught:
        serve_main.main(argv)
    return f"{caught.value} {capsys.readouterr().err.splitlines()[-1] if caught.value.code == 2 else ''}"


@pytest.fixture
def small_model(default_tokenizer, tmp_path):
    """An HF folder of a small model of a 512-token context, with the default tokenizer."""
    from test_loading import make_model, save_hf
    save_hf(make_model(max_position_embeddings=512), tmp_path)
    default_tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_bad_server_options_exit_naming_them(small_model, capsys):
    """Each once ended in a traceback, from the decoder's or the engine's build."""
    given = ["--model", str(small_model), "--device", "cpu", "--dtype", "float32", "--port", "0"]
    busy = socket.create_server(("127.0.0.1", 0))  # a port in use
    for options, words in [(["--max-batch", "0"], "--max-num-seqs must be >= 1, got 0"),
                           (["--max-model-len", "513"], r"--max-model-len must be in \[1, 512\] for this model"),
                           (["--speculative-config", '{"num_speculative_tokens": 3}'],
                            "num_speculative_tokens=3 needs a drafter"),
                           (["--model", str(small_model / "absent")], "absent: no such model folder"),
                           (["--host", "127.0.0.1", "--port", str(busy.getsockname()[1])], "cannot serve on")]:
        assert re.search(f"python -m dspark.serve: .*{words}", exit_message([*given, *options], capsys))
    busy.close()


@pytest.mark.parametrize("options, words", [
    (["--port", "70000"], "argument --port: invalid port (0-65535) value: '70000'"),
    (["--port", "-1"], "argument --port: invalid port (0-65535) value: '-1'"),
    (["--max-model-len", "0"], "--max-model-len must be >= 1, got 0"),
    (["--max-batch", "-2"], "--max-num-seqs must be >= 1, got -2"),
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1, got 0"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1], got 1.5"),
    (["--kv-cache-memory", "0"], "--kv-cache-memory must be > 0, got 0.0"),
    (["--num-gpu-blocks-override", "1"], "--num-gpu-blocks-override must be >= 2, got 1"),
    (["--block-size", "0"], "--block-size must be >= 1, got 0"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= 1, got 0"),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0, got -1.0"),
    (["--limit-concurrency", "0"], "--limit-concurrency must be >= 1, got 0"),
    (["--allowed-origins", "[1]"], "argument --allowed-origins: invalid origins"),
    (["--speculative-config", "{x"], "--speculative-config is not JSON"),
    (["--port", "BUSY"], "cannot serve on 127.0.0.1:"),
])
def test_options_are_checked_before_the_model_loads(tmp_path, capsys, options, words):
    """The model named does not exist: an option's own error comes first, in one line (the model
    loads in about 20 s)."""
    busy = socket.create_server(("127.0.0.1", 0))
    options = [str(busy.getsockname()[1]) if o == "BUSY" else o for o in options]
    message = exit_message(["--model", str(tmp_path / "absent"), *options], capsys)
    busy.close()
    assert words in message and "absent" not in message


def test_help_gives_every_default(capsys):
    with pytest.raises(SystemExit):
        serve_main.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ["(default: 127.0.0.1)", "(default: 8000)", "(default: 10.0)", "(default: 1024)", "(default: 5.0)",
                    "(default: 8)", "(default: 2048, or the model's maximum", "(default: $DSPARK_API_KEY, else none)",
                    "(default: none, and no CORS headers)", "(default: auto)"]:
        assert default in text


def test_the_api_key_comes_from_the_environment_unless_given(monkeypatch):
    monkeypatch.setenv("DSPARK_API_KEY", "sk-env")
    assert serve_main.parse_args([]).api_key == "sk-env"
    assert serve_main.parse_args(["--api-key", "sk-flag"]).api_key == "sk-flag"
    monkeypatch.setenv("DSPARK_API_KEY", "")
    assert serve_main.parse_args([]).api_key is None


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                            ("localhost", True), ("0.0.0.0", False), ("192.0.2.1", False),
                                            ("example.com", False)])
def test_only_loopback_addresses_get_the_host_check(host, loopback):
    assert serve_main.is_loopback(host) == loopback


def test_the_step_is_compiled_by_default_on_cuda_only(capsys):
    """vLLM's default: compiled unless --enforce-eager; --compile and --no-compile decide where given."""
    def compiles(*argv, device="cpu"):
        args = serve_main.parse_args(list(argv))
        args.device = device  # (this machine may have no CUDA device to name)
        return serve_main.compiles(args)
    assert compiles(device="cuda") and not compiles("--enforce-eager", device="cuda")
    assert not compiles("--no-compile", device="cuda") and not compiles() and compiles("--compile")
    assert compiles("--compile-cache", "c.bin")
    for argv, words in [(["--no-compile", "--compile-cache", "c.bin"], "--no-compile excludes --compile-cache"),
                        (["--enforce-eager", "--compile"], "--enforce-eager excludes --compile")]:
        with pytest.raises(SystemExit):
            serve_main.parse_args(argv)
        assert words in capsys.readouterr().err


def test_a_log_stats_interval_that_is_not_positive_is_refused(capsys):
    with pytest.raises(SystemExit):
        serve_main.parse_args(["--log-stats-interval", "0"])
    assert "--log-stats-interval must be > 0, got 0.0" in capsys.readouterr().err


@pytest.mark.parametrize("text, words", [("{'k': 1}", "is not JSON"), ("[1]", "must be a JSON object"),
                                         ('{"k": 1}', "unknown keys"), ('{"method": "eagle"}', "method must name DSpark, got 'eagle'"),
                                         ('{"num_speculative_tokens": "7"}', "num_speculative_tokens must be"),
                                         ('{"use_rejection_sampling": "false"}', "true or false"),
                                         ('{"model": 3}', "model must be"),
                                         ('{"decoding_type": "Eagle3"}', "decoding_type must name DSpark, got 'Eagle3'"),
                                         ('{"num_speculative_tokens": 3, "max_draft_len": 4}',
                                          "max_draft_len=4 disagrees with num_speculative_tokens=3"),
                                         ('{"max_draft_len": -1}', "max_draft_len must be an integer >= 0, got -1")])
def test_a_bad_speculative_config_exits_naming_what_is_wrong(text, words):
    with pytest.raises(SystemExit, match=words):
        speculative_config(text)


@pytest.mark.parametrize("spec, k, block, greedy_drafts", [
    ("{}", 3, False, False),  # the drafter's block size, vLLM's defaults
    ('{"max_draft_len": 2, "rejection_sample_method": "block"}', 2, True, False),
    ('{"num_speculative_tokens": 1, "use_rejection_sampling": false}', 1, False, True),
    ('{"draft_sample_method": "greedy"}', 3, False, True),
    ('{"model": "none"}', 0, False, False),
    ('{"num_speculative_tokens": 0}', 0, False, False),
    # the seed's TensorRT-LLM config, as it reads
    ('{"decoding_type": "DSpark", "max_draft_len": 2, "speculative_model": "DRAFTER", "use_rejection_sampling": true,'
     ' "rejection_sample_method": "block"}', 2, True, False),
    ('{"method": "dspark", "decoding_type": "DSpark", "speculative_model_dir": "DRAFTER"}', 3, False, False)])
def test_the_speculative_config_reaches_the_decoder(default_tokenizer, tmp_path, spec, k, block, greedy_drafts):
    from test_checkpoint import make_drafter
    from test_loading import make_model, save_hf
    target = make_model(vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0)
    save_hf(target, tmp_path / "target")
    default_tokenizer.backend.save(str(tmp_path / "target" / "tokenizer.json"))
    save_drafter(make_drafter(target), tmp_path / "drafter")  # block size 3
    spec = json.loads(spec.replace("DRAFTER", str(tmp_path / "drafter")))
    if not {"model", "speculative_model", "speculative_model_dir"} & set(spec):
        spec["model"] = str(tmp_path / "drafter")
    args = serve_main.parse_args(["--model", str(tmp_path / "target"), "--device", "cpu", "--dtype", "float32",
                                  "--speculative-config", json.dumps(spec)])
    decoder, _ = build_decoder(args, compile=False)
    assert (decoder.k, decoder.block_verify, decoder.greedy_drafts) == (k, block, greedy_drafts)
    assert (decoder.drafter is None) == (k == 0) == (args.drafter == "none")  # K = 0 loads no drafter


def test_the_default_max_model_len_fits_a_model_of_a_shorter_context(default_tokenizer, tmp_path):
    """--max-model-len's default is 2048 or the model's maximum, if smaller (a 512-token model once
    failed to start); given, it is kept."""
    from test_loading import make_model, save_hf
    save_hf(make_model(max_position_embeddings=512), tmp_path)
    default_tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    for given, want in (([], 512), (["--max-model-len", "300"], 300)):
        args = serve_main.parse_args(["--model", str(tmp_path), "--device", "cpu", "--dtype", "float32", *given])
        build_decoder(args, compile=False)
        assert args.max_model_len == want


@pytest.mark.parametrize("model, name", [(None, "SmolLM2-135M-Instruct"),
                                         ("m/Qwen2.5-0.5B-Instruct", "Qwen2.5-0.5B-Instruct"),
                                         ("m/Qwen2.5-0.5B-Instruct/", "Qwen2.5-0.5B-Instruct"),
                                         ("m/SmolLM2-135M.Q4_1.GGUF", "SmolLM2-135M.Q4_1")])
def test_the_served_name_is_the_models_folder_or_file_name(model, name):
    """Path.stem once cut folder names at their last dot (Qwen2.5-0.5B-Instruct was served as Qwen2.5-0)."""
    assert serve_main.served_name(model) == name


def test_a_compile_cache_for_other_options_stops_the_server_naming_them(default_tokenizer, tmp_path):
    """A warm-up's cache records the server options its step was compiled for; a server started
    with others exits naming the option (it used to load the file and compile everything again)."""
    from test_loading import make_model, save_hf
    save_hf(make_model(), tmp_path)
    default_tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    given = ["--model", str(tmp_path), "--device", "cpu", "--dtype", "float32", "--port", "0"]
    args = serve_main.parse_args([*given, "--max-batch", "4"])
    decoder, _ = build_decoder(args, compile=False)
    torch.compile(lambda x: x.cos() + 1)(torch.randn(4))  # something compiled, to save
    cache = tmp_path / "cache.bin"
    save_compile_cache(cache, decoder.device, compiled_step_options(args, decoder))
    with pytest.raises(SystemExit, match=r"other max_num_seqs .*'max_num_seqs': \(4, 8\)"):
        serve_main.main([*given, "--compile-cache", str(cache)])
    with pytest.raises(SystemExit, match="--compile-cache: .*No such file"):
        serve_main.main([*given, "--compile-cache", str(tmp_path / "missing.bin")])
