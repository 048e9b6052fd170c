"""SGLang's native fields that ask for a feature gramsync does not have, and when they ask
for nothing.

SGLang's own clients send some of them with every request, at their defaults (its
``RuntimeEndpoint`` sends ``spaces_between_special_tokens: true`` and the logprob fields;
other clients send ``lora_path: null`` or ``return_hidden_states: false``). Such a value is
accepted and changes nothing. A value that asks for the feature is refused with a 400
naming the field and why, never served without it (docs/api.md has the table).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping


def _absent(v: Any) -> bool:
    """null, or an empty / all-null list (SGLang's "no data", also per item of a batch)."""
    return v is None or (isinstance(v, list) and all(_absent(x) for x in v))


def _is(value: Any) -> Callable[[Any], bool]:
    def same(v: Any) -> bool:  # null, the default, or a batch's list of them
        return v is None or v is value or (isinstance(v, list) and all(same(x) for x in v))
    return same


def _any_of(*types: type) -> Callable[[Any], bool]:
    return lambda v: v is None or (isinstance(v, types) and not (isinstance(v, bool) and bool not in types))


_NO_MEDIA = "this server serves a text-only model"
# Top-level /generate fields: name -> (asks for nothing?, why another value is refused).
REQUEST_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "input_embeds": (_absent, "send text or input_ids"),
    "image_data": (_absent, _NO_MEDIA),
    "video_data": (_absent, _NO_MEDIA),
    "audio_data": (_absent, _NO_MEDIA),
    "modalities": (_absent, _NO_MEDIA),
    "use_audio_in_video": (_is(False), _NO_MEDIA),
    "lora_path": (_absent, "LoRA adapters are not served"),
    "lora_id": (_absent, "LoRA adapters are not served"),
    "session_params": (_absent, "sessions are not served; send the whole prompt (the prefix cache reuses it)"),
    "token_ids_logprob": (_absent, "logprobs of chosen token ids are not served; use top_logprobs_num"),
    "return_hidden_states": (_is(False), "hidden states are not returned"),
    "return_routed_experts": (_is(False), "routed experts are not returned"),
    "return_entropy": (_is(False), "entropies are not returned"),
    "return_bytes": (_is(False), "only text output is served"),
    "background": (_is(False), "background requests are not served"),
    "bootstrap_host": (_absent, "prefill/decode disaggregation is not served"),
    "bootstrap_port": (_absent, "prefill/decode disaggregation is not served"),
    "bootstrap_room": (_absent, "prefill/decode disaggregation is not served"),
    "bootstrap_pair_key": (_absent, "prefill/decode disaggregation is not served"),
    "data_parallel_rank": (_absent, "requests are placed by --load-balance-method"),
    "routed_dp_rank": (_absent, "requests are placed by --load-balance-method"),
    "priority": (_absent, "requests are scheduled by --schedule-policy, not by priority"),
    "extra_key": (_absent, "cache salts are not served"),
    "routing_key": (_absent, "requests are placed by --load-balance-method"),
    "custom_labels": (_absent, "metrics carry no per-request labels"),
    # Bookkeeping only: any value of the right type asks for nothing here.
    "log_metrics": (_any_of(bool), "it must be a boolean"),
    "no_logs": (_any_of(bool), "it must be a boolean"),
    "conversation_id": (_any_of(str), "it must be a string"),
    "external_trace_header": (_any_of(dict), "it must be an object"),
    "received_time": (_any_of(int, float), "it must be a number"),
}

# sampling_params fields (the same rule).
SAMPLING_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    # SGLang's default, sent by its RuntimeEndpoint; fast tokenizers have no such setting.
    "spaces_between_special_tokens": (_is(True), "decoding follows the tokenizer's own spacing"),
    "no_stop_trim": (_is(False), "a matched stop string or token is never shown"),
    "stop_regex": (_absent, "stop regexes are not served; use stop strings or a regex constraint"),
    "stream_interval": (_absent, "streams send every step's tokens (the server's own setting)"),
}


def take_neutral(d: Mapping[str, Any], fields: dict, where: str) -> dict:
    """``d`` without the fields of ``fields``, each checked to ask for nothing (else a
    ValueError naming it, its value and why)."""
    out = {}
    for name, value in d.items():
        if name not in fields:
            out[name] = value
            continue
        neutral, why = fields[name]
        if not neutral(value):
            raise ValueError(f"{where}{name} is not supported by this server (got {value!r}): {why}.")
    return out


def take_sampling_seed(sp: dict) -> dict:
    """SGLang's ``sampling_seed`` is our ``seed``; both given, they must agree."""
    if sp.get("sampling_seed") is None:
        sp.pop("sampling_seed", None)
        return sp
    seed = sp.pop("sampling_seed")
    if sp.get("seed") not in (None, seed):
        raise ValueError(f"sampling_seed ({seed!r}) and seed ({sp['seed']!r}) are both given and differ.")
    sp["seed"] = seed
    return sp
