"""OpenAI request bodies, with vLLM's sampling extensions where OpenAI has none.

Requests ignore fields they do not know (clients send newer OpenAI options freely), logging each name
once (:mod:`.request_fields`), but reject the known ones we cannot honour. An explicit ``null`` means the
default, as OpenAI's spec and vLLM read it, for every field that has one.
"""

from __future__ import annotations

import functools
import types
import typing
from typing import Annotated, Any, Literal, Self, TypeVar, cast

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Strict, Tag, field_validator, model_validator

from iterserve.sampling_params import (
    MAX_LOGIT_BIAS,
    MIN_TOP_P,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
)
from iterserve.server.errors import bad_request
from iterserve.server.request_fields import report_ignored
from iterserve.server.text_checks import first_lone_surrogate

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


# -- requests -------------------------------------------------------------------------------------


def _prompt_kind(value: Any) -> str | None:
    """Which shape of prompt ``value`` is, judged by its first element, so that pydantic validates
    only that shape: trying each in turn reports an error per element of a million-item list."""
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    first = value[0] if value else None
    return "texts" if isinstance(first, str) else "id_lists" if isinstance(first, list) else "ids"


T = TypeVar("T")
# An integer that refuses floats, bools and numeric strings rather than reading 2.5 as 2 or true as 1.
Int = Annotated[int, Strict()]
# A list whose validation stops at the first bad element: reporting an error for each element of a
# million-element list takes pydantic (and FastAPI after it) tens of seconds on the event loop.
ListOf = Annotated[list[T], Field(fail_fast=True)]
Prompt = Annotated[
    Annotated[str, Tag("text")] | Annotated[ListOf[Int], Tag("ids")] | Annotated[ListOf[str], Tag("texts")]
    | Annotated[ListOf[ListOf[Int]], Tag("id_lists")],
    Discriminator(_prompt_kind, custom_error_type="prompt_type",
                  custom_error_message="must be a string, a list of token ids, or a list of either"),
]


class _Request(BaseModel):
    # Non-finite floats are refused: JSON parsers accept NaN/Infinity and the sampler cannot use them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """``"n": null``, ``"stream": null``, ...: the field's default, as OpenAI and vLLM read them (routers
        forward unset fields as null). A field that takes null as a value of its own keeps it."""
        if isinstance(data, dict) and (defaulted := _null_defaulted_fields(cls)):
            if any(data.get(name, 0) is None for name in defaulted):
                return {k: v for k, v in data.items() if not (v is None and k in defaulted)}
        return data

    @field_validator("*")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        """JSON can carry a lone surrogate (an unpaired \\ud800 escape): Python decodes it into a string
        that neither the tokenizer nor a UTF-8 response can encode, so it is refused, naming the field."""
        if (found := first_lone_surrogate(value)) is not None:
            text, index = found
            raise ValueError(f"contains a lone surrogate (U+{ord(text[index]):04X}) at index {index} of a string; "
                             "text must be valid Unicode")
        return value


class RequestBody(_Request):
    """A whole request body. Fields it does not know are dropped with a log line naming them, as vLLM
    logs them: clients send newer OpenAI options freely, and a 400 would break them for nothing."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="after")
    def _drop_unknown_fields(self) -> Self:
        if self.model_extra:
            report_ignored(self.model_extra)
            self.model_extra.clear()
        return self


@functools.cache
def _null_defaulted_fields(model: type[BaseModel]) -> frozenset[str]:
    """The fields of ``model`` (by name and alias) with a default whose type does not take None."""
    names: set[str] = set()
    for name, info in model.model_fields.items():
        if info.is_required() or info.default is None or _takes_none(info.annotation):
            continue
        names.update(n for n in (name, info.alias) if n)
    return frozenset(names)


