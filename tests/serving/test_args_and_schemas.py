"""AppArgs (serve run arguments) and the OpenAI request schemas, without Ray or a model."""

import json

import pytest
from pydantic import ValidationError

from deployments.api import error_response, to_generate_request, validation_error_response
from deployments.args import AppArgs
from deployments.openai_schemas import ChatCompletionRequest, CompletionRequest, RefusedField
from faser.engine.async_engine import TextDeltas


def test_command_line_strings_become_typed_arguments():
    args = AppArgs.model_validate(
        {"model": "/m", "draft_model": "/d", "device": "cuda", "num_replicas": "auto",
         "max_k": "3", "policy": "fixed", "weight_format": "dense"}
    )
    assert args.num_replicas == "auto" and args.max_k == 3 and args.gpus_per_replica == 1.0
    config = args.engine_config()
    assert config.spec.policy == "fixed" and config.spec.num_speculative_tokens == 3
    assert config.weight_format == "dense"
    assert AppArgs.model_validate({"num_replicas": "2"}).num_replicas == 2


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"num_replicas": "many"}, "num_replicas"),
        ({"policy": "magic"}, "policy"),
        ({"device": "tpu"}, "device"),
        ({"weight_format": "tuned"}, "weight_format"),
        ({"max_k": 99}, "max_k"),
        ({"draft_model": "/d"}, "draft_model"),
        ({"modle": "/m"}, "modle"),
    ],
)
def test_bad_arguments_name_the_field(bad, field):
    with pytest.raises(ValidationError, match=field):
        AppArgs.model_validate(bad)


def test_a_cpu_replica_takes_its_nodes_cores_by_default():
    from ray._private.utils import get_num_cpus

    cores = int(get_num_cpus())
    args = AppArgs()
    assert args.ray_actor_options() == {"num_cpus": float(cores), "num_gpus": 0.0}
    assert args.engine_config().num_threads == cores
    one = AppArgs(num_cpus=1)
    assert one.ray_actor_options()["num_cpus"] == 1.0 and one.engine_config().num_threads == 1
    assert AppArgs(device="cuda").ray_actor_options() == {"num_cpus": 1.0, "num_gpus": 1.0}


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "prompt": "hi", "max_tokens": "5"}',  # string for an integer
        b'{"model": "m", "prompt": "hi", "temperature": -0.5}',
        b'{"model": "m", "prompt": "hi", "stream": "yes"}',
        b'{"model": "m", "prompt": "hi", "n": 0}',
        b'{"model": "m", "prompt": "hi", "n": 65}',
        b'{"model": "m", "prompt": ["a", "b"], "n": 33}',  # 66 choices
        b'{"model": "m", "prompt": ""}',
        b'{"model": "m", "prompt": ["a", ""]}',
        b'{"model": "m", "prompt": [[1], []]}',
        b'{"model": "m", "prompt": [1, "a"]}',
        b'{"model": "m", "prompt": "hi", "logprobs": 21}',
        b'{"model": "m", "prompt": "hi", "logprobs": true}',
        b'{"model": "m", "prompt": "hi", "presence_penalty": 2.5}',
        b'{"model": "m", "prompt": "hi", "repetition_penalty": 0}',
        b'{"model": "m", "prompt": "hi", "min_p": 1.5}',
        b'{"model": "m", "prompt": "hi", "seed": 9223372036854775808}',
        b'{"model": "m", "prompt": "hi", "speculation": {"policy": "magic"}}',
        b'{"model": "m", "prompt": "hi", "speculation": {"max_k": -1}}',
        b'{"prompt": "hi"}',
        b'{"model": "m", "prompt": "hi",',
    ],
)
def test_bad_completion_bodies_are_rejected(body):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate_json(body)


