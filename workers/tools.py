"""Tool calls in model output, parsed by vLLM's own tool-call parsers (`vllm.tool_parsers`), in the worker.

The API never imports vLLM: a chat request with `tools` and `tool_choice="auto"` asks its worker to parse
(`RolloutRequest.parse_tool_calls`), and the trajectory carries the calls in OpenAI's shape. Which parser runs is
the worker's setting `--tool-call-parser` (vLLM's names: `hermes`, `llama3_json`, `mistral`, `pythonic`, ...),
as vLLM's `--tool-call-parser` is for its server.
"""

from __future__ import annotations

from typing import Any

from rollout_svc.errors import InvalidRequestError


def parse_tool_calls(
    parser_name: str, tokenizer: Any, text: str, tools: list[dict[str, Any]]
) -> tuple[str | None, list[dict[str, Any]]]:
    """Split `text` (a whole completion) into its content and tool calls with vLLM's parser `parser_name`.

    Returns `(content, calls)`: `calls` is a list of `{"id", "type": "function", "function": {"name", "arguments"}}`
    (arguments as JSON text), empty when the model called no tool (then `content` is `text`). `tokenizer` is the
    engine's (some parsers look up their marker tokens in its vocabulary).
    Raises `InvalidRequestError` for a parser name vLLM does not know.
    """
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    try:
        parser_cls = ToolParserManager.get_tool_parser(parser_name)
    except KeyError as exc:
        known = ", ".join(sorted(ToolParserManager.list_registered()))
        raise InvalidRequestError(f"unknown tool call parser {parser_name!r}; vLLM has: {known}") from exc
    request = ChatCompletionRequest(
        model="", messages=[{"role": "user", "content": ""}], tools=tools, tool_choice="auto"
    )
    parser = parser_cls(tokenizer, request.tools)  # type: ignore[arg-type]  # vLLM widened the type in 0.32
    info = parser.extract_tool_calls(text, request)
    if not info.tools_called:
        return text, []
    return info.content or None, [call.model_dump(mode="json") for call in info.tool_calls]
