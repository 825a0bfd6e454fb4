"""The request body of OpenAI's Responses API, `POST /v1/responses`, as vLLM 0.32's server takes it
(`vllm/entrypoints/openai/responses/protocol.py`, `ResponsesRequest`) and OpenAI's API reference defines it.

Served: `input` (a string, or input items: messages, `function_call`, `function_call_output`), `instructions`,
function `tools`, `tool_choice` (auto, none, required, a named function), `text.format` (text, json_object,
json_schema), `max_output_tokens`, the sampling fields (with vLLM's `top_k`, `min_p`, `repetition_penalty`, `seed`,
`stop`), `metadata`, `previous_response_id`, `store`, `stream`, `user`, `parallel_tool_calls`. Accepted and without
effect, as vLLM ignores them: `include` (empty, or naming nothing we would add), `service_tier`, `prompt_cache_key`,
`prompt_cache_retention`, `stream_options`, `safety_identifier`, `cache_salt` (a sync resets every cache). Refused
by name (400, OpenAI's error shape): built-in tools (web search, file search, code interpreter, computer use, MCP,
image generation, shell), `background`, `reasoning` set, `conversation`, `prompt` (stored prompts), `truncation:
"auto"`, `top_logprobs` above 0, `max_tool_calls`, and input parts other than text (images, files, audio).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout_svc.openai.schemas import Body, TokenId

# What `include` may name and we serve without adding anything (the rest name output we never make).
_SERVED_INCLUDES = frozenset({"message.output_text.logprobs"})
_METADATA_KEYS, _METADATA_KEY_CHARS, _METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's limits on `metadata`


class FunctionTool(BaseModel):
    """A function tool as the Responses API gives it (flat: no `function` wrapper, unlike chat's)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> dict[str, Any]:
        """The tool as chat completions and the chat template take it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        if self.parameters is not None:
            function["parameters"] = self.parameters
        return {"type": "function", "function": function}


class NamedFunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON under a schema."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError('text.format of type "json_schema" needs a schema')
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")  # verbosity: accepted, as vLLM does
    format: TextFormat | None = None


class ResponsesRequest(Body):
    """`POST /v1/responses`. Raises (as a 400 naming the field) on what is refused above."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | dict[str, Any] = "auto"
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, lt=2**63)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = Field(None, min_length=1, max_length=256)
    store: bool = True
    stream: bool = False
    user: str | None = None
    parallel_tool_calls: bool = True
    truncation: Literal["auto", "disabled"] | None = "disabled"
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, lt=2**63)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    session_id: str | None = Field(None, min_length=1, max_length=256)
    # OpenAI's, refused when set: what they ask for is not served
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None

    def _free_form(self) -> list[tuple[str, Any]]:
        parts: list[tuple[str, Any]] = [("tools", self.tools)]
        if not isinstance(self.input, str):
            parts.append(("input", self.input))
        if self.text is not None and self.text.format is not None:
            parts.append(("text.format.schema", self.text.format.schema_))
        return parts

    def function_tools(self) -> list[FunctionTool]:
        """The tools, each a function tool. Raises ValueError naming a tool of another type (built-in tools run on
        OpenAI's side, which is not here)."""
        tools = []
        for i, tool in enumerate(self.tools):
            kind = tool.get("type")
            if kind != "function":
                raise ValueError(
                    f"tools.{i}: tools of type {kind!r} are not supported by rollout-svc: give function tools (the "
                    "built-in tools such as web search run on OpenAI's servers)"
                )
            tools.append(FunctionTool.model_validate(tool))
        return tools

    @model_validator(mode="after")
    def _served(self) -> ResponsesRequest:
        refused = {
            "background": bool(self.background),
            "reasoning": bool(self.reasoning and any(v is not None for v in self.reasoning.values())),
            "conversation": self.conversation is not None,
            "prompt": self.prompt is not None,
            "max_tool_calls": self.max_tool_calls is not None,
        }
        for name, is_set in refused.items():
            if is_set:
                raise ValueError(f"{name} is not supported by rollout-svc: leave it unset")
        if self.truncation == "auto":
            raise ValueError('truncation "auto" is not supported by rollout-svc: a conversation is never cut')
        if self.top_logprobs:
            raise ValueError("top_logprobs above 0 is not supported on /v1/responses: use /v1/chat/completions")
        unserved = sorted(set(self.include or ()) - _SERVED_INCLUDES)
        if unserved:
            raise ValueError(f"include {unserved[0]!r} is not supported by rollout-svc: it names output we never make")
        if isinstance(self.tool_choice, dict):
            raise ValueError(
                f"tool_choice of type {self.tool_choice.get('type')!r} is not supported: give auto, none, required "
                'or {"type": "function", "name": ...}'
            )
        names = {t.get("name") for t in self.tools if t.get("type") == "function"}
        if self.tool_choice == "required" and not names:
            raise ValueError('tool_choice "required" needs function tools')
        if isinstance(self.tool_choice, NamedFunctionChoice) and self.tool_choice.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.name!r}, which is not among the tools")
        if self.metadata is not None:
            self._check_metadata(self.metadata)
        return self

    @staticmethod
    def _check_metadata(metadata: dict[str, str]) -> None:
        if len(metadata) > _METADATA_KEYS:
            raise ValueError(f"metadata holds {len(metadata)} keys; at most {_METADATA_KEYS}")
        for key, value in metadata.items():
            if len(key) > _METADATA_KEY_CHARS or len(value) > _METADATA_VALUE_CHARS:
                raise ValueError(
                    f"metadata.{key[:20]}: keys are at most {_METADATA_KEY_CHARS} characters, values "
                    f"{_METADATA_VALUE_CHARS}"
                )