def test_chat_request_renders_text_parts_and_prefers_max_completion_tokens():
    request = ChatCompletionRequest.model_validate_json(
        b'{"model": "m", "max_tokens": 9, "max_completion_tokens": 4, "messages": '
        b'[{"role": "user", "content": [{"type": "text", "text": "a"}, '
        b'{"type": "text", "text": "b"}]}], "stop": "x", "user": "u1"}'
    )
    assert request.conversation() == [{"role": "user", "content": "ab"}]
    assert request.max_new_tokens == 4 and request.stop_strings() == ("x",)


def test_text_deltas_hold_back_a_partial_stop_string_and_incomplete_characters():
    deltas = TextDeltas(stop=("END",))
    assert deltas.delta("Hello E", finished=False) == "Hello "
    assert deltas.delta("Hello EN", finished=False) == ""
    assert deltas.delta("Hello ENx", finished=False) == "ENx"
    assert deltas.delta("Hello ENx \ufffd", finished=False) == " "
    assert deltas.delta("Hello ENx é", finished=False) == "é"
    # the engine trimmed a matched stop string: nothing of it was ever sent
    trimmed = TextDeltas(stop=("END",))
    assert trimmed.delta("ab EN", finished=False) == "ab "
    assert trimmed.delta("ab ", finished=True) == ""
    assert trimmed.sent == "ab "


def test_speculation_policy_may_carry_its_k():
    body = {"model": "m", "prompt": "hi", "speculation": {"policy": "fixed:4"}}
    request = CompletionRequest.model_validate_json(json.dumps(body))
    assert (request.speculation.policy, request.speculation.max_k) == ("fixed", 4)


@pytest.mark.parametrize("speculation", [
    {"policy": "fixed:x"}, {"policy": "fixed:4", "max_k": 3}, {"policy": "nope:4"},
    {"policy": "fixed:17"},
])
def test_bad_policy_with_k_is_rejected(speculation):
    body = {"model": "m", "prompt": "hi", "speculation": speculation}
    with pytest.raises(ValidationError, match="policy|max_k"):
        CompletionRequest.model_validate_json(json.dumps(body))


@pytest.mark.parametrize(
    "extra",
    [
        {"user": "u1", "metadata": {"a": "b"}, "store": False},  # change nothing: ignored
        {"presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": False, "n": 1},  # off
        {"tools": [], "response_format": {"type": "text"}, "logit_bias": {}, "echo": False},
        {"presence_penalty": None, "repetition_penalty": None, "min_p": None, "top_logprobs": 0},
        {"temperature": None, "top_p": None, "n": None, "stream": None, "logprobs": None,
         "stop": None, "seed": None, "max_tokens": None, "tools": None},  # null: unset
        {"presence_penalty": 0.5, "frequency_penalty": -2, "repetition_penalty": 1.2,
         "min_p": 0.1, "logprobs": True, "top_logprobs": 20, "n": 4},  # implemented
    ],
)
def test_harmless_and_switched_off_fields_are_accepted(extra):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    request = ChatCompletionRequest.model_validate_json(json.dumps(body))
    nulls = {name for name, value in extra.items() if value is None}
    unset = ChatCompletionRequest.model_validate_json(json.dumps(
        {name: value for name, value in body.items() if name not in nulls}))
    assert request == unset


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_logprobs", 2),  # without logprobs: true
        ("echo", True),  # completions only
        ("prompt_logprobs", 1), ("best_of", 2), ("stop_token_ids", [50]),
        ("response_format", {"type": "json_object"}), ("tools", [{"type": "function"}]),
        ("max_tokns", 5),
    ],
)
def test_a_field_that_would_change_the_output_is_refused_by_name(field, value):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], field: value}
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate_json(json.dumps(body))
    refused = info.value.errors()[0]["ctx"]["error"]
    assert isinstance(refused, RefusedField) and refused.param == field


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [("speculation", {"polcy": "fixed"}, "speculation.polcy"),
     ("slo", {"tpot": 50}, "slo.tpot")],
)
def test_a_typo_in_an_extension_is_a_400_naming_it(field, value, param):
    body = {"model": "m", "prompt": "hi", field: value}
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json(json.dumps(body))
    assert validation_error_response(info.value).body == error_response(
        400, f"{param}: Extra inputs are not permitted", "invalid_request_error", param).body


