"""Request bodies of the OpenAI-compatible API: OpenAI's chat and completions (with vLLM's extra fields), tokenize.

Field names and meanings follow OpenAI's API reference and vLLM's OpenAI-compatible server
(`vllm/entrypoints/openai/*/protocol.py`): the extra sampling fields (`top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, `min_tokens`, `stop_token_ids`, `skip_special_tokens`, `include_stop_str_in_output`,
`return_token_ids`, `chat_template_kwargs`) are vLLM's; `session_id` is SkyRL's. Fields OpenAI defines that we do
not use (`user`, `store`, `metadata`, ...) are ignored, as vLLM ignores them; a bad value of a field we use is a
400 naming it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# What msgpack, the workers' wire format, carries: a larger integer fails encoding. Typed fields are bounded; the
# free-form parts of a body (tool parameters, extra message fields, `chat_template_kwargs`) are walked.
_WIRE_INTS = range(-(2**63), 2**64)
Count = Annotated[int, Field(ge=0, lt=2**63)]
TokenId = Annotated[int, Field(ge=0, lt=2**63)]


def check_wire_ints(path: str, value: Any) -> None:
    """Raise ValueError naming the first integer in `value` (nested dicts and lists) that does not fit in 64 bits."""
    stack: list[tuple[str, Any]] = [(path, value)]
    while stack:  # no recursion: a body nested as deep as the JSON parser allows is walked too
        where, item = stack.pop()
        if isinstance(item, int) and item not in _WIRE_INTS:
            raise ValueError(f"{where}: {item} is out of range: integers must fit in 64 bits")
        if isinstance(item, dict | list):
            items = item.items() if isinstance(item, dict) else enumerate(item)
            stack += [(f"{where}.{key}" if where else str(key), child) for key, child in items]


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # strict: `true` or "16" is no number, as OpenAI says

    def _free_form(self) -> list[tuple[str, Any]]:
        """The parts of this body whose integers no type bounds: (path, value)."""
        return []

    @model_validator(mode="after")
    def _ints_fit_the_wire(self) -> Body:
        for path, value in self._free_form():
            if value:
                check_wire_ints(path, value)
        return self


class ContentPart(BaseModel):
    """A part of a message's content; only text parts are served (the model reads text)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessageIn(BaseModel):
    """One message of a conversation, as OpenAI's chat API takes it."""

    model_config = ConfigDict(extra="allow")  # name, tool_calls, tool_call_id: passed to the chat template
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The message as a worker's chat template takes it: its fields, the content as one string. Raises ValueError
        on a content part that is not text."""
        return {**self.model_dump(exclude_none=True), "content": self.text()}

    def text(self) -> str:
        """The content as one string (text parts joined). Raises ValueError on a part that is not text."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ValueError(f"content parts of type {part.type!r} are not supported: send text")
            texts.append(part.text)
        return "".join(texts)


def _message_extras(messages: list[ChatMessageIn]) -> list[tuple[str, Any]]:
    """The fields of messages (and of their content parts) that no type covers: passed on as they are."""
    parts: list[tuple[str, Any]] = []
    for i, message in enumerate(messages):
        parts.append((f"messages.{i}", message.model_extra))
        if isinstance(message.content, list):
            parts += [(f"messages.{i}.content.{j}", p.model_extra) for j, p in enumerate(message.content)]
    return parts


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class JsonSchema(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError('response_format of type "json_schema" needs json_schema.schema')
        return self


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(Body):
    """What chat and completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=1, lt=2**63)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=128)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, lt=2**63)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    min_tokens: Count = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:N" (TRL parses them so)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # per prompt position: its token's and the top k
    structured_outputs: dict[str, Any] | None = None  # vLLM's `StructuredOutputsParams`: json, regex, choice, ...
    # vLLM's prefix-cache salt: accepted and not needed (a weight sync resets every cache; see docs/prime-rl.md)
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    # SkyRL's: the conversation's session (the X-Session-ID header wins)
    session_id: str | None = Field(None, min_length=1, max_length=256)

    def _free_form(self) -> list[tuple[str, Any]]:
        return [("structured_outputs", self.structured_outputs)]


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, lt=2**63)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's chat templating fields (the template is ours: the worker renders it)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = Field(None, min_length=1)
    # OpenAI's, not implemented: refused when set (a bias changes sampling)
    logit_bias: dict[str, float] | None = None

    def template_kwargs(self) -> dict[str, Any] | None:
        """What goes into the chat template (Hugging Face `apply_chat_template`): `chat_template_kwargs`, then the
        templating fields where they differ from their defaults (they win, as in vLLM's server)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if not self.add_generation_prompt:
            kwargs["add_generation_prompt"] = False
        if self.continue_final_message:
            kwargs["continue_final_message"] = True
        if self.chat_template is not None:
            kwargs["chat_template"] = self.chat_template
        return kwargs or None

    def _free_form(self) -> list[tuple[str, Any]]:
        parts = _message_extras(self.messages)
        if self.tools:
            parts.append(("tools", [t.model_dump() for t in self.tools]))
        if self.response_format is not None and self.response_format.json_schema is not None:
            parts.append(("response_format.json_schema", self.response_format.json_schema.model_dump()))
        parts.append(("chat_template_kwargs", self.chat_template_kwargs))
        return parts + super()._free_form()

    @model_validator(mode="after")
    def _consistent(self) -> ChatCompletionRequest:
        if self.logit_bias:
            raise ValueError("logit_bias is not implemented by rollout-svc: leave it unset")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt: false (as in vLLM)")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if isinstance(self.tool_choice, NamedToolChoice) or self.tool_choice == "required":
            names = {t.function.name for t in self.tools or []}
            if not names:
                raise ValueError(f"tool_choice {self.tool_choice!r} needs tools")
            if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools")
        return self


class CompletionRequest(_Sampling):
    """`POST /v1/completions`: `prompt` is a text, a list of texts, token ids, or a list of token-id lists."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(16, ge=1, lt=2**63)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per completion, in order. Raises ValueError on an empty one."""
        prompt = self.prompt
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise ValueError("prompt is empty")
        for item in items:
            if not item:
                raise ValueError("prompt holds an empty prompt")
            if isinstance(item, list) and any(t < 0 for t in item):
                raise ValueError("token ids are >= 0")
        return items


class TokenizeBody(Body):
    """`POST /tokenize` (vLLM's): a text `prompt`, or chat `messages` rendered with a generation prompt."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool = True

    def _free_form(self) -> list[tuple[str, Any]]:
        return _message_extras(self.messages or [])

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeBody:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeBody(Body):
    """`POST /detokenize` (vLLM's)."""

    model: str | None = None
    tokens: list[TokenId] = Field(min_length=1)
