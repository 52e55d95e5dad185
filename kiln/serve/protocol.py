"""OpenAI-compatible request and response schemas (pydantic), plus kiln's sampling extras.

Requests are strict: a field kiln does not implement is a 400 naming it, never dropped,
except the few ``SamplingFields`` lists as accepted and ignored (bookkeeping that changes no output). A field kiln does
not implement sent as null (or an empty list) asks for nothing and is accepted. Limits OpenAI
sets are checked here (``temperature`` in [0, 2], ``n`` up to 128, ``stop`` and
``logit_bias`` sizes); value ranges shared with the Python API are checked by
:class:`SamplingParams`, so both reject the same things with the same messages.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_N = 128  # OpenAI's bound; the server also bounds n by its batch size


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class _Strict(BaseModel):
    """Unknown fields are refused (``extra_forbidden``: the server answers 400 naming them);
    one sent as null or [] asks for nothing and is dropped first."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _drop_empty_unknown_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if k in cls.model_fields or not (v is None or v == [])}


class StreamOptions(_Strict):
    include_usage: bool = False


StopString = Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]


class JsonSchemaFormat(_Strict):
    name: str = Field(max_length=64)
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None  # kiln always holds the output to the schema
    description: str | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON held to a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Strict):
    """vLLM's ``structured_outputs`` object: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingFields(_Strict):
    """Fields both endpoints share."""

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Union[StopString, Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)], None] = None
    temperature: float | None = Field(None, ge=0, le=2)  # OpenAI's default: 1.0
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI fields accepted and ignored: they label or route a request, changing nothing in its output
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # kiln extras (vLLM names)
    top_k: int = 0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs object and guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False  # the answer starts with the prompt (and its tokens' log-probs); max_tokens 0: only that
    prompt_logprobs: int | None = None  # vLLM's: each choice's prompt_logprobs, with the top-k of every token
    best_of: int | None = None  # only best_of == n (or unset) is served; see completions.serve
    suffix: str | None = None  # likewise: insertion is not supported


class FunctionDefinition(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments object
    strict: bool | None = None  # kiln holds the arguments to the schema whenever tool_choice forces a call


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text of the arguments object


class ToolCallBody(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    # "function" is OpenAI's deprecated spelling of "tool": a known role that gets a clear 400.
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None
    tool_calls: list[ToolCallBody] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a tool message answers


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None  # OpenAI's default: true


class TokenizeRequest(_Strict):
    """vLLM's ``/tokenize``: a prompt, or chat messages as the chat template renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None  # rendered with messages, as a chat request with tool_choice auto
    add_special_tokens: bool = True  # for a prompt
    add_generation_prompt: bool = True  # for messages


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "kiln"
    parent: str | None = None  # a LoRA adapter's base model


class LoadLoraAdapterRequest(BaseModel):
    lora_name: str  # the model name requests will use
    lora_path: str  # a PEFT adapter directory or a kiln lora convert directory, on the server


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's entry of a prompt token's ``prompt_logprobs`` (rank 1: the most likely token)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: per prompt token (None for the first), token id -> its entry; when asked for
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallBody] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int  # of the call in the message; a call's deltas share it
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ApiError(Exception):
    """An error answered as OpenAI error JSON with ``status`` (and HTTP ``headers``)."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers

    @classmethod
    def internal(cls, error: BaseException) -> ApiError:
        """The 500 of a request kiln failed to serve (a bug: the other requests go on)."""
        return cls(500, f"internal error while serving this request: {error!r}", None, "server_error")

    def body(self) -> dict:
        return ErrorResponse(error=ErrorBody(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()