@pytest.mark.parametrize("content", [None, 5, {"type": "text", "text": "a"}])
def test_content_that_is_neither_text_nor_parts_is_refused_by_its_place(content):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"},
                                       {"role": "assistant", "content": content}]}
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate_json(json.dumps(body))
    refused = info.value.errors()[0]["ctx"]["error"]
    assert isinstance(refused, RefusedField) and refused.param == "messages.1.content"


@pytest.mark.parametrize(
    ("part", "field", "named"),
    [({"type": "image_url", "image_url": {"url": "http://x"}}, "type", "'image_url'"),
     ({"type": "input_audio"}, "type", "'input_audio'"),
     ({"text": "no type"}, "type", "only text parts"), ("text", "type", "only text parts"),
     ({"type": "text"}, "text", "string"), ({"type": "text", "text": 5}, "text", "string")],
)
def test_a_part_that_is_not_text_is_refused_by_its_place(part, field, named):
    content = [{"type": "text", "text": "a"}, part]
    body = {"model": "m", "messages": [{"role": "system", "content": "s"},
                                       {"role": "user", "content": content}]}
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate_json(json.dumps(body))
    refused = info.value.errors()[0]["ctx"]["error"]
    assert isinstance(refused, RefusedField) and refused.param == f"messages.1.content.1.{field}"
    assert named in str(refused)


def test_completion_batches_fan_out_prompt_major_with_seeds_per_choice():
    from deployments.api import to_generate_requests

    body = {"model": "m", "prompt": [[1, 2], [3]], "n": 2, "seed": 10, "logprobs": 0,
            "echo": True, "presence_penalty": 0.5}
    requests = to_generate_requests(CompletionRequest.model_validate_json(json.dumps(body)))
    assert [(r.prompt, r.seed) for r in requests] == [
        ([1, 2], 10), ([1, 2], 11), ([3], 10), ([3], 11)
    ]
    assert all(r.logprobs == 0 and r.echo and r.presence_penalty == 0.5 for r in requests)
    body = {"model": "m", "messages": [{"role": "user", "content": "a"}], "logprobs": True}
    chat = to_generate_request(ChatCompletionRequest.model_validate_json(json.dumps(body)))
    assert chat.logprobs == 0 and chat.seed is None and chat.repetition_penalty == 1.0


@pytest.mark.parametrize("field", ["top_logprobs", "prompt_logprobs", "best_of", "suffix"])
def test_completions_refuse_what_they_do_not_implement(field):
    body = {"model": "m", "prompt": "hi", field: 2}
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate_json(json.dumps(body))
    assert info.value.errors()[0]["ctx"]["error"].param == field


def test_top_k_is_taken_and_minus_one_means_none():
    body = {"model": "m", "prompt": "hi", "top_k": 5}
    assert CompletionRequest.model_validate_json(json.dumps(body)).top_k == 5
    assert to_generate_request(
        CompletionRequest.model_validate_json(json.dumps({**body, "top_k": -1}))
    ).top_k == 0


def test_a_model_path_not_on_this_machine_is_named_when_the_app_is_built(tmp_path, capsys):
    """Replicas that cannot load a model report only that they failed; the path is named where
    `serve run` shows it, and a name or a path that is here says nothing."""
    from deployments import build_app

    build_app({"model": str(tmp_path / "missing"), "draft_model": str(tmp_path)})
    err = capsys.readouterr().err
    assert f"model={str(tmp_path / 'missing')!r} is not on this machine" in err
    assert "draft_model" not in err
    build_app({"model": "smollm2-135m-instruct"})
    assert capsys.readouterr().err == ""
