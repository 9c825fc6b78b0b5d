"""python -m dspark.generate: a bad option exits naming it, before any model loads where it can."""
from __future__ import annotations

import pytest

from dspark import generate


@pytest.mark.parametrize("bad, words", [(["--max-tokens", "0"], "max_tokens"), (["--temperature", "nan"], "temperature"),
                                        (["--temperature", "inf"], "temperature"), (["--top-k", "-2"], "top_k"),
                                        (["--top-p", "0"], "top_p"), (["-k", "-1"], "--num-speculative-tokens"),
                                        (["--device", "foo"], "'foo' is not a device"),  # once a traceback
                                        (["--device", "cuda:99"], "CUDA devices")])
def test_a_bad_option_exits_before_the_model_loads(bad, words, monkeypatch, capsys):
    """--max-tokens 0 once loaded SmolLM2 (15 s), then died with a traceback."""
    def load_models(args):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(generate, "load_models", load_models)
    with pytest.raises(SystemExit):
        generate.main(["--prompt", "hi", *bad])
    assert words in capsys.readouterr().err


def test_top_k_minus_one_is_off_as_the_server_takes_it():
    assert generate.parse_args(["--prompt", "hi", "--top-k", "-1"]).params.top_k == 0


def test_speculation_without_a_drafter_exits_naming_it(default_tokenizer, tmp_path):
    from test_loading import make_model, save_hf
    save_hf(make_model(), tmp_path)
    default_tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(SystemExit, match="num_speculative_tokens=3 needs a drafter"):
        generate.main(["--model", str(tmp_path), "--drafter", "none", "-k", "3", "--prompt", "hi",
                       "--device", "cpu", "--dtype", "float32"])


def test_a_missing_model_and_a_completion_past_the_models_length_exit_naming_them(default_tokenizer, tmp_path):
    """Each once ended in a traceback."""
    from test_loading import make_model, save_hf
    save_hf(make_model(max_position_embeddings=64, vocab_size=default_tokenizer.vocab_size), tmp_path)
    default_tokenizer.backend.save(str(tmp_path / "tokenizer.json"))
    given = ["--drafter", "none", "--prompt", "hi", "--device", "cpu", "--dtype", "float32"]
    with pytest.raises(SystemExit, match="python -m dspark.generate: .*absent: no such model folder"):
        generate.main(["--model", str(tmp_path / "absent"), *given])
    with pytest.raises(SystemExit, match="python -m dspark.generate: .*exceeds"):
        generate.main(["--model", str(tmp_path), "--max-tokens", "100", *given])
