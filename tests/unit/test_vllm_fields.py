"""vLLM's request details without a server: the ``seed`` range error worded as pydantic's
(vLLM relays it), one ``logit_bias`` error naming every bad key, ``prompt_logprobs=-1``,
and the serve flags named as vLLM's (served names, chat template, CORS lists, HTTPS pair)."""

from __future__ import annotations

import argparse

import pytest
from pydantic import ValidationError

from radixserve.config import ServerConfig
from radixserve.entrypoints.openai.errors import error_from_validation, error_from_value_error
from radixserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.entrypoints.serve_cli import _str_list, load_chat_template, register
from radixserve.sampling_params import MAX_SEED, MIN_SEED, SamplingParams


@pytest.mark.parametrize(("seed", "kind"), [(MIN_SEED - 1, "greater_than_equal"),
                                            (MAX_SEED + 1, "less_than_equal")])
def test_seed_out_of_range_is_pydantics_error(seed, kind):
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": "x", "seed": seed})
    err = error_from_validation(e.value)
    assert err.param == "seed" and f"[type={kind}," in err.message
    assert "Input should be" in err.message
    CompletionRequest.model_validate({"prompt": "x", "seed": MAX_SEED})


def test_logit_bias_error_names_every_bad_key():
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}],
        "logit_bias": {"12": 1.0, "abc": 2.0, "-3": 1.0, "50000": -1.0, "7": 0.5}})
    with pytest.raises(ValueError) as e:
        req.logit_bias_ids(vocab_size=49152)
    err = error_from_value_error(e.value)
    assert err.param == "logit_bias"
    for key in ("abc", "-3", "50000"):
        assert repr(key) in err.message
    assert "'12'" not in err.message and "'7'" not in err.message
    ok = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": "x"}], "logit_bias": {"12": 1.0}})
    assert ok.logit_bias_ids(49152) == {12: 1.0}


def test_prompt_logprobs_minus_one_means_the_whole_vocabulary():
    assert SamplingParams(prompt_logprobs=-1).prompt_logprobs == -1
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-2)


def _serve_ns(*args: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    return p.parse_args(["serve", *args])


def test_serve_flags_as_vllm_names_them(tmp_path):
    ns = _serve_ns("--served-model-name", "a", "b", "--allowed-origins",
                   '["https://x.example"]', "--tool-call-parser", "mistral",
                   "--enable-auto-tool-choice")
    assert ns.served_model_name == "a" and ns.served_model_names == ["a", "b"]
    assert ns.allowed_origins == ["https://x.example"]
    assert _str_list("https://a.example, https://b.example") == ["https://a.example",
                                                                   "https://b.example"]
    with pytest.raises(SystemExit):
        _serve_ns("--tool-call-parser", "nope")
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert load_chat_template(str(f)) == f.read_text()
    assert load_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ValueError, match="chat-template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="ssl"):
        ServerConfig(ssl_keyfile="k.pem")