def _takes_none(annotation: Any) -> bool:
    if annotation is None or annotation is type(None) or annotation is Any:
        return True
    if typing.get_origin(annotation) is Annotated:
        return _takes_none(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_takes_none(arg) for arg in typing.get_args(annotation))
    return False


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingRequest(RequestBody):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: Int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | ListOf[str] | None = None
    seed: Int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: Int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: Int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: ListOf[Int] | None = None
    include_stop_str_in_output: bool = False
    bad_words: ListOf[str] | None = None
    allowed_token_ids: ListOf[Int] | None = None
    spaces_between_special_tokens: bool = True
    # output constraints: OpenAI's response_format, vLLM's guided_* fields and its structured_outputs object
    response_format: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: ListOf[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _logit_bias_size(cls, value: Any) -> Any:
        """Refused by its size before its entries (any number of them) are parsed."""
        if isinstance(value, dict) and len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"has {len(value)} entries; at most {MAX_LOGIT_BIAS} are allowed")
        return value

    def check_supported(self) -> None:
        """Refuse options we do not implement, naming the parameter."""
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options can only be set when stream is true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The output constraint the request asks for, if any; a 400 naming the parameter when it is
        malformed, does not compile, or more than one is given."""
        source = self._structured_outputs_source()
        return None if source is None else structured_outputs_from(*source)

    @property
    def structured_outputs_field(self) -> str | None:
        """The field that gives the output constraint: what an error in its grammar names."""
        source = self._structured_outputs_source()
        return None if source is None else source[0]

    def _structured_outputs_source(self) -> tuple[str, dict[str, Any]] | None:
        sources: list[tuple[str, dict[str, Any]]] = []
        if self.response_format is not None and self.response_format.get("type") != "text":
            sources.append(("response_format", _response_format_fields(self.response_format)))
        guided = {"json": self.guided_json, "regex": self.guided_regex, "choice": self.guided_choice,
                  "grammar": self.guided_grammar}
        sources += [(f"guided_{kind}", {kind: value}) for kind, value in guided.items() if value is not None]
        if self.structured_outputs:
            if self.structured_outputs.get("structural_tag") is not None:
                raise bad_request("structured_outputs.structural_tag is not supported", "structured_outputs")
            fields = {k: v for k, v in self.structured_outputs.items()
                      if k in STRUCTURED_OUTPUT_KINDS and v not in (None, False)}
            if self.structured_outputs.get("disable_additional_properties") is not None:
                fields["disable_additional_properties"] = self.structured_outputs["disable_additional_properties"]
            sources.append(("structured_outputs", fields))
        if not sources:
            return None
        if len(sources) > 1:
            names = ", ".join(name for name, _ in sources)
            raise bad_request(f"give at most one output constraint; got {names}", sources[1][0])
        return sources[0]

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, **extra: Any) -> SamplingParams:
        """Build SamplingParams (``extra``: fields only one endpoint has), which checks every limit; an
        invalid value becomes a 400 naming it. A top_p between 0 and SamplingParams' minimum keeps only the
        top token, as it means."""
        temperature = 1.0 if self.temperature is None else self.temperature
        top_p = 1.0 if self.top_p is None else self.top_p
        if 0 < top_p < MIN_TOP_P:
            top_p = MIN_TOP_P
        stop = [self.stop] if isinstance(self.stop, str) else self.stop or []
        try:
            return SamplingParams(
                temperature=temperature, top_p=top_p, top_k=self.top_k, min_p=self.min_p,
                repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, seed=self.seed, max_tokens=max_tokens,
                min_tokens=self.min_tokens, stop=stop, stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
                n=self.n, logit_bias=cast(Any, self.logit_bias),  # SamplingParams reads the string ids
                include_stop_str_in_output=self.include_stop_str_in_output, bad_words=self.bad_words or [],
                allowed_token_ids=self.allowed_token_ids,
                spaces_between_special_tokens=self.spaces_between_special_tokens, **extra,
            )
        except SamplingParamsError as e:
            raise bad_request(str(e), e.param) from e


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def structured_outputs_from(param: str, fields: dict[str, Any]) -> StructuredOutputsParams:
    """StructuredOutputsParams from request fields; a 400 naming ``param`` when they are invalid."""
    try:
        return StructuredOutputsParams(**fields)
    except SamplingParamsError as e:
        raise bad_request(f"{param}: {e}", param) from e


def _response_format_fields(fmt: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's response_format as StructuredOutputsParams fields."""
    kind = fmt.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise bad_request(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          "response_format")
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise bad_request("response_format json_schema needs a 'schema' object", "response_format")
    return {"json": schema}


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    max_tokens: Int | None = COMPLETION_DEFAULT_MAX_TOKENS
    logprobs: Int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Int | None = None
    prompt_logprobs: Int | None = None  # vLLM extension: top alternatives for each prompt token

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise bad_request("suffix (insertion) is not supported", "suffix")
        if self.stream and self.prompt_logprobs is not None:  # as vLLM: they come with the final output
            raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        if self.stream and self.best_of is not None and self.best_of > self.n:
            raise bad_request("best_of greater than n cannot be streamed: the best are known only at the end",
                              "best_of")

    def completion_params(self, structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """With echo and logprobs, the prompt's logprobs too (as OpenAI and vLLM return them)."""
        echoed = self.logprobs if self.echo and self.logprobs is not None else None
        asked = [n for n in (echoed, self.prompt_logprobs) if n is not None]
        prompt_logprobs = max(asked) if asked else None
        return self.sampling_params(self.max_tokens, self.logprobs, best_of=self.best_of,
                                    structured_outputs=structured_outputs,
                                    prompt_logprobs=prompt_logprobs)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | ListOf[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: ListOf[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool message: the call it answers


# A conversation's messages: each costs pydantic a model and the chat template a turn, and 100,000 of
# them (3.3 MB) took seconds to validate; no chat model's context holds this many turns.
MAX_MESSAGES = 4096
Messages = Annotated[ListOf[ChatMessage], Field(max_length=MAX_MESSAGES)]


class FunctionDefinition(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[Messages, Field(min_length=1)]
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    tools: ListOf[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None
    function_call: Any = None
    # vLLM extensions
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False  # the reply starts with the last message's text when that is the assistant's
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.functions:
            raise bad_request("functions (the deprecated form of tools) is not supported; send tools", "functions")
        if self.function_call not in (None, "none"):
            raise bad_request("function_call is not supported; send tool_choice", "function_call")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise bad_request("tool_choice needs tools", "tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_options(self) -> dict[str, Any]:
        """The chat template's arguments beside the messages and tools (vLLM's request fields)."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, "chat_template": self.chat_template,
                **(self.chat_template_kwargs or {})}

    @property
    def echoed(self) -> str:
        """The text ``echo`` puts before the reply: the last message's, when it is the assistant's."""
        last = self.messages[-1]
        return last.content if self.echo and last.role == "assistant" and isinstance(last.content, str) else ""


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: Messages | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: ListOf[Int]

