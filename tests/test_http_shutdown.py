"""SIGTERM and SIGINT while 8 streams run, on a server process (a small random model, which loads in
a moment): each stream ends with its full text or with an error event (the official client raises
it), never cut short silently; the process exits 0, with no traceback and no C++ abort."""
from __future__ import annotations

import signal
import threading

import openai
import pytest
import torch

from test_serve_harness import ServerProcess

SHUTDOWN_TIMEOUT = 1.0
SHORT, LONG = 24, 4000  # new tokens: the short streams may finish in the drain, the long ones cannot


@pytest.fixture(scope="module")
def model_folder(default_tokenizer, tmp_path_factory):
    from test_loading import make_model, save_hf
    folder = tmp_path_factory.mktemp("model")
    model = make_model(vocab_size=default_tokenizer.vocab_size, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.nn.init.normal_(model.lm_head.weight, std=1.0)  # sampled tokens of every kind, so streams have text
    save_hf(model, folder)
    default_tokenizer.backend.save(str(folder / "tokenizer.json"))
    return folder


def stream(client: openai.OpenAI, max_tokens: int, started: threading.Event, outcome: dict) -> None:
    """Reads one stream to its end: outcome gets its tokens and finish reason, or the error it raised."""
    try:
        chunks = client.completions.create(model="m", prompt=[1, 2, 3], max_tokens=max_tokens, stream=True,
                                           extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
        for chunk in chunks:
            started.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                outcome["finish_reason"] = chunk.choices[0].finish_reason
            if chunk.usage:
                outcome["tokens"] = chunk.usage.completion_tokens
    except openai.APIError as error:
        outcome["error"] = str(error)
    finally:
        started.set()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_drains_the_streams_then_ends_the_rest_with_an_error_and_exits_0(model_folder, sig):
    server = ServerProcess("--model", str(model_folder), "--served-model-name", "m", "--max-model-len", "4096",
                           "--shutdown-timeout", str(SHUTDOWN_TIMEOUT), "--disable-log-stats")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="EMPTY", max_retries=0, timeout=120)
    lengths = [SHORT, LONG] * 4
    outcomes, started = [{} for _ in lengths], [threading.Event() for _ in lengths]
    threads = [threading.Thread(target=stream, args=(client, n, s, o))
               for n, s, o in zip(lengths, started, outcomes)]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(120)
    server.process.send_signal(sig)
    for thread in threads:
        thread.join(120)
    code = server.process.wait(60)
    server.stop()
    log = "".join(server.lines)
    for n, outcome in zip(lengths, outcomes):
        full = outcome.get("finish_reason") == "length" and outcome.get("tokens") == n and "error" not in outcome
        cut = "shutting down" in outcome.get("error", "") and "finish_reason" not in outcome
        assert full or cut, outcome
    assert all("shutting down" in o.get("error", "") for n, o in zip(lengths, outcomes) if n == LONG)
    assert code == 0 and "Traceback" not in log and "terminate called" not in log, log
